package usage

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/fleetguard/fleetguard/budget"
)

// The prompt estimate bounds the input an upstream bills for what the body
// shows: a token a byte of its text (keys, numbers and literals included, as
// a tool's schema is rendered into the prompt), since no tokenizer makes a
// token of less than a byte (bound.go); a token for each token id of a
// prompt given as ids; MediaPartTokens for each image; the bytes of an
// inline file, document or audio part as well as MediaPartTokens. Input the
// body names but does not hold (server-side state, files by reference,
// server tools) is Request.HiddenInput: the caller holds the most it can be.
const (
	// MediaPartTokens is what an image part of a prompt counts, whatever
	// its size, and what an inline file or audio part counts besides its
	// bytes: the most one image bills at the providers' default detail
	// (OpenAI's 4.1-nano patches, 3,779, is the largest). The settle
	// corrects the estimate to what the upstream reports.
	MediaPartTokens = 4096
	// MessageOverheadTokens is added per message for roles and separators.
	MessageOverheadTokens = 4
	// MaxOutputCap is the largest output cap accepted; more is a client error.
	MaxOutputCap = 1_000_000
	// MaxChoices is the largest n accepted.
	MaxChoices = 128
)

// Request is what a request asks of the model, as far as budgets care.
type Request struct {
	// Model is the body's model; Gemini's, the path's; an Azure OpenAI
	// deployment path's (/openai/deployments/<name>/...), its deployment
	// name in lower case (Deployment is set), whatever the body says.
	Model string
	// Deployment: Model is an Azure OpenAI deployment's name.
	Deployment bool
	Stream     bool
	// IncludeUsage is stream_options.include_usage of an OpenAI chat stream.
	IncludeUsage bool
	// N is how many outputs the upstream generates, and bills: n (Gemini's
	// candidateCount), or legacy completions' best_of where it is larger. 1
	// unless the body says.
	N int64
	// MaxOutputTokens is the output cap the body gives in a field its API
	// reads: max_tokens or max_completion_tokens (OpenAI chat; the larger
	// counts), max_tokens (legacy completions, Anthropic), max_output_tokens
	// (Responses), generationConfig.maxOutputTokens (Gemini),
	// options.num_predict above 0 (Ollama). 0 when it gives none.
	MaxOutputTokens int64
	// MaxOutputTokensField names the field MaxOutputTokens was read from, as
	// the body spells it: "max_tokens", "generation_config.max_output_tokens".
	MaxOutputTokensField string
	// PromptTokens estimates the input tokens from the text parts.
	PromptTokens int64
	// HiddenInput, when not empty, says why the upstream may bill input
	// the body does not show: "previous_response_id", "a file by
	// reference", "server tool web_search". PromptTokens bounds the rest.
	HiddenInput string
	// NoOutput is true for an API that only reads input (embeddings): no
	// output is reserved.
	NoOutput bool
	// ServiceTier is the tier the body asks for (OpenAI's service_tier:
	// "flex", "priority"; any other value, or none, is standard).
	ServiceTier budget.ServiceTier
	// Reasoning is true when the body asks for reasoning (OpenAI
	// reasoning_effort, Responses reasoning, Anthropic thinking, Gemini
	// generationConfig.thinkingConfig, Ollama think), whose tokens may be
	// billed without being streamed.
	Reasoning bool
	// UncountedOutput names an output the meter does not count as it
	// streams ("audio", "image"): OpenAI chat's modalities or audio,
	// Gemini's responseModalities or speechConfig. Such a request holds
	// its whole cap.
	UncountedOutput string
	// Background is a Responses request with background: true, which the
	// upstream goes on generating after the client has left.
	Background bool
	// ForeignCap is the largest output cap of an OpenAI-compatible
	// server's own the body gives (llama.cpp's n_predict, TGI's
	// max_new_tokens, vLLM's min_tokens), named by ForeignCapField; the
	// forward rewrites only the API's own field, so the caller refuses a
	// ForeignCap above the cap it forwards.
	ForeignCap      int64
	ForeignCapField string
	// UnknownFields are the fields of the body no table of its format
	// knows (fields.go), as the body spells them ("generationConfig.x" for
	// one in Gemini's generationConfig); nil when there are none.
	UnknownFields []string
}

