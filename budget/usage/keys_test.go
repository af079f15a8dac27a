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

// upstreamReading is what an upstream reads of a request body: keys by exact
// case, Gemini's fields in either proto JSON spelling.
type upstreamReading struct {
	model  string
	n, cap int64
	// undefined names a field given in both its spellings: which one the
	// upstream serves is not defined.
	undefined string
}

// readAsUpstream is the reference reader of the fields the budget reads,
// written without the budget's code: a map decode keeps keys as written.
func readAsUpstream(f Format, body []byte) (r upstreamReading, err error) {
	top, err := exactObject(body)
	if err != nil {
		return r, err
	}
	// member is the value of the field spelled by spellings, null as absent.
	member := func(obj map[string]json.RawMessage, spellings ...string) json.RawMessage {
		var found json.RawMessage
		for _, s := range spellings {
			if v, ok := obj[s]; ok {
				if found != nil {
					r.undefined = s
				}
				found = v
			}
		}
		if string(bytes.TrimSpace(found)) == "null" {
			return nil
		}
		return found
	}
	integer := func(raw json.RawMessage) int64 {
		var v int64
		if raw != nil && err == nil {
			err = json.Unmarshal(raw, &v)
		}
		return v
	}
	r.n = 1
	if n := integer(member(top, "n")); n > 0 {
		r.n = n
	}
	switch f {
	case OpenAIChat:
		r.cap = max(integer(member(top, "max_tokens")), integer(member(top, "max_completion_tokens")))
	case OpenAICompletions, Anthropic:
		r.cap = integer(member(top, "max_tokens"))
		if f == OpenAICompletions {
			r.n = max(r.n, integer(member(top, "best_of")))
		}
	case OpenAIResponses:
		r.cap = integer(member(top, "max_output_tokens"))
	case Gemini:
		config, cerr := exactObject(member(top, "generationConfig", "generation_config"))
		if cerr != nil {
			return r, cerr
		}
		r.cap = integer(member(config, "maxOutputTokens", "max_output_tokens"))
		if c := integer(member(config, "candidateCount", "candidate_count")); c > 0 {
			r.n = c
		}
	case Ollama:
		options, oerr := exactObject(member(top, "options"))
		if oerr != nil {
			return r, oerr
		}
		r.cap = max(0, integer(member(options, "num_predict")))
	}
	if f != Gemini {
		if err := json.Unmarshal(top["model"], &r.model); err != nil {
			return r, err
		}
	}
	return r, err
}

func exactObject(raw []byte) (map[string]json.RawMessage, error) {
	var obj map[string]json.RawMessage
	if len(raw) == 0 {
		return obj, nil
	}
	return obj, json.Unmarshal(raw, &obj)
}

// fuzzFormats are the formats the request fuzzers pick from, with a path of
// each.
var fuzzFormats = []struct {
	format Format
	path   string
}{
	{OpenAIChat, "/v1/chat/completions"},
	{OpenAICompletions, "/v1/completions"},
	{OpenAIResponses, "/v1/responses"},
	{Anthropic, "/v1/messages"},
	{Gemini, "/v1beta/models/gemini-2.5-flash:generateContent"},
	{Ollama, "/api/chat"},
	{OpenAIEmbeddings, "/v1/embeddings"},
}

// requestSeeds are bodies for the request fuzzers, by index in fuzzFormats.
var requestSeeds = []struct {
	format int
	body   string
}{
	{0, `{"model":"gpt-4o","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`},
	{0, `{"model":"gpt-4o","MODEL":"gpt-4o-mini"}`},
	{0, `{"model":"m","max_completion_tokens":7,"n":2,"stream":true,"stream_options":{"include_usage":true}}`},
	{0, `{"model":"m","\u006dax_tokens":3}`},
	{0, `{"model":"m","max_tokens":null,"stream":true,"stream_options":null}`},
	{1, `{"model":"m","prompt":"x","best_of":20,"max_tokens":1000}`},
	{2, `{"model":"m","input":"x","max_output_tokens":5}`},
	{3, `{"model":"m","max_tokens":5,"messages":[]}`},
	{4, `{"contents":[],"generation_config":{"candidate_count":8,"max_output_tokens":1000}}`},
	{4, `{"generationConfig":{"candidateCount":2,"maxOutputTokens":10},"generation_config":{"max_output_tokens":5}}`},
	{4, `{"generationConfig":{"candidateCount":2,"candidate_count":3}}`},
	{5, `{"model":"m","options":{"num_predict":-1,"temperature":0}}`},
	{5, `{"model":"m","options":{"num_predict":12}}`},
	{6, `{"model":"m","input":"x"}`},
}

// FuzzParseRequestReadsExactCase: whatever the body, what the budget reads is
// what an upstream reads, and a body whose fields the upstream could read in
// two ways is refused.
func FuzzParseRequestReadsExactCase(f *testing.F) {
	for _, s := range requestSeeds {
		f.Add(uint8(s.format), []byte(s.body))
	}
	f.Fuzz(func(t *testing.T, format uint8, body []byte) {
		ff := fuzzFormats[int(format)%len(fuzzFormats)]
		req, err := ParseRequest(ff.format, ff.path, body)
		if err != nil {
			return
		}
		up, err := readAsUpstream(ff.format, body)
		switch {
		case err != nil:
			t.Fatalf("%v: accepted a body an exact reader cannot read: %v", ff.format, err)
		case up.undefined != "":
			t.Fatalf("%v: accepted a body that gives %q in two spellings", ff.format, up.undefined)
		case ff.format != Gemini && up.model != req.Model:
			t.Fatalf("%v: budget read model %q, an exact reader %q", ff.format, req.Model, up.model)
		case up.cap != req.MaxOutputTokens:
			t.Fatalf("%v: budget read an output cap of %d, an exact reader %d", ff.format, req.MaxOutputTokens, up.cap)
		case up.n != req.N:
			t.Fatalf("%v: budget read %d outputs, an exact reader %d", ff.format, req.N, up.n)
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
