package usage

import "encoding/json"

// A budget is a closed world: for each format, every top-level field of a
// request body is one the estimate reads, one whose text the upstream renders
// into the prompt (counted like the messages), one that makes the upstream
// read input the body does not show, or one known to change nothing billed
// beyond what is held (sampling, metadata, ids, the shape of the output). Any
// other field, a new one of the API or a server's own, may change what the
// upstream bills, so the request is held at its worst case or refused
// (Request.UnknownFields); it is never priced as if the field were not there.
// Keys match by exact case, as the upstreams read them.

// fieldClass is what a top-level field of a request does to its bill.
type fieldClass uint8

const (
	fieldUnknown fieldClass = iota
	// fieldRead: ParseRequest reads it (the model, caps, outputs, the
	// prompt's main parts, server-side state).
	fieldRead
	// fieldPrompt: its text reaches the prompt (a schema, legacy
	// functions, a suffix): the estimate counts its JSON a token a byte,
	// keys and all, whatever shape the upstream renders it in.
	fieldPrompt
	// fieldMedia: an array of images (Ollama's images), each a media part.
	fieldMedia
	// fieldTokenIDs: a prompt given as token ids (Ollama's context).
	fieldTokenIDs
	// fieldNeutral: it changes nothing billed beyond the cap that is held.
	fieldNeutral
	// fieldHiddenInput: the upstream reads input the body does not show
	// (a cache, a container, a web search).
	fieldHiddenInput
	// fieldForeignCap: an output cap of an OpenAI-compatible server's own
	// (llama.cpp's n_predict, TGI's max_new_tokens, vLLM's min_tokens):
	// held like the API's own cap, and refused above the cap forwarded.
	fieldForeignCap
)

// classes builds a table from groups of field names by class.
func classes(groups map[fieldClass][]string) map[string]fieldClass {
	t := make(map[string]fieldClass)
	for c, names := range groups {
		for _, n := range names {
			t[n] = c
		}
	}
	return t
}

// samplingFields change how tokens are picked, never how many are billed:
// neutral in every format whose servers take them.
var samplingFields = []string{
	"temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "stop",
	"frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
	"logprobs", "top_logprobs",
}

// foreignCaps are the output caps of the OpenAI-compatible servers people run.
var foreignCaps = []string{"n_predict", "max_new_tokens", "min_tokens"}

// fieldTables are the top-level fields of each format, by class.
var fieldTables = map[Format]map[string]fieldClass{
	OpenAIChat: classes(map[fieldClass][]string{
		fieldRead: {"model", "messages", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens",
			"service_tier", "reasoning_effort", "tools", "modalities", "audio"},
		fieldPrompt:      {"functions", "response_format"},
		fieldHiddenInput: {"web_search_options"},
		fieldForeignCap:  foreignCaps,
		fieldNeutral: append([]string{"user", "metadata", "store", "parallel_tool_calls", "tool_choice", "function_call",
			"prompt_cache_key", "prompt_cache_retention", "safety_identifier", "verbosity"}, samplingFields...),
	}),
	OpenAICompletions: classes(map[fieldClass][]string{
		fieldRead:       {"model", "prompt", "stream", "stream_options", "n", "best_of", "max_tokens"},
		fieldPrompt:     {"suffix"},
		fieldForeignCap: foreignCaps,
		fieldNeutral:    append([]string{"user", "echo"}, samplingFields...),
	}),
	OpenAIResponses: classes(map[fieldClass][]string{
		fieldRead: {"model", "input", "instructions", "max_output_tokens", "stream", "service_tier", "reasoning",
			"tools", "previous_response_id", "conversation", "prompt", "background"},
		fieldPrompt: {"text"},
		fieldNeutral: {"include", "metadata", "parallel_tool_calls", "prompt_cache_key", "prompt_cache_retention",
			"safety_identifier", "store", "temperature", "top_p", "top_logprobs", "tool_choice", "truncation", "user",
			"max_tool_calls", "stream_options"},
	}),
	Anthropic: classes(map[fieldClass][]string{
		fieldRead:        {"model", "messages", "max_tokens", "system", "stream", "tools", "thinking", "service_tier", "mcp_servers"},
		fieldPrompt:      {"output_format", "output_config"},
		fieldHiddenInput: {"container"},
		// context_management clears old tool results and thinking from the
		// prompt: it only ever lowers the input billed.
		fieldNeutral: {"metadata", "stop_sequences", "temperature", "top_k", "top_p", "tool_choice", "context_management"},
	}),
	Gemini: classes(map[fieldClass][]string{
		fieldRead:        {"contents", "systemInstruction", "system_instruction", "generationConfig", "generation_config", "tools"},
		fieldPrompt:      {"toolConfig", "tool_config"},
		fieldHiddenInput: {"cachedContent", "cached_content"},
		// model: the path names the model the upstream serves.
		fieldNeutral: {"safetySettings", "safety_settings", "labels", "model"},
	}),
	Ollama: classes(map[fieldClass][]string{
		fieldRead:     {"model", "messages", "prompt", "system", "stream", "options", "think", "tools"},
		fieldPrompt:   {"suffix", "template", "format"},
		fieldMedia:    {"images"},
		fieldTokenIDs: {"context"},
		fieldNeutral:  {"keep_alive", "raw", "logprobs", "top_logprobs"},
	}),
	OpenAIEmbeddings: classes(map[fieldClass][]string{
		fieldRead:    {"model", "input"},
		fieldNeutral: {"dimensions", "encoding_format", "user"},
	}),
}

