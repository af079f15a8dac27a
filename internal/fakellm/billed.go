package fakellm

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tiktoken-go/tokenizer"
)

// Billed is an upstream that bills as a provider does: an answer's output is
// its text counted by o200k (OpenAI's tokenizer), its input the request's
// prompt counted alike (or Input when set), and what it bills is what it
// generated, a cut stream's text up to the cancel included. It streams Text
// in the API of the request's path (OpenAI chat, completions and Responses,
// Anthropic Messages, Gemini with alt=sse, Ollama's /api/chat), ChunkBytes
// of it an event (several tokens a chunk, as servers batch them), Interval
// apart, and stops at the request's output cap. X-Fake-Content-Type labels
// the stream with another Content-Type.
type Billed struct {
	Text string
	// Texts, when the request names one in X-Fake-Text, is streamed instead.
	Texts      map[string]string
	ChunkBytes int
	Interval   time.Duration
	// Input, when above 0, is the input every answer reports and bills,
	// whatever the prompt (input the body does not show); X-Fake-Input sets
	// it for one request.
	Input int64
	// HiddenOutput is billed as output on top of the text, which the stream
	// does not show (reasoning); X-Fake-Hidden-Output sets it for one
	// request.
	HiddenOutput int64
	// Tokenizers bill the models whose names start with a key by its
	// count instead of o200k's (CL100kTokens: a model whose tokenizer is
	// not the one a proxy counts by).
	Tokenizers map[string]func(string) int64

	billed   atomic.Int64 // input and output billed, every answer
	hits     atomic.Int64
	inFlight atomic.Int64
	byModel  sync.Map // model → *atomic.Int64 billed

	mu      sync.Mutex
	answers []Answer
}

// Answer is one answer as billed: when its request came, for which model,
// and what it billed, input and output.
type Answer struct {
	Received time.Time
	Model    string
	Billed   int64
}

// Answers are every answer billed so far, in the order they ended.
func (b *Billed) Answers() []Answer {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]Answer(nil), b.answers...)
}

// Tokens counts s with o200k.
func Tokens(s string) int64 { return count(o200k, s) }

// CL100kTokens counts s with cl100k.
func CL100kTokens(s string) int64 { return count(cl100k, s) }

var o200k, cl100k = newCodec(tokenizer.O200kBase), newCodec(tokenizer.Cl100kBase)

// newCodec loads a vocabulary on its first use.
func newCodec(e tokenizer.Encoding) func() tokenizer.Codec {
	return sync.OnceValue(func() tokenizer.Codec {
		c, err := tokenizer.Get(e)
		if err != nil {
			panic(err)
		}
		return c
	})
}

func count(codec func() tokenizer.Codec, s string) int64 {
	n, _ := codec().Count(s)
	return int64(n)
}

// tokensOf is how model is billed.
func (b *Billed) tokensOf(model string) func(string) int64 {
	for prefix, f := range b.Tokenizers {
		if strings.HasPrefix(model, prefix) {
			return f
		}
	}
	return Tokens
}

// Billed is every token billed so far, input and output.
func (b *Billed) Billed() int64 { return b.billed.Load() }

// BilledFor is every token billed so far for model.
func (b *Billed) BilledFor(model string) int64 {
	if n, ok := b.byModel.Load(model); ok {
		return n.(*atomic.Int64).Load()
	}
	return 0
}

// InFlight is how many answers are being generated: a cut stream's bill is
// final once its answer has seen the cancel.
func (b *Billed) InFlight() int64 { return b.inFlight.Load() }

// Hits is how many requests were served.
func (b *Billed) Hits() int64 { return b.hits.Load() }