// ErrBadRequest wraps every reason a body is refused; the message is safe to
// show to the client.
var ErrBadRequest = errors.New("bad request")

func badRequest(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrBadRequest, fmt.Sprintf(format, args...))
}

type rawRequest struct {
	Model         json.RawMessage `json:"model"`
	Stream        *bool           `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	N                   *int64          `json:"n"`
	BestOf              *int64          `json:"best_of"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	MaxOutputTokens     *int64          `json:"max_output_tokens"`
	ServiceTier         json.RawMessage `json:"service_tier"`

	// Reasoning parameters of each API.
	ReasoningEffort json.RawMessage `json:"reasoning_effort"`
	Reasoning       json.RawMessage `json:"reasoning"`
	Thinking        *struct {
		Type string `json:"type"`
	} `json:"thinking"`
	Think json.RawMessage `json:"think"`

	Messages     []json.RawMessage `json:"messages"`
	Input        json.RawMessage   `json:"input"`
	Instructions json.RawMessage   `json:"instructions"`
	System       json.RawMessage   `json:"system"`
	Tools        json.RawMessage   `json:"tools"`
	Prompt       json.RawMessage   `json:"prompt"`
	// Output past the response, and outputs the meter does not count.
	Background json.RawMessage `json:"background"`
	Modalities []string        `json:"modalities"`
	Audio      json.RawMessage `json:"audio"`
	// Server-side state a Responses request continues from.
	PreviousResponseID json.RawMessage `json:"previous_response_id"`
	Conversation       json.RawMessage `json:"conversation"`
	// Anthropic's MCP connector: tools whose results it fetches.
	MCPServers json.RawMessage `json:"mcp_servers"`

	// Gemini, in both proto JSON spellings (keys.go refuses a body with both).
	Contents               json.RawMessage   `json:"contents"`
	SystemInstruction      json.RawMessage   `json:"systemInstruction"`
	SystemInstructionProto json.RawMessage   `json:"system_instruction"`
	GenerationConfig       *generationConfig `json:"generationConfig"`
	GenerationConfigProto  *generationConfig `json:"generation_config"`
	// Ollama.
	Options *struct {
		NumPredict *int64 `json:"num_predict"`
	} `json:"options"`
}

type generationConfig struct {
	ResponseModalities      []string        `json:"responseModalities"`
	ResponseModalitiesProto []string        `json:"response_modalities"`
	SpeechConfig            json.RawMessage `json:"speechConfig"`
	SpeechConfigProto       json.RawMessage `json:"speech_config"`
	MaxOutputTokens         *int64          `json:"maxOutputTokens"`
	MaxOutputTokensProto    *int64          `json:"max_output_tokens"`
	CandidateCount          *int64          `json:"candidateCount"`
	CandidateCountProto     *int64          `json:"candidate_count"`
	ThinkingConfig          json.RawMessage `json:"thinkingConfig"`
	ThinkingConfigProto     json.RawMessage `json:"thinking_config"`
}

// reasoning reports whether the body asks format f's upstream to reason.
func (raw *rawRequest) reasoning(f Format) bool {
	given := func(v json.RawMessage) bool { return len(v) > 0 && string(v) != "null" }
	switch f {
	case OpenAIChat:
		return given(raw.ReasoningEffort)
	case OpenAIResponses:
		return given(raw.Reasoning)
	case Anthropic:
		return raw.Thinking != nil && raw.Thinking.Type != "disabled"
	case Gemini:
		g, _ := raw.geminiGenerationConfig()
		return g != nil && (given(g.ThinkingConfig) || given(g.ThinkingConfigProto))
	case Ollama:
		return given(raw.Think) && string(raw.Think) != "false"
	}
	return false
}

// intField is an integer field of the body, named as the body spells it;
// v is nil when the body does not give it (or gives null).
type intField struct {
	name string
	v    *int64
}

// spelled is the one of two spellings of a field the body gives.
func spelled(parent, camel, proto string, camelV, protoV *int64) intField {
	if protoV != nil {
		return intField{parent + proto, protoV}
	}
	return intField{parent + camel, camelV}
}

// geminiGenerationConfig returns generationConfig in the spelling the body
// gives it, with the prefix that names its fields in messages.
func (raw *rawRequest) geminiGenerationConfig() (*generationConfig, string) {
	if raw.GenerationConfigProto != nil {
		return raw.GenerationConfigProto, "generation_config."
	}
	return raw.GenerationConfig, "generationConfig."
}

