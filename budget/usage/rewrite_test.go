package usage

import (
	"encoding/json"
	"testing"
)

func TestWithIncludeUsage(t *testing.T) {
	tests := []struct{ name, in string }{
		{"no stream_options", `{"model":"m","stream":true,"messages":[{"role":"user","content":"a <b> & c"}]}`},
		{"null stream_options", `{"model":"m","stream":true,"stream_options":null,"messages":[]}`},
		{"other stream options kept", `{"model":"m","stream":true,"stream_options":{"include_obfuscation":false},"messages":[]}`},
		{"include_usage false", `{"model":"m","stream":true,"stream_options":{"include_usage":false},"messages":[]}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, err := WithIncludeUsage([]byte(tt.in))
			if err != nil {
				t.Fatal(err)
			}
			req, err := ParseRequest(OpenAIChat, "/v1/chat/completions", out)
			if err != nil || !req.IncludeUsage || !req.Stream || req.Model != "m" {
				t.Fatalf("rewritten %s: %+v %v", out, req, err)
			}
			var before, after map[string]any
			_ = json.Unmarshal([]byte(tt.in), &before)
			_ = json.Unmarshal(out, &after)
			for k, v := range before {
				if k == "stream_options" {
					continue
				}
				if b1, _ := json.Marshal(v); string(b1) != mustMarshal(after[k]) {
					t.Fatalf("field %s changed: %v -> %v", k, v, after[k])
				}
			}
			if tt.name == "other stream options kept" {
				if so := after["stream_options"].(map[string]any); so["include_obfuscation"] != false {
					t.Fatalf("stream_options lost a field: %v", so)
				}
			}
		})
	}
	if _, err := WithIncludeUsage([]byte(`{"stream_options":"bad"}`)); err == nil {
		t.Fatal("a malformed stream_options is an error")
	}
}

func mustMarshal(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
