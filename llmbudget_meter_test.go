package fleetguard

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// streamSetup runs Caddy with one global token budget on a real Redis in
// front of a local streaming upstream.
type streamSetup struct {
	t     *testing.T
	up    *upstream
	url   string
	tc    *testCaddy
	cfg   string
	redis *redis.Client
}

func newStreamSetup(t *testing.T, extra string) *streamSetup {
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	port := freePort(t)
	prefix := fmt.Sprintf("stream%d", port)
	site := llmSite(port, up.URL, "fleetguard {\n redis "+srv.URL()+"\n prefix "+prefix+"\n }", `budget g {
			limit 1000000
			window 1h
			unit tokens
		}`)
	site.LLMBudget = append(site.LLMBudget, extra)
	cfg := site.String()
	s := &streamSetup{t: t, up: up, url: fmt.Sprintf("http://127.0.0.1:%d", port), cfg: cfg,
		redis: redis.NewClient(&redis.Options{Addr: srv.Addr()})}
	t.Cleanup(func() { s.redis.Close() })
	s.tc = startCaddy(t, cfg)
	return s
}

// counter is the budget's counter in Redis (0 before any request).
func (s *streamSetup) counter() int64 {
	s.t.Helper()
	waitSettles()
	keys, err := s.redis.Keys(context.Background(), "*:bg:{b}:g:*").Result()
	if err != nil || len(keys) > 1 {
		s.t.Fatalf("budget keys %v %v", keys, err)
	}
	if len(keys) == 0 {
		return 0
	}
	n, _ := s.redis.Get(context.Background(), keys[0]).Int64()
	return n
}

// waitCounter waits until the counter equals want, failing after 5 s.
func (s *streamSetup) waitCounter(want int64) {
	s.t.Helper()
	eventuallyValue(s.t, 5*time.Second, fmt.Sprintf("the budget counter at %d", want), s.counter,
		func(n int64) bool { return n == want })
}

// open sends a streaming request and returns the response with its body
// unread; the request ends with ctx.
func (s *streamSetup) open(ctx context.Context, path, body string, headers ...string) *http.Response {
	s.t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.url+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for _, h := range headers {
		name, value, _ := strings.Cut(h, ":")
		req.Header.Set(name, strings.TrimSpace(value))
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.t.Fatalf("POST %s: %v", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		s.t.Fatalf("POST %s: %d %s", path, resp.StatusCode, b)
	}
	return resp
}

const streamBody = `{"model":"gpt-4o","stream":true,"max_tokens":200,"messages":[{"role":"user","content":"count to five"}]}`

func promptEstimate(t *testing.T, f usage.Format, path, body string) int64 {
	t.Helper()
	req, err := usage.ParseRequest(f, path, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return req.PromptTokens
}

func settles(source string) float64 {
	return testutil.ToFloat64(metrics.llmSettles.WithLabelValues(source))
}

func TestStreamChargesReportedUsageAndInjectsIncludeUsage(t *testing.T) {
	s := newStreamSetup(t, "")
	resp := s.open(context.Background(), "/v1/chat/completions", streamBody)
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.Header.Get("Content-Type") != "text/event-stream" || !strings.Contains(string(got), "data: [DONE]") {
		t.Fatalf("the client gets the stream as sent: %s", got)
	}
	if !strings.Contains(s.up.LastBody(), `"stream_options":{"include_usage":true}`) {
		t.Fatalf("the upstream was not asked for usage: %s", s.up.LastBody())
	}
	req, err := usage.ParseRequest(usage.OpenAIChat, "/v1/chat/completions", []byte(s.up.LastBody()))
	if err != nil || req.Model != "gpt-4o" || req.MaxOutputTokens != 200 || !req.Stream {
		t.Fatalf("the rewritten body lost fields: %+v %v", req, err)
	}
	s.waitCounter(100)
}

// naiveClient reads an OpenAI chat stream the way ordinary code does, indexing
// choices[0] on every chunk; it fails where that code would throw.
func naiveClient(t *testing.T, stream []byte) (text string) {
	t.Helper()
	for _, line := range strings.Split(string(stream), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatalf("chunk %q: %v", data, err)
		}
		if len(chunk.Choices) == 0 {
			t.Fatalf("chunk %q has no choices[0]: c.choices[0].delta throws on it", data)
		}
		text += chunk.Choices[0].Delta.Content
	}
	return text
}

// The usage chunk llmbudget asked for is taken out of what the client
// receives (and still settles); a client that asks for it gets it.
func TestInjectedUsageChunkIsRemovedForTheClient(t *testing.T) {
	s := newStreamSetup(t, "")
	for _, body := range []string{streamBody, strings.Replace(streamBody, `"stream":true`, `"stream":true,"stream_options":{"include_usage":false}`, 1)} {
		before := s.counter()
		resp := s.open(context.Background(), "/v1/chat/completions", body)
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if text := naiveClient(t, got); text == "" || !strings.Contains(string(got), "data: [DONE]") {
			t.Fatalf("the stream lost its text or its end: %q", got)
		}
		s.waitCounter(before + 100)
	}
	asked := strings.Replace(streamBody, `"stream":true`, `"stream":true,"stream_options":{"include_usage":true}`, 1)
	resp := s.open(context.Background(), "/v1/chat/completions", asked)
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(got), `"choices":[]`) {
		t.Fatalf("a client that asked for usage must get the usage chunk: %q", got)
	}
}