func (b *Billed) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	received := time.Now()
	b.hits.Add(1)
	b.inFlight.Add(1)
	defer b.inFlight.Add(-1)
	body, _ := io.ReadAll(r.Body)
	var req struct {
		Model               string          `json:"model"`
		MaxTokens           int64           `json:"max_tokens"`
		MaxCompletionTokens int64           `json:"max_completion_tokens"`
		MaxOutputTokens     int64           `json:"max_output_tokens"`
		Messages            json.RawMessage `json:"messages"`
		Input               json.RawMessage `json:"input"`
		Prompt              json.RawMessage `json:"prompt"`
		Contents            json.RawMessage `json:"contents"`
		GenerationConfig    struct {
			MaxOutputTokens int64 `json:"maxOutputTokens"`
		} `json:"generationConfig"`
		Options struct {
			NumPredict int64 `json:"num_predict"`
		} `json:"options"`
	}
	_ = json.Unmarshal(body, &req)
	limit := max(req.MaxTokens, req.MaxCompletionTokens, req.MaxOutputTokens, req.GenerationConfig.MaxOutputTokens, req.Options.NumPredict)
	if limit <= 0 {
		limit = 1 << 30
	}
	if i := strings.LastIndex(r.URL.Path, "/models/"); i >= 0 && req.Model == "" {
		req.Model, _, _ = strings.Cut(r.URL.Path[i+len("/models/"):], ":") // Gemini's is in the path
	}
	tokens := b.tokensOf(req.Model)
	input := b.Input
	if n, err := strconv.ParseInt(r.Header.Get("X-Fake-Input"), 10, 64); err == nil {
		input = n
	}
	if input <= 0 {
		input = tokens(string(req.Messages) + string(req.Input) + string(req.Prompt) + string(req.Contents))
	}
	text := b.Text
	if t, ok := b.Texts[r.Header.Get("X-Fake-Text")]; ok {
		text = t
	}
	hidden := b.HiddenOutput
	if n, err := strconv.ParseInt(r.Header.Get("X-Fake-Hidden-Output"), 10, 64); err == nil {
		hidden = n
	}
	a := billedAnswer{b: b, w: w, r: r, received: received, tokens: tokens, input: input, limit: limit, model: req.Model, text: text, hidden: hidden}
	a.stream(pathAPI(r.URL.Path))
}

// billedAnswer is one streamed answer.
type billedAnswer struct {
	b            *Billed
	w            http.ResponseWriter
	r            *http.Request
	received     time.Time
	tokens       func(string) int64 // how the model is billed
	input, limit int64
	model        string
	output       int64 // tokens of the text sent
	hidden       int64 // output billed on top of the text
	seq          int
	text         string
}

func pathAPI(path string) string {
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		return "chat"
	case strings.HasSuffix(path, "/completions"):
		return "completions"
	case strings.HasSuffix(path, "/responses"):
		return "responses"
	case strings.HasSuffix(path, "/messages"):
		return "anthropic"
	case strings.Contains(path, ":streamGenerateContent"):
		return "gemini"
	case strings.HasSuffix(path, "/api/chat"):
		return "ollama"
	}
	return "chat"
}

