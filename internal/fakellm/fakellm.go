// Package fakellm is a local OpenAI-, Anthropic- and Ollama-compatible
// upstream for tests and bench scripts. Every answer reports a fixed usage
// (at most the request's own output cap with StopAtCap).
//
// An embeddings request reports Input tokens only. A chat completion with
// "stream": true is streamed as Chunks SSE chunks
// Interval apart, with a usage chunk only when the request sets
// stream_options.include_usage, as OpenAI does; a legacy completion
// (/v1/completions) streams alike, its text in choices[].text; /v1/messages
// streams the Anthropic event sequence with two cumulative message_delta
// events.
//
// Request headers change one answer: X-Fake-Status (answer with that status),
// X-Fake-No-Usage (report no usage), X-Fake-Delay (wait first), X-Fake-Cut
// (close a stream after that many chunks, before any usage).
package fakellm

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Server answers like an LLM API.
type Server struct {
	Input, Output int // tokens reported per request
	// StopAtCap makes a chat or Anthropic request that names an output cap
	// (max_completion_tokens or max_tokens) report at most that many output
	// tokens, as a model stops at its cap; Output is then what a request
	// without one writes.
	StopAtCap bool
	Delay     time.Duration // before answering
	Chunks    int           // chunks per stream
	Interval  time.Duration // between chunks
	// Gate, when set, is received from after a stream's first chunk, so a
	// test can hold a stream open.
	Gate chan struct{}

	hits     atomic.Int64
	mu       sync.Mutex
	lastBody []byte
}

// New returns a server reporting 30 input and 70 output tokens, streaming 5
// chunks 10 ms apart.
func New() *Server {
	return &Server{Input: 30, Output: 70, Chunks: 5, Interval: 10 * time.Millisecond}
}

// Hits is how many requests were served.
func (s *Server) Hits() int64 { return s.hits.Load() }

// LastBody is the body of the last request.
func (s *Server) LastBody() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return string(s.lastBody)
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.hits.Add(1)
	body, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	s.lastBody = body
	s.mu.Unlock()
	var req struct {
		Model         string `json:"model"`
		Stream        *bool  `json:"stream"`
		StreamOptions struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
		MaxCompletionTokens int `json:"max_completion_tokens"`
		MaxTokens           int `json:"max_tokens"`
	}
	_ = json.Unmarshal(body, &req)
	output := s.Output
	if limit := cmp.Or(req.MaxCompletionTokens, req.MaxTokens); s.StopAtCap && limit > 0 {
		output = min(output, limit)
	}

	delay := s.Delay
	if d, err := time.ParseDuration(r.Header.Get("X-Fake-Delay")); err == nil {
		delay = d
	}
	time.Sleep(delay)
	if code, err := strconv.Atoi(r.Header.Get("X-Fake-Status")); err == nil {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_, _ = io.WriteString(w, `{"error":{"message":"upstream says no"}}`)
		return
	}
	a := answer{
		s: s, w: w, model: req.Model, output: output,
		noUsage: r.Header.Get("X-Fake-No-Usage") != "",
		chunks:  s.Chunks,
	}
	if cut, err := strconv.Atoi(r.Header.Get("X-Fake-Cut")); err == nil {
		a.chunks, a.cut = cut, true
	}
	stream := req.Stream != nil && *req.Stream
	switch {
	case strings.HasSuffix(r.URL.Path, "/messages") && stream:
		a.anthropicStream()
	case strings.HasSuffix(r.URL.Path, "/messages"):
		a.json(fmt.Sprintf(`{"id":"msg_fake","type":"message","role":"assistant","model":%q,"content":[{"type":"text","text":"hello"}],"stop_reason":"end_turn"%s}`,
			req.Model, a.usage(`,"usage":{"input_tokens":%d,"output_tokens":%d}`, s.Input, output)))
	case strings.HasSuffix(r.URL.Path, "/embeddings"):
		a.json(fmt.Sprintf(`{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}],"model":%q%s}`,
			req.Model, a.usage(`,"usage":{"prompt_tokens":%d,"total_tokens":%d}`, s.Input, s.Input)))
	case strings.HasSuffix(r.URL.Path, "/completions") && !strings.HasSuffix(r.URL.Path, "/chat/completions") && stream:
		a.completionStream(req.StreamOptions.IncludeUsage)
	case stream:
		a.chatStream(req.StreamOptions.IncludeUsage)
	default:
		a.json(fmt.Sprintf(`{"id":"chatcmpl-fake","object":"chat.completion","model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}]%s}`,
			req.Model, a.usage(`,"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}`, s.Input, output, s.Input+output)))
	}
}

