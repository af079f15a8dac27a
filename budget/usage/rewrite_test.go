package usage

import (
	"bytes"
	"encoding/json"
	"slices"
	"testing"
)

func TestRewriteIncludeUsage(t *testing.T) {
	tests := []struct{ name, in, want string }{
		{"no stream_options",
			`{"model":"m","stream":true,"messages":[{"role":"user","content":"a <b> & c"}]}`,
			`{"model":"m","stream":true,"messages":[{"role":"user","content":"a <b> & c"}],"stream_options":{"include_usage":true}}`},
		{"null stream_options",
			`{"model":"m","stream":true,"stream_options":null,"messages":[]}`,
			`{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]}`},
		{"other stream options kept",
			`{"model":"m","stream":true,"stream_options":{"include_obfuscation":false},"messages":[]}`,
			`{"model":"m","stream":true,"stream_options":{"include_obfuscation":false,"include_usage":true},"messages":[]}`},
		{"include_usage false",
			`{"model":"m","stream":true,"stream_options":{ "include_usage" : false },"messages":[]}`,
			`{"model":"m","stream":true,"stream_options":{ "include_usage" : true },"messages":[]}`},
		{"escapes and spacing as written",
			"{ \"model\" : \"m\\u00e9\",\n  \"stream\": true, \"messages\": [ {\"content\": \"\\u003cb\\u003e\"} ] }\n",
			"{ \"model\" : \"m\\u00e9\",\n  \"stream\": true, \"messages\": [ {\"content\": \"\\u003cb\\u003e\"} ] ,\"stream_options\":{\"include_usage\":true}}\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, err := Rewrite(OpenAIChat, []byte(tt.in), Rewrites{IncludeUsage: true})
			if err != nil {
				t.Fatal(err)
			}
			if string(out) != tt.want {
				t.Fatalf("rewritten\n%s\nwant\n%s", out, tt.want)
			}
			if req, err := ParseRequest(OpenAIChat, "/v1/chat/completions", out); err != nil || !req.IncludeUsage {
				t.Fatalf("the rewritten body reads %+v %v", req, err)
			}
		})
	}
	for _, bad := range []string{`{"stream_options":"bad"}`, `[]`, `null`} {
		if _, err := Rewrite(OpenAIChat, []byte(bad), Rewrites{IncludeUsage: true}); err == nil {
			t.Errorf("%s: rewritten without an error", bad)
		}
	}
}