func (a *billedAnswer) event(name, data string) bool {
	var s string
	switch {
	case name == "ndjson":
		s = data + "\n"
	case name != "":
		s = "event: " + name + "\ndata: " + data + "\n\n"
	default:
		s = "data: " + data + "\n\n"
	}
	if _, err := io.WriteString(a.w, s); err != nil {
		return false
	}
	if f, ok := a.w.(http.Flusher); ok {
		f.Flush()
	}
	return a.r.Context().Err() == nil
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// stream writes the answer in api's events and bills what it generated.
func (a *billedAnswer) stream(api string) {
	b := a.b
	defer func() {
		bill := a.input + a.usageTotal()
		b.billed.Add(bill)
		n, _ := b.byModel.LoadOrStore(a.model, new(atomic.Int64))
		n.(*atomic.Int64).Add(bill)
		b.mu.Lock()
		b.answers = append(b.answers, Answer{Received: a.received, Model: a.model, Billed: bill})
		b.mu.Unlock()
	}()
	ct := "text/event-stream"
	if api == "ollama" {
		ct = "application/x-ndjson"
	}
	if label := a.r.Header.Get("X-Fake-Content-Type"); label != "" {
		ct = label // a server or proxy that labels its stream wrong
	}
	a.w.Header().Set("Content-Type", ct)
	a.w.WriteHeader(http.StatusOK)
	if !a.start(api) {
		return
	}
	text, size := a.text, max(b.ChunkBytes, 1)
	finish := "stop"
	for len(text) > 0 {
		n := min(size, len(text))
		for n < len(text) && text[n]&0xC0 == 0x80 {
			n++ // whole characters
		}
		chunk := text[:n]
		t := a.tokens(chunk)
		if a.output+a.hidden+t > a.limit {
			finish = "length"
			break
		}
		// Generated, and billed, once it is written.
		a.output += t
		text = text[n:]
		if !a.delta(api, chunk) {
			return
		}
		if b.Interval > 0 {
			select {
			case <-time.After(b.Interval):
			case <-a.r.Context().Done():
				return
			}
		}
	}
	a.end(api, finish)
}

// usageTotal is the output billed: the text sent and the hidden output, at
// most the cap.
func (a *billedAnswer) usageTotal() int64 { return min(a.output+a.hidden, a.limit) }

func (a *billedAnswer) start(api string) bool {
	switch api {
	case "anthropic":
		return a.event("message_start", fmt.Sprintf(`{"type":"message_start","message":{"id":"msg_b","type":"message","role":"assistant","model":%q,"content":[],"usage":{"input_tokens":%d,"output_tokens":1}}}`, a.model, a.input)) &&
			a.event("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`)
	case "responses":
		a.seq++
		return a.event("response.created", fmt.Sprintf(`{"type":"response.created","sequence_number":%d,"response":{"id":"resp_b","object":"response","model":%q,"status":"in_progress","output":[]}}`, a.seq, a.model))
	}
	return true
}

func (a *billedAnswer) delta(api, chunk string) bool {
	q := jsonString(chunk)
	switch api {
	case "chat":
		return a.event("", fmt.Sprintf(`{"id":"c","object":"chat.completion.chunk","model":%q,"choices":[{"index":0,"delta":{"content":%s},"finish_reason":null}]}`, a.model, q))
	case "completions":
		return a.event("", fmt.Sprintf(`{"id":"c","object":"text_completion","model":%q,"choices":[{"text":%s,"index":0,"finish_reason":null}]}`, a.model, q))
	case "responses":
		a.seq++
		return a.event("response.output_text.delta", fmt.Sprintf(`{"type":"response.output_text.delta","sequence_number":%d,"item_id":"msg_b","output_index":0,"content_index":0,"delta":%s}`, a.seq, q))
	case "anthropic":
		return a.event("content_block_delta", fmt.Sprintf(`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":%s}}`, q))
	case "gemini":
		return a.event("", fmt.Sprintf(`{"candidates":[{"content":{"role":"model","parts":[{"text":%s}]},"index":0}],"usageMetadata":{"promptTokenCount":%d,"candidatesTokenCount":%d,"totalTokenCount":%d},"modelVersion":%q}`, q, a.input, a.usageTotal(), a.input+a.usageTotal(), a.model))
	case "ollama":
		return a.event("ndjson", fmt.Sprintf(`{"model":%q,"message":{"role":"assistant","content":%s},"done":false}`, a.model, q))
	}
	return false
}

func (a *billedAnswer) end(api, finish string) {
	out, in := a.usageTotal(), a.input
	switch api {
	case "chat":
		a.event("", fmt.Sprintf(`{"id":"c","object":"chat.completion.chunk","model":%q,"choices":[{"index":0,"delta":{},"finish_reason":%q}]}`, a.model, finish))
		a.event("", fmt.Sprintf(`{"id":"c","object":"chat.completion.chunk","model":%q,"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`, a.model, in, out, in+out))
		a.event("", "[DONE]")
	case "completions":
		a.event("", fmt.Sprintf(`{"id":"c","object":"text_completion","model":%q,"choices":[{"text":"","index":0,"finish_reason":%q}],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`, a.model, finish, in, out, in+out))
		a.event("", "[DONE]")
	case "responses":
		a.seq++
		status, name := "completed", "response.completed"
		if finish == "length" {
			status, name = "incomplete", "response.incomplete"
		}
		a.event(name, fmt.Sprintf(`{"type":%q,"sequence_number":%d,"response":{"id":"resp_b","object":"response","model":%q,"status":%q,"output":[],"usage":{"input_tokens":%d,"output_tokens":%d,"total_tokens":%d}}}`, name, a.seq, a.model, status, in, out, in+out))
	case "anthropic":
		reason := "end_turn"
		if finish == "length" {
			reason = "max_tokens"
		}
		a.event("content_block_stop", `{"type":"content_block_stop","index":0}`)
		a.event("message_delta", fmt.Sprintf(`{"type":"message_delta","delta":{"stop_reason":%q},"usage":{"output_tokens":%d}}`, reason, out))
		a.event("message_stop", `{"type":"message_stop"}`)
	case "gemini":
		reason := "STOP"
		if finish == "length" {
			reason = "MAX_TOKENS"
		}
		a.event("", fmt.Sprintf(`{"candidates":[{"content":{"role":"model","parts":[{"text":""}]},"finishReason":%q,"index":0}],"usageMetadata":{"promptTokenCount":%d,"candidatesTokenCount":%d,"totalTokenCount":%d},"modelVersion":%q}`, reason, in, out, in+out, a.model))
	case "ollama":
		a.event("ndjson", fmt.Sprintf(`{"model":%q,"message":{"role":"assistant","content":""},"done":true,"done_reason":%q,"prompt_eval_count":%d,"eval_count":%d}`, a.model, finish, in, out))
	}
}
