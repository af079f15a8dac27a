package usage

import (
	"errors"
	"testing"

	"github.com/fleetguard/fleetguard/budget"
)

const (
	chatPath        = "/v1/chat/completions"
	completionsPath = "/v1/completions"
	geminiPath      = "/v1beta/models/gemini-2.0-flash:generateContent"
)

// TestParseRequestReadsWhatTheUpstreamReads: the output cap and the number of
// outputs are read from the fields the API of the format reads, in every
// spelling it accepts.
func TestParseRequestReadsWhatTheUpstreamReads(t *testing.T) {
	tests := []struct {
		name     string
		format   Format
		path     string
		body     string
		n, cap   int64
		capField string
	}{
		{"gemini lowerCamel", Gemini, geminiPath, `{"contents":[],"generationConfig":{"candidateCount":8,"maxOutputTokens":1000}}`, 8, 1000, "generationConfig.maxOutputTokens"},
		{"gemini snake_case", Gemini, geminiPath, `{"contents":[],"generation_config":{"candidate_count":8,"max_output_tokens":1000}}`, 8, 1000, "generation_config.max_output_tokens"},
		{"gemini snake parent, lowerCamel fields", Gemini, geminiPath, `{"generation_config":{"candidateCount":3,"maxOutputTokens":70}}`, 3, 70, "generation_config.maxOutputTokens"},
		{"gemini lowerCamel parent, snake fields", Gemini, geminiPath, `{"generationConfig":{"candidate_count":3,"max_output_tokens":70}}`, 3, 70, "generationConfig.max_output_tokens"},
		{"gemini null config", Gemini, geminiPath, `{"generation_config":null}`, 1, 0, ""},
		{"completions best_of bills every candidate", OpenAICompletions, completionsPath, `{"model":"m","prompt":"x","best_of":20,"max_tokens":1000}`, 20, 1000, "max_tokens"},
		{"completions n above best_of", OpenAICompletions, completionsPath, `{"model":"m","prompt":"x","n":4,"best_of":2,"max_tokens":10}`, 4, 10, "max_tokens"},
		{"best_of outside legacy completions is not an API field", OpenAIChat, chatPath, `{"model":"m","best_of":20,"max_tokens":10}`, 1, 10, "max_tokens"},
		{"chat: the larger of its two caps", OpenAIChat, chatPath, `{"model":"m","max_tokens":10,"max_completion_tokens":30}`, 1, 30, "max_completion_tokens"},
		{"chat ignores the Responses field", OpenAIChat, chatPath, `{"model":"m","max_output_tokens":10}`, 1, 0, ""},
		{"responses ignores the chat field", OpenAIResponses, "/v1/responses", `{"model":"m","max_tokens":10}`, 1, 0, ""},
		{"completions ignores max_completion_tokens", OpenAICompletions, completionsPath, `{"model":"m","max_completion_tokens":10}`, 1, 0, ""},
		{"ollama ignores top-level max_tokens", Ollama, "/api/chat", `{"model":"m","max_tokens":10}`, 1, 0, ""},
		{"ollama num_predict -1 is no cap", Ollama, "/api/chat", `{"model":"m","options":{"num_predict":-1}}`, 1, 0, ""},
		{"ollama num_predict", Ollama, "/api/generate", `{"model":"m","options":{"num_predict":64}}`, 1, 64, "options.num_predict"},
		{"gemini ignores top-level caps", Gemini, geminiPath, `{"max_tokens":10,"max_output_tokens":20}`, 1, 0, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := ParseRequest(tt.format, tt.path, []byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if req.N != tt.n || req.MaxOutputTokens != tt.cap || req.MaxOutputTokensField != tt.capField {
				t.Fatalf("read n=%d cap=%d (%q), want n=%d cap=%d (%q)", req.N, req.MaxOutputTokens, req.MaxOutputTokensField, tt.n, tt.cap, tt.capField)
			}
		})
	}
}