// TestRewriteOutputCap: the cap goes in the API's own field, a larger one is
// lowered where the client wrote it, and every other byte stays.
func TestRewriteOutputCap(t *testing.T) {
	tests := []struct {
		name   string
		format Format
		chat   ChatCapField
		cap    int64
		in     string
		want   string // "" for unchanged
	}{
		{"chat: none given", OpenAIChat, MaxCompletionTokens, 4096,
			`{"model":"m","messages":[]}`, `{"model":"m","messages":[],"max_completion_tokens":4096}`},
		{"chat: max_tokens is a cap OpenAI reads", OpenAIChat, MaxCompletionTokens, 100,
			`{"model":"m","max_tokens":100,"messages":[]}`, ""},
		{"chat: null is no cap", OpenAIChat, MaxCompletionTokens, 4096,
			`{"model":"m","max_completion_tokens":null,"messages":[]}`, `{"model":"m","max_completion_tokens":4096,"messages":[]}`},
		{"chat: a larger cap is lowered where it is", OpenAIChat, MaxCompletionTokens, 8192,
			"{ \"model\" : \"m\" ,\n \"max_tokens\" : 50000 , \"messages\":[] }", "{ \"model\" : \"m\" ,\n \"max_tokens\" : 8192 , \"messages\":[] }"},
		{"chat: both caps lowered", OpenAIChat, MaxCompletionTokens, 10,
			`{"model":"m","max_tokens":50,"max_completion_tokens":20}`, `{"model":"m","max_tokens":10,"max_completion_tokens":10}`},
		{"chat: an escaped key is the field", OpenAIChat, MaxCompletionTokens, 10,
			`{"model":"m","\u006dax_tokens":50}`, `{"model":"m","\u006dax_tokens":10}`},
		{"chat max_tokens: none given", OpenAIChat, MaxTokens, 4096,
			`{"model":"m","messages":[]}`, `{"model":"m","messages":[],"max_tokens":4096}`},
		{"chat max_tokens: max_completion_tokens alone is unread", OpenAIChat, MaxTokens, 100,
			`{"model":"m","max_completion_tokens":100}`, `{"model":"m","max_completion_tokens":100,"max_tokens":100}`},
		{"completions", OpenAICompletions, MaxCompletionTokens, 4096,
			`{"model":"m","prompt":"x"}`, `{"model":"m","prompt":"x","max_tokens":4096}`},
		{"responses", OpenAIResponses, MaxCompletionTokens, 4096,
			`{"model":"m","input":"x"}`, `{"model":"m","input":"x","max_output_tokens":4096}`},
		{"responses: lowered", OpenAIResponses, MaxCompletionTokens, 100,
			`{"model":"m","max_output_tokens":900,"input":"x"}`, `{"model":"m","max_output_tokens":100,"input":"x"}`},
		{"anthropic: lowered", Anthropic, MaxCompletionTokens, 1024,
			`{"model":"m","max_tokens":64000,"messages":[]}`, `{"model":"m","max_tokens":1024,"messages":[]}`},
		{"anthropic: under the cap", Anthropic, MaxCompletionTokens, 1024,
			`{"model":"m","max_tokens":64,"messages":[]}`, ""},
		{"gemini: no generationConfig", Gemini, MaxCompletionTokens, 4096,
			`{"contents":[]}`, `{"contents":[],"generationConfig":{"maxOutputTokens":4096}}`},
		{"gemini: empty body", Gemini, MaxCompletionTokens, 4096,
			`{}`, `{"generationConfig":{"maxOutputTokens":4096}}`},
		{"gemini: into the config given", Gemini, MaxCompletionTokens, 4096,
			`{"generationConfig":{"temperature":0.2},"contents":[]}`, `{"generationConfig":{"temperature":0.2,"maxOutputTokens":4096},"contents":[]}`},
		{"gemini: into generation_config, spelled like it", Gemini, MaxCompletionTokens, 4096,
			`{"generation_config":{"candidate_count":2}}`, `{"generation_config":{"candidate_count":2,"max_output_tokens":4096}}`},
		{"gemini: null generation_config", Gemini, MaxCompletionTokens, 4096,
			`{"generation_config":null}`, `{"generation_config":{"max_output_tokens":4096}}`},
		{"gemini: a null cap in the other spelling is replaced", Gemini, MaxCompletionTokens, 4096,
			`{"generation_config":{"maxOutputTokens":null}}`, `{"generation_config":{"maxOutputTokens":4096}}`},
		{"gemini: lowered", Gemini, MaxCompletionTokens, 100,
			`{"generationConfig":{"max_output_tokens":8000}}`, `{"generationConfig":{"max_output_tokens":100}}`},
		{"ollama: no options", Ollama, MaxCompletionTokens, 4096,
			`{"model":"m","messages":[]}`, `{"model":"m","messages":[],"options":{"num_predict":4096}}`},
		{"ollama: -1 is unbounded", Ollama, MaxCompletionTokens, 4096,
			`{"model":"m","options":{"num_predict":-1,"temperature":0}}`, `{"model":"m","options":{"num_predict":4096,"temperature":0}}`},
		{"ollama: -2 fills the context", Ollama, MaxCompletionTokens, 4096,
			`{"model":"m","options":{"num_predict":-2}}`, `{"model":"m","options":{"num_predict":4096}}`},
		{"ollama: lowered", Ollama, MaxCompletionTokens, 4096,
			`{"model":"m","options":{"num_predict":5000}}`, `{"model":"m","options":{"num_predict":4096}}`},
		{"ollama: under the cap", Ollama, MaxCompletionTokens, 4096,
			`{"model":"m","options":{"num_predict":10}}`, ""},
		{"embeddings have no output", OpenAIEmbeddings, MaxCompletionTokens, 4096,
			`{"model":"m","input":"x"}`, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := ParseRequest(tt.format, "/v1beta/models/m:generateContent", []byte(tt.in)); err != nil {
				t.Fatalf("the body is not one ParseRequest accepts: %v", err)
			}
			out, err := Rewrite(tt.format, []byte(tt.in), Rewrites{OutputCap: tt.cap, ChatCapField: tt.chat})
			if err != nil {
				t.Fatal(err)
			}
			want := tt.want
			if want == "" {
				want = tt.in
			}
			if string(out) != want {
				t.Fatalf("rewritten\n%s\nwant\n%s", out, want)
			}
		})
	}
}