func TestStreamWithoutInjectionIsEstimated(t *testing.T) {
	s := newStreamSetup(t, "inject_stream_usage off")
	before := settles("estimated")
	resp := s.open(context.Background(), "/v1/chat/completions", streamBody)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if strings.Contains(s.up.LastBody(), "include_usage") {
		t.Fatal("inject_stream_usage off must leave the body alone")
	}
	// 5 chunks of "tokNN " = 30 bytes of text, at most 30 tokens and the
	// overhead (the strict bound), plus the prompt.
	s.waitCounter(promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", streamBody) + usage.OutputTokenBound(30))
	if settles("estimated") != before+1 {
		t.Fatal("a stream without usage counts as usage_source=estimated")
	}
}

// A long stream's chunks past the first 16 are read by comparison with the
// one before (the meter's event template): through a real Caddy, the text
// is still counted whole, and the reported usage still settles.
func TestLongStreamIsMeteredWhole(t *testing.T) {
	s := newStreamSetup(t, "inject_stream_usage off")
	s.up.Chunks, s.up.Interval = 60, time.Millisecond
	body := strings.Replace(streamBody, `"max_tokens":200`, `"max_tokens":1000`, 1)
	resp := s.open(context.Background(), "/v1/chat/completions", body)
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if text := naiveClient(t, got); len(text) != 60*len("tok00 ") {
		t.Fatalf("the client read %d bytes of text, want %d", len(text), 60*len("tok00 "))
	}
	// 60 chunks of "tokNN " = 360 bytes of text, charged by the strict
	// bound, plus the prompt.
	prompt := promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", body)
	s.waitCounter(prompt + usage.OutputTokenBound(360))
	asked := strings.Replace(body, `"stream":true`, `"stream":true,"stream_options":{"include_usage":true}`, 1)
	resp = s.open(context.Background(), "/v1/chat/completions", asked)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	s.waitCounter(prompt + usage.OutputTokenBound(360) + 100)
}

func TestStreamFirstChunkArrivesBeforeUpstreamFinishes(t *testing.T) {
	s := newStreamSetup(t, "")
	gate := make(chan struct{})
	s.up.Gate = gate
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp := s.open(ctx, "/v1/chat/completions", streamBody)
	defer resp.Body.Close()
	// The upstream holds the stream after its first chunk until the gate
	// opens: the chunk can only be read now if nothing buffers it.
	first := make(chan string, 1)
	r := bufio.NewReader(resp.Body)
	go func() {
		line, _ := r.ReadString('\n')
		first <- line
	}()
	select {
	case line := <-first:
		if !strings.Contains(line, "tok00") {
			t.Fatalf("first line %q", line)
		}
	case <-time.After(5 * time.Second):
		close(gate)
		t.Fatal("the first chunk did not reach the client while the upstream was still streaming")
	}
	close(gate)
	// Finish the stream so its settle does not land in another test.
	io.Copy(io.Discard, r)
	s.waitCounter(100)
}

func TestStreamClientCancelSettlesOnce(t *testing.T) {
	s := newStreamSetup(t, "")
	gate := make(chan struct{})
	s.up.Gate = gate
	before := settles("estimated")
	ctx, cancel := context.WithCancel(context.Background())
	resp := s.open(ctx, "/v1/chat/completions", streamBody)
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	if !strings.Contains(line, "tok00") {
		t.Fatalf("first line %q", line)
	}
	cancel() // the client goes away mid-stream
	resp.Body.Close()
	close(gate)
	prompt := promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", streamBody)
	eventually(t, 5*time.Second, "a settle after the client went away", func() bool { return settles("estimated") != before })
	// Charged: the prompt plus the strict bound of the output that had
	// started (at least the first chunk, at most all five), never the
	// 200-token reservation.
	got := s.counter()
	if got < prompt+usage.OutputTokenBound(6) || got > prompt+usage.OutputTokenBound(30) {
		t.Fatalf("counter %d after a cancel, want the prompt %d plus %d..%d output tokens", got, prompt, usage.OutputTokenBound(6), usage.OutputTokenBound(30))
	}
	waitSettles() // a second settle, were there one, would be pending now
	if settles("estimated") != before+1 || s.counter() != got {
		t.Fatalf("settled %v times (counter %d then %d), want once", settles("estimated")-before, got, s.counter())
	}
}

func TestAnthropicStreamChargesStartPlusLastDelta(t *testing.T) {
	s := newStreamSetup(t, "")
	body := `{"model":"claude-sonnet-4-5","stream":true,"max_tokens":200,"messages":[{"role":"user","content":"hi"}]}`
	resp := s.open(context.Background(), "/v1/messages", body)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	// message_start input 30 + the last cumulative message_delta 70; a meter
	// that summed the deltas would charge 30 + 35 + 70.
	s.waitCounter(100)
}

func TestStreamCutBeforeUsageIsEstimated(t *testing.T) {
	s := newStreamSetup(t, "")
	resp := s.open(context.Background(), "/v1/chat/completions", streamBody, "X-Fake-Cut: 3")
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.Count(string(got), "data: ") != 3 {
		t.Fatalf("the client gets what the upstream sent: %q", got)
	}
	// 3 chunks = 18 bytes of text, charged by the strict bound.
	s.waitCounter(promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", streamBody) + usage.OutputTokenBound(18))
}

func TestStreamSettlesAfterAReload(t *testing.T) {
	s := newStreamSetup(t, "")
	gate := make(chan struct{})
	s.up.Gate = gate
	resp := s.open(context.Background(), "/v1/chat/completions", streamBody)
	r := bufio.NewReader(resp.Body)
	if line, _ := r.ReadString('\n'); !strings.Contains(line, "tok00") {
		t.Fatalf("first line %q", line)
	}
	// Reload while the stream is open: the old config is cleaned up before
	// the stream ends.
	if code, body := s.tc.load("text/caddyfile", s.cfg); code != http.StatusOK {
		t.Fatalf("reload: %d %s", code, body)
	}
	close(gate)
	io.Copy(io.Discard, r)
	resp.Body.Close()
	s.waitCounter(100)
}
