package usage

import (
	"bytes"
	"encoding/json"
	"errors"
	"testing"
)

func TestAmbiguousBodiesAreRefused(t *testing.T) {
	const chat, gemini = "/v1/chat/completions", "/v1beta/models/gemini-2.0-flash:generateContent"
	tests := []struct {
		name   string
		format Format
		path   string
		body   string
		ok     bool
	}{
		{"plain", OpenAIChat, chat, `{"model":"gpt-4o","max_tokens":10,"messages":[]}`, true},
		{"unknown fields in any case pass", OpenAIChat, chat, `{"model":"gpt-4o","Foo":1,"foo":2,"messages":[{"Role":"user","content":"x"}]}`, true},
		{"case-variant model", OpenAIChat, chat, `{"model":"gpt-4o","MODEL":"gpt-4o-mini"}`, false},
		{"only a case-variant model", OpenAIChat, chat, `{"Model":"gpt-4o-mini"}`, false},
		{"case-variant cap beside the real one", OpenAIChat, chat, `{"model":"m","max_tokens":20000,"Max_Tokens":1}`, false},
		{"duplicate cap", OpenAIChat, chat, `{"model":"m","max_tokens":20000,"max_tokens":1}`, false},
		{"escaped duplicate", OpenAIChat, chat, `{"model":"m","\u006dodel":"cheap"}`, false},
		{"Kelvin sign folds like k", OpenAIChat, chat, "{\"model\":\"m\",\"max_to\u212aens\":1,\"max_tokens\":9}", false},
		{"nested include_usage variant", OpenAIChat, chat, `{"model":"m","stream":true,"stream_options":{"include_usage":true,"Include_Usage":false}}`, false},
		{"nested generationConfig duplicate", Gemini, gemini, `{"contents":[],"generationConfig":{"maxOutputTokens":5,"maxOutputTokens":9000}}`, false},
		{"nested options variant", OpenAIChat, chat, `{"model":"m","options":{"NUM_PREDICT":5}}`, false},
		{"keys inside strings are text", OpenAIChat, chat, `{"model":"m","messages":[{"role":"user","content":"\"MODEL\": \"x\", \"model\":"}]}`, true},
		{"gemini snake_case alone", Gemini, gemini, `{"system_instruction":{"parts":[]},"generation_config":{"max_output_tokens":5,"candidate_count":2}}`, true},
		{"generationConfig in both spellings", Gemini, gemini, `{"generationConfig":{"maxOutputTokens":9000},"generation_config":{"max_output_tokens":5}}`, false},
		{"systemInstruction in both spellings", Gemini, gemini, `{"systemInstruction":{"parts":[{"text":"a"}]},"system_instruction":{"parts":[]}}`, false},
		{"maxOutputTokens in both spellings", Gemini, gemini, `{"generation_config":{"maxOutputTokens":9000,"max_output_tokens":5}}`, false},
		{"candidateCount in both spellings", Gemini, gemini, `{"generationConfig":{"candidate_count":1,"candidateCount":8}}`, false},
		{"case-variant snake parent", Gemini, gemini, `{"Generation_Config":{"max_output_tokens":5}}`, false},
		{"case-variant snake field", Gemini, gemini, `{"generation_config":{"Max_Output_Tokens":5}}`, false},
		{"part with inlineData in both spellings", Gemini, gemini, `{"contents":[{"parts":[{"inlineData":{"data":"x"},"inline_data":{"data":"y"}}]}]}`, false},
		{"part with fileData in both spellings", Gemini, gemini, `{"system_instruction":{"parts":[{"file_data":{},"fileData":{}}]}}`, false},
		{"duplicate best_of", OpenAICompletions, "/v1/completions", `{"model":"m","best_of":1,"best_of":20}`, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseRequest(tt.format, tt.path, []byte(tt.body))
			if tt.ok && err != nil {
				t.Fatalf("refused: %v", err)
			}
			if !tt.ok && !errors.Is(err, ErrAmbiguous) {
				t.Fatalf("error %v, want ErrAmbiguous", err)
			}
		})
	}
}

// FuzzParseRequestReadsExactCase: whatever the body, what the budget reads is
// what an exact-case reader (an upstream) reads.
func FuzzParseRequestReadsExactCase(f *testing.F) {
	for _, s := range []string{
		`{"model":"gpt-4o","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"gpt-4o","MODEL":"gpt-4o-mini"}`,
		`{"model":"m","max_completion_tokens":7,"n":2,"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"m","\u006dax_tokens":3}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, err := ParseRequest(OpenAIChat, "/v1/chat/completions", body)
		if err != nil {
			return
		}
		var exact map[string]json.RawMessage
		if err := json.Unmarshal(body, &exact); err != nil {
			t.Fatalf("accepted a body an exact reader cannot read: %v", err)
		}
		var model string
		if err := json.Unmarshal(exact["model"], &model); err != nil || model != req.Model {
			t.Fatalf("budget read model %q, an exact reader %q (%v)", req.Model, model, err)
		}
		var capv int64
		for _, k := range []string{"max_tokens", "max_completion_tokens", "max_output_tokens"} {
			var v int64
			if raw, ok := exact[k]; ok && json.Unmarshal(raw, &v) == nil {
				capv = max(capv, v)
			}
		}
		if capv != req.MaxOutputTokens {
			t.Fatalf("budget read an output cap of %d, an exact reader %d", req.MaxOutputTokens, capv)
		}
	})
}

// BenchmarkCheckAmbiguous is the exact-case check alone, on a chat request
// with a 4 KB conversation; BenchmarkParseRequest the whole parse.
func BenchmarkCheckAmbiguous(b *testing.B) {
	body := benchBody()
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if err := checkAmbiguous(body); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkParseRequest(b *testing.B) {
	body := benchBody()
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ParseRequest(OpenAIChat, "/v1/chat/completions", body); err != nil {
			b.Fatal(err)
		}
	}
}

func benchBody() []byte {
	msgs := make([]map[string]string, 0, 16)
	for i := 0; i < 16; i++ {
		msgs = append(msgs, map[string]string{"role": "user", "content": string(make([]byte, 0)) + "tell me about the weather in a city with a long name, please, and explain your reasoning"})
	}
	body, _ := json.Marshal(map[string]any{"model": "gpt-4o", "max_tokens": 500, "stream": true,
		"stream_options": map[string]bool{"include_usage": true}, "messages": msgs})
	return body
}

// BenchmarkCheckAmbiguousTokens is the same check written with the standard
// library's token reader, the alternative to the scanner of keys.go.
func BenchmarkCheckAmbiguousTokens(b *testing.B) {
	body := benchBody()
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		dec := json.NewDecoder(bytes.NewReader(body))
		if _, err := dec.Token(); err != nil {
			b.Fatal(err)
		}
		seen := map[int]bool{}
		for dec.More() {
			tok, err := dec.Token()
			if err != nil {
				b.Fatal(err)
			}
			key := tok.(string)
			if i, exact := matchField(key, topFields); i >= 0 {
				if seen[i] || !exact {
					b.Fatal("ambiguous")
				}
				seen[i] = true
			}
			var skip json.RawMessage
			if err := dec.Decode(&skip); err != nil {
				b.Fatal(err)
			}
		}
	}
}
