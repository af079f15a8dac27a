package usage

import (
	"os"
	"slices"
	"strings"
	"testing"
)

// Every top-level field is of a known class or reported unknown, per format,
// by exact case; input the upstream bills is counted or named hidden; the
// outputs a request multiplies are all held.
func TestFieldsAreKnownOrReported(t *testing.T) {
	big := strings.Repeat("x", 12_000)
	tests := []struct {
		name    string
		format  Format
		path    string
		body    string
		unknown []string
		hidden  string
		// minPrompt: the estimate counts the field's text.
		minPrompt int64
		n         int64
		uncounted string
	}{
		{"chat neutral fields", OpenAIChat, chatPath, `{"model":"m","messages":[],"user":"u","metadata":{},"store":true,"temperature":1,"top_p":1,"seed":1,"stop":["x"],"logprobs":true,"top_logprobs":2,"tool_choice":"auto","parallel_tool_calls":false,"prompt_cache_key":"k","safety_identifier":"s","verbosity":"low","frequency_penalty":0,"presence_penalty":0,"logit_bias":{}}`, nil, "", 0, 1, ""},
		{"chat unknown and miscased", OpenAIChat, chatPath, `{"model":"m","messages":[],"frob":1,"User":"u"}`, []string{"frob", "User"}, "", 0, 1, ""},
		{"chat legacy functions are prompt", OpenAIChat, chatPath, `{"model":"m","messages":[],"functions":[{"name":"f","description":"` + big + `"}]}`, nil, "", 12_000, 1, ""},
		{"chat response_format schema is prompt", OpenAIChat, chatPath, `{"model":"m","messages":[],"response_format":{"type":"json_schema","json_schema":{"d":"` + big + `"}}}`, nil, "", 12_000, 1, ""},
		{"chat web search", OpenAIChat, chatPath, `{"model":"m","messages":[],"web_search_options":{}}`, nil, "web_search_options", 0, 1, ""},
		{"chat audio output", OpenAIChat, chatPath, `{"model":"m","messages":[],"modalities":["text","audio"],"audio":{"voice":"alloy"}}`, nil, "", 0, 1, "audio"},
		{"chat audio modality alone", OpenAIChat, chatPath, `{"model":"m","messages":[],"modalities":["audio"]}`, nil, "", 0, 1, "audio"},
		{"completions suffix is prompt", OpenAICompletions, completionsPath, `{"model":"m","prompt":"a","suffix":"` + big + `"}`, nil, "", 12_000, 1, ""},
		{"completions 20 prompts", OpenAICompletions, completionsPath, `{"model":"m","prompt":["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q","r","s","t"],"n":2}`, nil, "", 0, 40, ""},
		{"completions one prompt of ids", OpenAICompletions, completionsPath, `{"model":"m","prompt":[1,2,3]}`, nil, "", 3, 1, ""},
		{"completions prompts of ids", OpenAICompletions, completionsPath, `{"model":"m","prompt":[[1,2],[3]],"best_of":3}`, nil, "", 3, 6, ""},
		{"responses item_reference", OpenAIResponses, "/v1/responses", `{"model":"m","input":[{"type":"item_reference","id":"msg_1"}]}`, nil, "an item_reference", 0, 1, ""},
		{"responses text format is prompt", OpenAIResponses, "/v1/responses", `{"model":"m","input":"x","text":{"format":{"type":"json_schema","schema":{"d":"` + big + `"}}}}`, nil, "", 12_000, 1, ""},
		{"responses chat field is unknown", OpenAIResponses, "/v1/responses", `{"model":"m","input":"x","max_tokens":5}`, []string{"max_tokens"}, "", 0, 1, ""},
		{"anthropic container", Anthropic, "/v1/messages", `{"model":"m","max_tokens":5,"messages":[],"container":"c_1"}`, nil, "container", 0, 1, ""},
		{"gemini cached content", Gemini, geminiPath, `{"contents":[],"cachedContent":"cachedContents/x"}`, nil, "cachedContent", 0, 1, ""},
		{"gemini schema is prompt", Gemini, geminiPath, `{"contents":[],"generationConfig":{"responseSchema":{"d":"` + big + `"}}}`, nil, "", 12_000, 1, ""},
		{"gemini unknown config field", Gemini, geminiPath, `{"contents":[],"generationConfig":{"newThing":1}}`, []string{"generationConfig.newThing"}, "", 0, 1, ""},
		{"gemini audio", Gemini, geminiPath, `{"contents":[],"generationConfig":{"responseModalities":["AUDIO"]}}`, nil, "", 0, 1, "audio"},
		{"gemini text modality", Gemini, geminiPath, `{"contents":[],"generation_config":{"response_modalities":["TEXT"]}}`, nil, "", 0, 1, ""},
		{"ollama context ids", Ollama, "/api/generate", `{"model":"m","prompt":"x","context":[` + strings.Repeat("1,", 40_000) + `1]}`, nil, "", 40_001, 1, ""},
		{"ollama suffix", Ollama, "/api/generate", `{"model":"m","prompt":"x","suffix":"` + big + `"}`, nil, "", 12_000, 1, ""},
		{"embeddings", OpenAIEmbeddings, "/v1/embeddings", `{"model":"m","input":"x","dimensions":8,"encoding_format":"float","user":"u","extra":1}`, []string{"extra"}, "", 0, 1, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := ParseRequest(tt.format, tt.path, []byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(req.UnknownFields, tt.unknown) {
				t.Errorf("unknown fields %q, want %q", req.UnknownFields, tt.unknown)
			}
			if req.HiddenInput != tt.hidden {
				t.Errorf("hidden input %q, want %q", req.HiddenInput, tt.hidden)
			}
			if req.PromptTokens < tt.minPrompt {
				t.Errorf("prompt estimate %d, want at least %d", req.PromptTokens, tt.minPrompt)
			}
			if req.N != tt.n {
				t.Errorf("n %d, want %d", req.N, tt.n)
			}
			if req.UncountedOutput != tt.uncounted {
				t.Errorf("uncounted output %q, want %q", req.UncountedOutput, tt.uncounted)
			}
		})
	}
}