// geminiConfigFields are the fields of Gemini's generationConfig, by class.
// responseModalities and speechConfig are read for the output they ask for.
var geminiConfigFields = classes(map[fieldClass][]string{
	fieldRead: {"maxOutputTokens", "max_output_tokens", "candidateCount", "candidate_count",
		"thinkingConfig", "thinking_config", "responseModalities", "response_modalities", "speechConfig", "speech_config"},
	fieldPrompt: {"responseSchema", "response_schema", "responseJsonSchema", "response_json_schema", "_responseJsonSchema"},
	fieldNeutral: {"stopSequences", "stop_sequences", "responseMimeType", "response_mime_type", "temperature",
		"topP", "top_p", "topK", "top_k", "seed", "presencePenalty", "presence_penalty", "frequencyPenalty",
		"frequency_penalty", "responseLogprobs", "response_logprobs", "logprobs", "enableEnhancedCivicAnswers",
		"enable_enhanced_civic_answers", "mediaResolution", "media_resolution"},
})

// classify reads the top-level fields of body (a valid JSON object) by the
// table of format f: it counts the text of prompt fields into est, notes
// hidden input, and returns the fields of no known class (nil when none)
// and the largest foreign cap given.
func classify(f Format, body []byte, est *estimator) (unknown []string, foreign intField) {
	table := fieldTables[f]
	eachKey(body, func(key string, value []byte) bool {
		switch table[key] {
		case fieldRead:
			if f == Gemini && (key == "generationConfig" || key == "generation_config") {
				unknown = classifyGenerationConfig(key, value, est, unknown)
			}
		case fieldNeutral:
		case fieldPrompt:
			est.textBytes += int64(len(value))
		case fieldMedia:
			est.mediaList(value)
		case fieldTokenIDs:
			if rest := est.tokenIDs(value); rest != nil {
				est.add(rest)
			}
		case fieldHiddenInput:
			if est.hidden == "" && present(value) {
				est.hidden = key
			}
		case fieldForeignCap:
			var n int64
			if string(value) == "null" {
				break
			}
			if json.Unmarshal(value, &n) != nil {
				n = -1 // a cap that is not an integer bounds nothing here: refused
			}
			if foreign.v == nil || *foreign.v >= 0 && (n > *foreign.v || n < 0) { // a refused one stays
				foreign = intField{key, &n}
			}
		default:
			unknown = append(unknown, key)
		}
		return true
	})
	return unknown, foreign
}

// classifyGenerationConfig reads the fields of Gemini's generationConfig
// (named parent, as the body spells it) by geminiConfigFields.
func classifyGenerationConfig(parent string, config []byte, est *estimator, unknown []string) []string {
	eachKey(config, func(k string, v []byte) bool {
		switch geminiConfigFields[k] {
		case fieldRead, fieldNeutral:
		case fieldPrompt:
			est.textBytes += int64(len(v))
		default:
			unknown = append(unknown, parent+"."+k)
		}
		return true
	})
	return unknown
}

// mediaList counts each member of a JSON array as a media part.
func (e *estimator) mediaList(raw []byte) {
	var parts []json.RawMessage
	if json.Unmarshal(raw, &parts) == nil {
		e.media += int64(len(parts))
	}
}