// outputCaps are the output caps the body gives in the fields the upstream of
// format f reads. A field of another API (max_output_tokens sent to chat
// completions) caps nothing there: the upstream ignores or refuses it.
func (raw *rawRequest) outputCaps(f Format) []intField {
	switch f {
	case OpenAIChat:
		return []intField{{"max_tokens", raw.MaxTokens}, {"max_completion_tokens", raw.MaxCompletionTokens}}
	case OpenAICompletions, Anthropic:
		return []intField{{"max_tokens", raw.MaxTokens}}
	case OpenAIResponses:
		return []intField{{"max_output_tokens", raw.MaxOutputTokens}}
	case Gemini:
		if g, parent := raw.geminiGenerationConfig(); g != nil {
			return []intField{spelled(parent, "maxOutputTokens", "max_output_tokens", g.MaxOutputTokens, g.MaxOutputTokensProto)}
		}
	case Ollama:
		// num_predict <= 0 sets no cap: -1 is unbounded, -2 fills the context.
		if o := raw.Options; o != nil && o.NumPredict != nil && *o.NumPredict > 0 {
			return []intField{{"options.num_predict", o.NumPredict}}
		}
	}
	return nil
}

// choices are the fields that multiply the output of format f: the largest
// counts. Legacy completions generate best_of candidates (and bill them all)
// to return n.
func (raw *rawRequest) choices(f Format) []intField {
	n := intField{"n", raw.N}
	switch f {
	case Gemini:
		if g, parent := raw.geminiGenerationConfig(); g != nil {
			if c := spelled(parent, "candidateCount", "candidate_count", g.CandidateCount, g.CandidateCountProto); c.v != nil {
				n = c
			}
		}
	case OpenAICompletions:
		return []intField{n, {"best_of", raw.BestOf}}
	}
	return []intField{n}
}

// ParseRequest reads a request body of format f sent to path (Gemini names
// the model and streaming in the path). Errors wrap ErrBadRequest.
func ParseRequest(f Format, path string, body []byte) (Request, error) {
	var raw rawRequest
	if err := json.Unmarshal(body, &raw); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) {
			return Request{}, badRequest("field %q must be %s", typeErr.Field, jsonKind(typeErr.Type.Kind()))
		}
		return Request{}, badRequest("body is not valid JSON")
	}
	if err := checkAmbiguous(body); err != nil {
		return Request{}, err
	}
	var req Request
	if err := raw.model(f, path, &req); err != nil {
		return Request{}, err
	}
	if err := raw.limits(f, &req); err != nil {
		return Request{}, err
	}
	if err := raw.prompt(f, body, &req); err != nil {
		return Request{}, err
	}
	req.UncountedOutput = raw.uncountedOutput(f)
	req.Background = f == OpenAIResponses && string(raw.Background) == "true"
	return req, nil
}

// uncountedOutput names an output modality the body asks for that the meter
// does not count as it streams, or "".
func (raw *rawRequest) uncountedOutput(f Format) string {
	switch f {
	case OpenAIChat:
		if present(raw.Audio) || slices.Contains(raw.Modalities, "audio") {
			return "audio"
		}
	case Gemini:
		g, _ := raw.geminiGenerationConfig()
		if g == nil {
			return ""
		}
		if present(g.SpeechConfig) || present(g.SpeechConfigProto) {
			return "audio"
		}
		for _, m := range append(g.ResponseModalities, g.ResponseModalitiesProto...) {
			if !strings.EqualFold(m, "TEXT") {
				return strings.ToLower(m)
			}
		}
	}
	return ""
}

// model reads the model and whether the answer streams into req: from the
// path for Gemini and an Azure deployment, else from the body.
func (raw *rawRequest) model(f Format, path string, req *Request) error {
	switch deployment := azureDeployment(path); {
	case f == Gemini:
		req.Model, req.Stream = geminiModel(path)
		if req.Model == "" {
			return badRequest("the path names no model (want …/models/<model>:generateContent)")
		}
	case deployment != "":
		// Azure serves the deployment's model, whatever the body names.
		req.Model, req.Deployment = deployment, true
		req.Stream = raw.Stream != nil && *raw.Stream
	default:
		if err := json.Unmarshal(raw.Model, &req.Model); err != nil || strings.TrimSpace(req.Model) == "" {
			return badRequest("field \"model\" is required and must be a non-empty string")
		}
		// Ollama's native API streams unless told not to.
		req.Stream = raw.Stream != nil && *raw.Stream || f == Ollama && raw.Stream == nil
	}
	return nil
}