// A Responses request with background: true is reported; an OpenAI-compatible
// server's own cap is held when it is the larger, and refused when it asks
// for no bound.
func TestBackgroundAndForeignCaps(t *testing.T) {
	req, err := ParseRequest(OpenAIResponses, "/v1/responses", []byte(`{"model":"m","input":"x","background":true}`))
	if err != nil || !req.Background {
		t.Fatalf("background: %+v %v, want Background", req, err)
	}
	req, err = ParseRequest(OpenAIChat, chatPath, []byte(`{"model":"m","messages":[],"max_tokens":10,"n_predict":900,"min_tokens":20}`))
	if err != nil || req.MaxOutputTokens != 900 || req.MaxOutputTokensField != "n_predict" || req.ForeignCap != 900 {
		t.Fatalf("n_predict: cap %d (%q), foreign %d, %v; want 900 from n_predict", req.MaxOutputTokens, req.MaxOutputTokensField, req.ForeignCap, err)
	}
	for _, bad := range []string{`-1`, `5000.5`, `"5000"`} {
		if _, err := ParseRequest(OpenAIChat, chatPath, []byte(`{"model":"m","messages":[],"max_tokens":10,"n_predict":`+bad+`}`)); err == nil || !strings.Contains(err.Error(), "n_predict") {
			t.Fatalf("n_predict %s: %v, want an error naming it", bad, err)
		}
	}
}

// docs/llmbudget.md lists every field of every table under its format.
func TestTheFieldTablesAreDocumented(t *testing.T) {
	doc, err := os.ReadFile("../../docs/llmbudget.md")
	if err != nil {
		t.Fatal(err)
	}
	section := func(heading string) string {
		_, rest, ok := strings.Cut(string(doc), "\n### "+heading+"\n")
		if !ok {
			t.Fatalf("docs/llmbudget.md has no section %q", heading)
		}
		rest, _, _ = strings.Cut(rest, "\n### ")
		return rest
	}
	check := func(heading string, table map[string]fieldClass) {
		s := section(heading)
		for name := range table {
			if !strings.Contains(s, "`"+name+"`") {
				t.Errorf("docs/llmbudget.md, %s: field %q is not listed", heading, name)
			}
		}
	}
	for f, table := range fieldTables {
		check(f.String(), table)
	}
	check("gemini `generationConfig` (or `generation_config`)", geminiConfigFields)
}