func TestParseRequestRefusesOutOfRange(t *testing.T) {
	tests := []struct {
		name   string
		format Format
		path   string
		body   string
	}{
		{"best_of 0", OpenAICompletions, completionsPath, `{"model":"m","best_of":0}`},
		{"best_of over MaxChoices", OpenAICompletions, completionsPath, `{"model":"m","best_of":129}`},
		{"snake candidate_count 0", Gemini, geminiPath, `{"generation_config":{"candidate_count":0}}`},
		{"snake max_output_tokens over the cap", Gemini, geminiPath, `{"generationConfig":{"max_output_tokens":1000001}}`},
		{"snake max_output_tokens not an integer", Gemini, geminiPath, `{"generation_config":{"max_output_tokens":"9"}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := ParseRequest(tt.format, tt.path, []byte(tt.body)); !errors.Is(err, ErrBadRequest) {
				t.Fatalf("error %v, want ErrBadRequest", err)
			}
		})
	}
}

// Both proto JSON spellings of a Gemini body estimate alike.
func TestGeminiSpellingsEstimateAlike(t *testing.T) {
	const image = `"data":"` + "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==" + `"`
	camel := `{"systemInstruction":{"parts":[{"text":"Be brief."}]},"contents":[{"role":"user","parts":[{"text":"Name three rivers."},{"inlineData":{"mimeType":"image/png",` + image + `}},{"fileData":{"mimeType":"application/pdf","fileUri":"gs://b/a.pdf"}}]}]}`
	snake := `{"system_instruction":{"parts":[{"text":"Be brief."}]},"contents":[{"role":"user","parts":[{"text":"Name three rivers."},{"inline_data":{"mime_type":"image/png",` + image + `}},{"file_data":{"mime_type":"application/pdf","file_uri":"gs://b/a.pdf"}}]}]}`
	a, errA := ParseRequest(Gemini, geminiPath, []byte(camel))
	b, errB := ParseRequest(Gemini, geminiPath, []byte(snake))
	if errA != nil || errB != nil {
		t.Fatal(errA, errB)
	}
	least := int64(2*MediaPartTokens + MessageOverheadTokens + len("Be brief.") + len("Name three rivers."))
	if a.PromptTokens != b.PromptTokens || a.PromptTokens < least {
		t.Fatalf("prompt estimates: lowerCamel %d, snake_case %d, want the same, at least %d", a.PromptTokens, b.PromptTokens, least)
	}
	if a.HiddenInput == "" || b.HiddenInput == "" {
		t.Fatal("a file by URI is input the body does not show")
	}
}

// The model of a Gemini request is read from the path the format was
// recognised on: cleaned, without ;parameters, in lower case.
func TestGeminiModelFromTheCleanedPath(t *testing.T) {
	tests := []struct {
		path   string
		model  string
		stream bool
	}{
		{"/v1beta/models/gemini-2.5-flash:generateContent", "gemini-2.5-flash", false},
		{"/v1beta/models/gemini-2.0-flash/../gemini-2.5-pro:generateContent", "gemini-2.5-pro", false},
		{"/v1beta/models/gemini-2.0-flash/./../gemini-2.5-pro:streamGenerateContent", "gemini-2.5-pro", true},
		{"/v1beta//models/Gemini-2.5-Pro:StreamGenerateContent", "gemini-2.5-pro", true},
		{"/v1beta/models;x=1/gemini-2.5-pro:generateContent", "gemini-2.5-pro", false},
		{"/v1beta/models/ gemini-2.5-pro :generateContent", "gemini-2.5-pro", false},
	}
	for _, tt := range tests {
		if f := FormatFromPath(tt.path); f != Gemini {
			t.Errorf("%s: format %v", tt.path, f)
			continue
		}
		req, err := ParseRequest(Gemini, tt.path, []byte(`{"contents":[]}`))
		if err != nil || req.Model != tt.model || req.Stream != tt.stream {
			t.Errorf("%s: model %q stream %v (%v), want %q %v", tt.path, req.Model, req.Stream, err, tt.model, tt.stream)
		}
	}
}

// Input the body does not show is named; input it holds is not.
func TestHiddenInputIsNamed(t *testing.T) {
	for _, tt := range []struct {
		format     Format
		path, body string
		hidden     bool
	}{
		{OpenAIChat, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":[{"type":"file","file":{"file_data":"data:application/pdf;base64,JVBERi0x","filename":"a.pdf"}}]}]}`, false},
		{OpenAIChat, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":[{"type":"file","file":{"file_id":"file-abc"}}]}]}`, true},
		{OpenAIChat, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://example.com/a.png"}}]}]}`, false},
		{Anthropic, "/v1/messages", `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"base64","media_type":"application/pdf","data":"JVBERi0x"}}]}]}`, false},
		{Anthropic, "/v1/messages", `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"url","url":"https://example.com/a.pdf"}}]}]}`, true},
		{Anthropic, "/v1/messages", `{"model":"m","max_tokens":5,"tools":[{"type":"web_search_20250305","name":"web_search"}],"messages":[]}`, true},
		{Anthropic, "/v1/messages", `{"model":"m","max_tokens":5,"tools":[{"name":"get_weather","input_schema":{"type":"object"}}],"messages":[]}`, false},
		{Gemini, geminiPath, `{"contents":[],"tools":[{"googleSearch":{}}]}`, true},
		{OpenAIResponses, "/v1/responses", `{"model":"m","input":"hi","previous_response_id":"resp_1"}`, true},
		{OpenAIResponses, "/v1/responses", `{"model":"m","input":"hi","previous_response_id":null}`, false},
	} {
		req, err := ParseRequest(tt.format, tt.path, []byte(tt.body))
		if err != nil {
			t.Fatalf("%s: %v", tt.body, err)
		}
		if got := req.HiddenInput != ""; got != tt.hidden {
			t.Errorf("%s: hidden input %q, want hidden %v", tt.body, req.HiddenInput, tt.hidden)
		}
	}
}

// TestAzureDeploymentAndServiceTier: an Azure OpenAI deployment path's
// model is its deployment, whatever the body names or if it names none;
// service_tier is the tier asked for.
func TestAzureDeploymentAndServiceTier(t *testing.T) {
	tests := []struct {
		name, path, body string
		f                Format
		model            string
		deployment       bool
		tier             budget.ServiceTier
		bad              bool
	}{
		{"a deployment path, the body naming another model", "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
			`{"model":"gemini-2.0-flash","messages":[{"role":"user","content":"hi"}]}`, OpenAIChat, "gpt-4o", true, budget.StandardTier, false},
		{"a deployment path, no model in the body", "/openai/deployments/Prod-Chat/chat/completions",
			`{"messages":[{"role":"user","content":"hi"}]}`, OpenAIChat, "prod-chat", true, budget.StandardTier, false},
		{"an embeddings deployment", "/openai/deployments/emb/embeddings", `{"input":"hi"}`, OpenAIEmbeddings, "emb", true, budget.StandardTier, false},
		{"a plain path needs the body's model", "/v1/chat/completions", `{"messages":[]}`, OpenAIChat, "", false, 0, true},
		{"priority asked", "/v1/chat/completions", `{"model":"gpt-4o","service_tier":"priority","messages":[]}`, OpenAIChat, "gpt-4o", false, budget.PriorityTier, false},
		{"flex asked", "/v1/responses", `{"model":"o3","service_tier":"flex","input":"hi"}`, OpenAIResponses, "o3", false, budget.FlexTier, false},
		{"auto is standard", "/v1/chat/completions", `{"model":"gpt-4o","service_tier":"auto","messages":[]}`, OpenAIChat, "gpt-4o", false, budget.StandardTier, false},
		{"a tier that is no string", "/v1/chat/completions", `{"model":"gpt-4o","service_tier":1,"messages":[]}`, OpenAIChat, "", false, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := ParseRequest(tt.f, tt.path, []byte(tt.body))
			if (err != nil) != tt.bad {
				t.Fatalf("ParseRequest: %v, want bad %v", err, tt.bad)
			}
			if err == nil && (req.Model != tt.model || req.Deployment != tt.deployment || req.ServiceTier != tt.tier) {
				t.Errorf("model %q deployment %v tier %v, want %q %v %v", req.Model, req.Deployment, req.ServiceTier, tt.model, tt.deployment, tt.tier)
			}
		})
	}
}