// limits reads into req what bounds the output and its price: the service
// tier, usage in the stream, reasoning, the outputs asked for (n) and the
// output caps.
func (raw *rawRequest) limits(f Format, req *Request) error {
	if present(raw.ServiceTier) {
		var tier string
		if err := json.Unmarshal(raw.ServiceTier, &tier); err != nil {
			return badRequest("field \"service_tier\" must be a string")
		}
		req.ServiceTier = budget.ParseServiceTier(tier)
	}
	req.IncludeUsage = raw.StreamOptions != nil && raw.StreamOptions.IncludeUsage
	req.NoOutput = f == OpenAIEmbeddings
	req.Reasoning = raw.reasoning(f)
	req.N = 1
	for _, c := range raw.choices(f) {
		if c.v == nil {
			continue
		}
		if *c.v < 1 || *c.v > MaxChoices {
			return badRequest("field %q must be between 1 and %d", c.name, MaxChoices)
		}
		req.N = max(req.N, *c.v)
	}
	for _, c := range raw.outputCaps(f) {
		if c.v == nil {
			continue
		}
		if *c.v < 1 || *c.v > MaxOutputCap {
			return badRequest("field %q must be between 1 and %d", c.name, MaxOutputCap)
		}
		if *c.v > req.MaxOutputTokens {
			req.MaxOutputTokens, req.MaxOutputTokensField = *c.v, c.name
		}
	}
	if f == Anthropic && raw.MaxTokens == nil {
		return badRequest("field \"max_tokens\" is required by the Messages API")
	}
	return nil
}

// prompt reads into req the prompt estimate of the body, the input it names
// but does not show, the fields no table knows (fields.go), and the output
// the prompts of a legacy completion multiply.
func (raw *rawRequest) prompt(f Format, body []byte, req *Request) error {
	est := estimator{gemini: f == Gemini}
	unknown, foreign := classify(f, body, &est)
	if err := req.boundForeignCap(foreign); err != nil {
		return err
	}
	req.UnknownFields = unknown
	if f == OpenAICompletions {
		req.N *= promptCount(raw.Prompt)
	}
	for _, m := range raw.Messages {
		est.messages++
		est.add(m)
	}
	if f == OpenAICompletions || f == OpenAIEmbeddings {
		// A prompt or input of token ids is that many tokens.
		raw.Prompt, raw.Input = est.tokenIDs(raw.Prompt), est.tokenIDs(raw.Input)
	}
	if hidden := raw.hiddenInput(f); hidden != "" {
		est.hidden = hidden
	}
	for _, part := range []json.RawMessage{raw.Input, raw.Instructions, raw.System, raw.Prompt, raw.SystemInstruction, raw.SystemInstructionProto} {
		est.add(part)
	}
	est.tools(raw.Tools)
	if len(raw.Contents) > 0 {
		var contents []json.RawMessage
		if json.Unmarshal(raw.Contents, &contents) == nil {
			for _, c := range contents {
				est.messages++
				est.add(c)
			}
		}
	}
	if est.ambiguousKey != "" {
		return ambiguous(est.ambiguousKey, "a Gemini part")
	}
	req.PromptTokens, req.HiddenInput = est.tokens(), est.hidden
	return nil
}

// boundForeignCap holds an OpenAI-compatible server's own output cap like
// the API's: the largest cap counts. A negative one asks for no bound
// (llama.cpp's n_predict -1), which no budget can hold.
func (req *Request) boundForeignCap(c intField) error {
	if c.v == nil {
		return nil
	}
	if *c.v < 0 || *c.v > MaxOutputCap {
		return badRequest("field %q must be between 0 and %d", c.name, MaxOutputCap)
	}
	if *c.v > req.MaxOutputTokens {
		req.MaxOutputTokens, req.MaxOutputTokensField = *c.v, c.name
	}
	req.ForeignCap, req.ForeignCapField = *c.v, c.name
	return nil
}