func TestRewriteBothAtOnce(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{`{"model":"m","stream":true}`, `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":4096}`},
		{`{}`, `{"stream_options":{"include_usage":true},"max_completion_tokens":4096}`},
	} {
		out, err := Rewrite(OpenAIChat, []byte(tt.in), Rewrites{IncludeUsage: true, OutputCap: 4096})
		if err != nil || string(out) != tt.want {
			t.Fatalf("%s rewritten %s %v, want %s", tt.in, out, err, tt.want)
		}
	}
}

// FuzzRewriteBoundsWhatTheUpstreamReads: whatever body ParseRequest accepts,
// its rewrite is accepted too, the upstream reads a cap of at most the one
// given (exactly it when the body named none), and every member the rewrite
// does not write is kept byte for byte, in its place.
func FuzzRewriteBoundsWhatTheUpstreamReads(f *testing.F) {
	for _, s := range requestSeeds {
		f.Add(uint8(s.format), []byte(s.body), uint32(4096), false, false)
		f.Add(uint8(s.format), []byte(s.body), uint32(5), true, true)
	}
	f.Fuzz(func(t *testing.T, format uint8, body []byte, limit uint32, maxTokens, includeUsage bool) {
		ff := fuzzFormats[int(format)%len(fuzzFormats)]
		before, err := ParseRequest(ff.format, ff.path, body)
		if err != nil {
			return
		}
		rw := Rewrites{IncludeUsage: includeUsage, OutputCap: 1 + int64(limit)%MaxOutputCap}
		if maxTokens {
			rw.ChatCapField = MaxTokens
		}
		out, err := Rewrite(ff.format, body, rw)
		if err != nil {
			if ff.format == Gemini && bytes.Equal(bytes.TrimSpace(body), []byte("null")) {
				return // a null body is no object to write into
			}
			t.Fatalf("Rewrite(%q): %v", body, err)
		}
		after, err := ParseRequest(ff.format, ff.path, out)
		if err != nil {
			t.Fatalf("the rewrite %q of %q is refused: %v", out, body, err)
		}
		if after.Model != before.Model || after.N != before.N || after.PromptTokens != before.PromptTokens || after.Stream != before.Stream {
			t.Fatalf("the rewrite %q of %q reads %+v, before %+v", out, body, after, before)
		}
		if includeUsage && !after.IncludeUsage {
			t.Fatalf("the rewrite %q asks for no usage", out)
		}
		if ff.format != OpenAIEmbeddings {
			had, got := upstreamCap(t, ff.format, rw.ChatCapField, body), upstreamCap(t, ff.format, rw.ChatCapField, out)
			want := rw.OutputCap
			if had > 0 {
				want = min(had, rw.OutputCap)
			}
			if got != want {
				t.Fatalf("the upstream reads a cap of %d from %q, want %d (it read %d from %q)", got, out, want, had, body)
			}
		}
		keptInPlace(t, body, out)
	})
}

// upstreamCap is the output cap an upstream reads: for OpenAI chat with the
// MaxTokens option, one that reads only max_tokens.
func upstreamCap(t *testing.T, f Format, chat ChatCapField, body []byte) int64 {
	t.Helper()
	if f == OpenAIChat && chat == MaxTokens {
		var r struct {
			MaxTokens int64 `json:"max_tokens"`
		}
		top, _ := exactObject(body)
		_ = json.Unmarshal(top["max_tokens"], &r.MaxTokens)
		return r.MaxTokens
	}
	up, err := readAsUpstream(f, body)
	if err != nil {
		t.Fatalf("reading %q as the upstream: %v", body, err)
	}
	return up.cap
}

// keptInPlace fails unless out has the top-level members of in, in the same
// order (and then any added), each with the same bytes unless Rewrite writes
// that field.
func keptInPlace(t *testing.T, in, out []byte) {
	t.Helper()
	written := []string{"stream_options", "max_tokens", "max_completion_tokens", "max_output_tokens", "generationConfig", "generation_config", "options"}
	type member struct{ key, value string }
	members := func(b []byte) (ms []member) {
		eachKey(b, func(key string, value []byte) bool {
			ms = append(ms, member{key, string(value)})
			return true
		})
		return ms
	}
	was, is := members(in), members(out)
	if len(is) < len(was) {
		t.Fatalf("%q lost members of %q", out, in)
	}
	for i, m := range was {
		if is[i].key != m.key || (is[i].value != m.value && !slices.Contains(written, m.key)) {
			t.Fatalf("member %d of %q is %+v in the rewrite %q", i, in, is[i], out)
		}
	}
}