// answer is one response being written.
type answer struct {
	s       *Server
	output  int // tokens reported
	w       http.ResponseWriter
	model   string
	noUsage bool
	chunks  int
	cut     bool
}

func (a *answer) usage(format string, args ...any) string {
	if a.noUsage {
		return ""
	}
	return fmt.Sprintf(format, args...)
}

func (a *answer) json(body string) {
	a.w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(a.w, body)
}

func (a *answer) send(event string) {
	_, _ = io.WriteString(a.w, event)
	_ = http.NewResponseController(a.w).Flush()
}

// pace waits between chunks, and after the first one for the gate.
func (a *answer) pace(i int) {
	if i == 0 && a.s.Gate != nil {
		<-a.s.Gate
	}
	time.Sleep(a.s.Interval)
}

func (a *answer) chatStream(includeUsage bool) {
	a.openAIStream(includeUsage, "c", "chat.completion.chunk", a.output,
		func(i int) string { return fmt.Sprintf(`{"index":0,"delta":{"content":"tok%02d "}}],"usage":null`, i) })
}

// completionStream streams a legacy completion: its text in choices[].text,
// the usage chunk as chatStream sends it.
func (a *answer) completionStream(includeUsage bool) {
	a.openAIStream(includeUsage, "cmpl", "text_completion", a.s.Output,
		func(i int) string {
			return fmt.Sprintf(`{"text":"tok%02d ","index":0,"logprobs":null,"finish_reason":null}]`, i)
		})
}

// openAIStream sends an OpenAI-style stream of objects with id and object:
// chunk(i) is the rest of chunk i after its choices' opening bracket; the
// usage chunk (choices empty) reports output tokens when asked for, then
// [DONE].
func (a *answer) openAIStream(includeUsage bool, id, object string, output int, chunk func(i int) string) {
	a.w.Header().Set("Content-Type", "text/event-stream")
	for i := 0; i < a.chunks; i++ {
		a.send(fmt.Sprintf("data: {\"id\":%q,\"object\":%q,\"model\":%q,\"choices\":[%s}\n\n", id, object, a.model, chunk(i)))
		a.pace(i)
	}
	if a.cut {
		return
	}
	if includeUsage && !a.noUsage {
		s := a.s
		a.send(fmt.Sprintf("data: {\"id\":%q,\"object\":%q,\"model\":%q,\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\n", id, object, a.model, s.Input, output, s.Input+output))
	}
	a.send("data: [DONE]\n\n")
}

func (a *answer) anthropicStream() {
	s := a.s
	a.w.Header().Set("Content-Type", "text/event-stream")
	a.send(fmt.Sprintf("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg\",\"type\":\"message\",\"role\":\"assistant\",\"model\":%q,\"content\":[],\"usage\":{\"input_tokens\":%d,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":0,\"output_tokens\":1}}}\n\n", a.model, s.Input))
	a.send("event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n")
	for i := 0; i < a.chunks; i++ {
		a.send(fmt.Sprintf("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"tok%02d \"}}\n\n", i))
		a.pace(i)
	}
	if a.cut {
		return
	}
	a.send("event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n")
	// message_delta usage is cumulative: a meter that summed would charge 1.5x.
	a.send(fmt.Sprintf("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":null},\"usage\":{\"output_tokens\":%d}}\n\n", a.output/2))
	a.send(fmt.Sprintf("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":%d}}\n\n", a.output))
	a.send("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")
}