// promptCount is how many prompts a legacy completion's prompt holds, each
// answered with its own outputs: an array of strings or of token-id arrays
// is one a member; a string, or one array of token ids, is one.
func promptCount(prompt json.RawMessage) int64 {
	if len(prompt) == 0 || prompt[0] != '[' {
		return 1
	}
	var prompts []json.RawMessage
	if json.Unmarshal(prompt, &prompts) != nil || len(prompts) == 0 {
		return 1
	}
	if c := prompts[0]; len(c) > 0 && (c[0] == '-' || c[0] >= '0' && c[0] <= '9') {
		return 1
	}
	return int64(len(prompts))
}

// hiddenInput names the input the request makes the upstream read that its
// body does not show, or "".
func (raw *rawRequest) hiddenInput(f Format) string {
	switch {
	case f == OpenAIResponses && present(raw.PreviousResponseID):
		return "previous_response_id"
	case f == OpenAIResponses && present(raw.Conversation):
		return "conversation"
	case f == OpenAIResponses && len(raw.Prompt) > 0 && raw.Prompt[0] == '{':
		return "a stored prompt"
	case f == Anthropic && present(raw.MCPServers):
		return "mcp_servers"
	}
	return ""
}

// present reports whether a JSON value was given and is not null.
func present(v json.RawMessage) bool { return len(v) > 0 && string(v) != "null" }

func jsonKind(k reflect.Kind) string {
	switch k {
	case reflect.Int64, reflect.Int:
		return "an integer"
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		return "a string"
	case reflect.Slice:
		return "an array"
	}
	return "an object"
}

// estimator counts the text bytes and media parts of prompt JSON.
type estimator struct {
	textBytes int64
	media     int64
	messages  int64
	ids       int64  // token ids
	hidden    string // the first input the body does not show
	// gemini reads part keys in both proto JSON spellings; ambiguousKey is
	// the first key of a part that gives one twice, in both spellings.
	gemini       bool
	ambiguousKey string
}

func (e *estimator) tokens() int64 {
	return e.textBytes + e.ids + e.media*MediaPartTokens + e.messages*MessageOverheadTokens
}

// tokenIDs counts a prompt given as token ids (an array of integers, or of
// arrays of them) and returns nil for it; any other prompt is returned as is.
func (e *estimator) tokenIDs(raw json.RawMessage) json.RawMessage {
	if len(raw) == 0 || raw[0] != '[' {
		return raw
	}
	var ids []int64
	if json.Unmarshal(raw, &ids) == nil {
		e.ids += int64(len(ids))
		return nil
	}
	var batches [][]int64
	if json.Unmarshal(raw, &batches) == nil {
		for _, b := range batches {
			e.ids += int64(len(b))
		}
		return nil
	}
	return raw
}

// serverTools are tool types whose results the upstream fetches and bills as
// input the body does not show (web pages, files, code output), matched as
// a prefix of the tool's type.
var serverTools = []string{"web_search", "web_fetch", "file_search", "code_interpreter", "code_execution", "mcp", "image_generation"}

// geminiServerTools are the keys by which a Gemini tool names a server tool.
var geminiServerTools = map[string]bool{
	"googleSearch": true, "google_search": true, "googleSearchRetrieval": true, "google_search_retrieval": true,
	"codeExecution": true, "code_execution": true, "urlContext": true, "url_context": true,
	"fileSearch": true, "file_search": true, "retrieval": true,
}

// tools counts tool definitions as text, and notes a server tool.
func (e *estimator) tools(raw json.RawMessage) {
	var v any
	if len(raw) == 0 || json.Unmarshal(raw, &v) != nil {
		return
	}
	tools, _ := v.([]any)
	for _, x := range tools {
		t, _ := x.(map[string]any)
		typ, _ := t["type"].(string)
		for _, p := range serverTools {
			if e.hidden == "" && strings.HasPrefix(typ, p) {
				e.hidden = "server tool " + typ
			}
		}
		for k := range t {
			if e.hidden == "" && geminiServerTools[k] {
				e.hidden = "server tool " + k
			}
		}
	}
	e.walk(v)
}

func (e *estimator) add(raw json.RawMessage) {
	if len(raw) == 0 {
		return
	}
	var v any
	if json.Unmarshal(raw, &v) == nil {
		e.walk(v)
	}
}

// imageTypes are content part types of an image; fileTypes of a file,
// document or audio clip.
var (
	imageTypes = map[string]bool{"image_url": true, "image": true, "input_image": true}
	fileTypes  = map[string]bool{"file": true, "input_file": true, "document": true, "input_audio": true, "audio": true, "container_upload": true}
)

// references are the keys by which a part names content the upstream fetches
// itself (a file id, a URL other than an inline data: URL): input the body
// does not show.
var references = []string{"file_id", "file_url", "fileUri", "file_uri", "url"}

// structuralKeys name fields that are not prompt text.
var structuralKeys = map[string]bool{
	"type": true, "role": true, "id": true, "cache_control": true,
	"detail": true, "media_type": true, "format": true, "call_id": true, "tool_call_id": true,
	"images": true, "mimeType": true, "mime_type": true,
}

func (e *estimator) walk(v any) {
	switch v := v.(type) {
	case string:
		// An inline data: URL outside a typed part is media, not text.
		if strings.HasPrefix(v, "data:") && len(v) > 1024 {
			e.media++
			return
		}
		e.textBytes += int64(len(v))
	case float64:
		e.textBytes += int64(len(strconv.FormatFloat(v, 'g', -1, 64)))
	case bool:
		e.textBytes += 5
	case []any:
		for _, x := range v {
			e.walk(x)
		}
	case map[string]any:
		e.walkObject(v)
	}
}

func (e *estimator) walkObject(v map[string]any) {
	t, _ := v["type"].(string)
	if t == "item_reference" {
		// A Responses input item by id: the upstream reads the item.
		if e.hidden == "" {
			e.hidden = "an item_reference"
		}
		return
	}
	if imageTypes[t] {
		e.media++
		return
	}
	if fileTypes[t] {
		// A file by reference is fetched by the upstream; one inline counts
		// its bytes and a part's worth more (a PDF's pages bill as text
		// and as images).
		e.media++
		if e.hidden == "" && hasReference(v) {
			e.hidden = "a " + t + " by reference"
		}
		for k, x := range v {
			if k != "type" {
				e.walk(x)
			}
		}
		return
	}
	if e.gemini && e.ambiguousKey == "" {
		for _, f := range geminiPartFields {
			if _, camel := v[f[0]]; camel {
				if _, proto := v[f[1]]; proto {
					e.ambiguousKey = f[1]
				}
			}
		}
	}
	// Gemini marks media parts by key, Ollama lists images per message.
	if e.gemini && e.geminiMedia(v) {
		return
	}
	if images, ok := v["images"].([]any); ok {
		e.media += int64(len(images))
	}
	for k, x := range v {
		if !structuralKeys[k] {
			e.textBytes += int64(len(k))
			e.walk(x)
		}
	}
}

// geminiMedia counts a Gemini part of inline data (its bytes too) or of a
// file by URI (input the body does not show), and reports whether v is one.
func (e *estimator) geminiMedia(v map[string]any) bool {
	for _, k := range [...]string{"inlineData", "inline_data"} {
		if x, ok := v[k]; ok {
			e.media++
			e.walk(x)
			return true
		}
	}
	for _, k := range [...]string{"fileData", "file_data"} {
		if _, ok := v[k]; ok {
			e.media++
			if e.hidden == "" {
				e.hidden = "a Gemini " + k + " part"
			}
			return true
		}
	}
	return false
}

// hasReference reports whether a file part names its content by id or URL
// rather than holding it, at its top or in its source.
func hasReference(part map[string]any) bool {
	if src, ok := part["source"].(map[string]any); ok {
		// Anthropic's source of a document or image: url or file, or
		// inline (base64, text, content).
		if typ, _ := src["type"].(string); typ == "url" || typ == "file" {
			return true
		}
	}
	for _, m := range []any{part, part["source"], part["file"], part["input_audio"]} {
		obj, ok := m.(map[string]any)
		if !ok {
			continue
		}
		for _, k := range references {
			if ref, ok := obj[k].(string); ok && ref != "" && !strings.HasPrefix(ref, "data:") {
				return true
			}
		}
	}
	return false
}
