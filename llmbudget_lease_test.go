package fleetguard

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/bpe"
	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// TestWhatALeaseHolds: a single streamed answer the meter can read holds its
// prompt and a lease; everything whose output the meter cannot see as it
// streams holds the whole cap: non-streamed answers, several outputs, models
// that reason by default, requests that ask for reasoning.
func TestWhatALeaseHolds(t *testing.T) {
	const leaseMin = DefaultOutputLeaseMin
	tests := []struct {
		name, path, body string
		options          func(h *LLMBudget)
		output           int64 // held, besides the prompt
	}{
		{"chat stream", "/v1/chat/completions", `{"model":"gpt-4o","stream":true,"max_tokens":4096,"messages":[]}`, nil, leaseMin},
		{"chat, not streamed", "/v1/chat/completions", `{"model":"gpt-4o","max_tokens":4096,"messages":[]}`, nil, 4096},
		{"chat stream, two choices", "/v1/chat/completions", `{"model":"gpt-4o","stream":true,"n":2,"max_tokens":4096,"messages":[]}`, nil, 2 * 4096},
		{"chat stream, a cap under the lease", "/v1/chat/completions", `{"model":"gpt-4o","stream":true,"max_tokens":100,"messages":[]}`, nil, 100},
		{"chat stream to a reasoning model", "/v1/chat/completions", `{"model":"o3-mini","stream":true,"max_tokens":4096,"messages":[]}`, nil, 4096},
		{"chat stream to a reasoning model through a router", "/v1/chat/completions", `{"model":"openai/GPT-5-mini","stream":true,"max_tokens":4096,"messages":[]}`, nil, 4096},
		{"chat stream asking for reasoning", "/v1/chat/completions", `{"model":"gpt-4o","stream":true,"reasoning_effort":"low","max_tokens":4096,"messages":[]}`, nil, 4096},
		{"legacy completions stream", "/v1/completions", `{"model":"gpt-3.5-turbo-instruct","stream":true,"max_tokens":4096,"prompt":"hi"}`, nil, leaseMin},
		{"responses stream", "/v1/responses", `{"model":"gpt-4o","stream":true,"max_output_tokens":4096,"input":"hi"}`, nil, leaseMin},
		{"responses stream asking for reasoning", "/v1/responses", `{"model":"gpt-4o","stream":true,"reasoning":{"effort":"low"},"max_output_tokens":4096,"input":"hi"}`, nil, 4096},
		{"anthropic stream", "/v1/messages", `{"model":"claude-sonnet-4-5","stream":true,"max_tokens":4096,"messages":[]}`, nil, leaseMin},
		{"anthropic stream with thinking", "/v1/messages", `{"model":"claude-sonnet-4-5","stream":true,"max_tokens":4096,"thinking":{"type":"enabled","budget_tokens":2048},"messages":[]}`, nil, 4096},
		{"gemini stream as SSE", "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse", `{"contents":[],"generationConfig":{"maxOutputTokens":4096}}`, nil, leaseMin},
		{"gemini stream as a JSON array", "/v1beta/models/gemini-2.0-flash:streamGenerateContent", `{"contents":[],"generationConfig":{"maxOutputTokens":4096}}`, nil, 4096},
		{"gemini stream to a thinking model", "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse", `{"contents":[],"generationConfig":{"maxOutputTokens":4096}}`, nil, 4096},
		{"ollama streams by default", "/api/chat", `{"model":"llama3","messages":[],"options":{"num_predict":4096}}`, nil, leaseMin},
		{"ollama asked to think", "/api/chat", `{"model":"llama3","think":true,"messages":[],"options":{"num_predict":4096}}`, nil, 4096},
		{"reasoning_models replaces the default", "/v1/chat/completions", `{"model":"o3-mini","stream":true,"max_tokens":4096,"messages":[]}`,
			func(h *LLMBudget) { h.ReasoningModels = []string{"my-*"} }, leaseMin},
		{"a model on a configured reasoning list", "/v1/chat/completions", `{"model":"My-Reasoner","stream":true,"max_tokens":4096,"messages":[]}`,
			func(h *LLMBudget) { h.ReasoningModels = []string{"my-*"} }, 4096},
		{"output_leases off", "/v1/chat/completions", `{"model":"gpt-4o","stream":true,"max_tokens":4096,"messages":[]}`,
			func(h *LLMBudget) { off := false; h.OutputLeases = &off }, 4096},
		{"a larger output_lease_min", "/v1/chat/completions", `{"model":"gpt-4o","stream":true,"max_tokens":4096,"messages":[]}`,
			func(h *LLMBudget) { h.OutputLeaseMin = 1000 }, 1000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := capHandler(t, func(h *LLMBudget) {
				if tt.options != nil {
					tt.options(h)
				}
			})
			fw := serveCapped(t, h, tt.path, tt.body)
			path := strings.Split(tt.path, "?")[0]
			req, err := usage.ParseRequest(usage.FormatFromPath(path), path, []byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if want := req.PromptTokens + tt.output; fw.hold != want {
				t.Fatalf("held %d, want the prompt and %d, %d", fw.hold, tt.output, want)
			}
		})
	}
}

// streamOf is a streamed answer of format f with n events of text each,
// as its API writes it, and the response's content type.
func streamOf(f usage.Format, n int, text string) (string, []string) {
	var evs []string
	sse := func(event, data string) {
		if event != "" {
			event = "event: " + event + "\n"
		}
		evs = append(evs, event+"data: "+data+"\n\n")
	}
	switch f {
	case usage.OpenAIChat:
		for i := 0; i < n; i++ {
			sse("", fmt.Sprintf(`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":%q},"finish_reason":null}]}`, text))
		}
		sse("", `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`)
		evs = append(evs, "data: [DONE]\n\n")
	case usage.OpenAICompletions:
		for i := 0; i < n; i++ {
			sse("", fmt.Sprintf(`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"text":%q,"index":0,"finish_reason":null}]}`, text))
		}
		evs = append(evs, "data: [DONE]\n\n")
	case usage.OpenAIResponses:
		sse("response.created", `{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","status":"in_progress","model":"m","output":[]}}`)
		for i := 0; i < n; i++ {
			sse("response.output_text.delta", fmt.Sprintf(`{"type":"response.output_text.delta","sequence_number":%d,"item_id":"msg_1","output_index":0,"content_index":0,"delta":%q}`, i+1, text))
		}
	case usage.Anthropic:
		sse("message_start", `{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"m","content":[],"usage":{"input_tokens":10,"output_tokens":1}}}`)
		sse("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`)
		for i := 0; i < n; i++ {
			sse("content_block_delta", fmt.Sprintf(`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":%q}}`, text))
		}
	case usage.Gemini:
		for i := 0; i < n; i++ {
			sse("", fmt.Sprintf(`{"candidates":[{"content":{"parts":[{"text":%q}],"role":"model"},"index":0}],"modelVersion":"gemini-2.0-flash","responseId":"r1"}`, text))
		}
	case usage.Ollama:
		for i := 0; i < n; i++ {
			evs = append(evs, fmt.Sprintf(`{"model":"llama3","created_at":"2026-01-01T00:00:00Z","message":{"role":"assistant","content":%q},"done":false}`+"\n", text))
		}
		return "application/x-ndjson", evs
	}
	return "text/event-stream", evs
}

// TestATruncatedStreamEndsInItsAPIsForm: a budget with room for the lease
// and little more; a stream that goes on past it ends at its lease in the
// API's own terminal form, the upstream request is cancelled, and the
// budget is charged what the lease held, within its limit.
func TestATruncatedStreamEndsInItsAPIsForm(t *testing.T) {
	tests := []struct {
		path, body string
		ends       []string // in this order, at the end of what the client reads
	}{
		{"/v1/chat/completions", `{"model":"m","stream":true,"max_tokens":4096,"messages":[]}`,
			[]string{`"finish_reason":"length"`, "data: [DONE]\n\n"}},
		{"/v1/completions", `{"model":"m","stream":true,"max_tokens":4096,"prompt":"hi"}`,
			[]string{`"object":"text_completion"`, `"finish_reason":"length"`, "data: [DONE]\n\n"}},
		{"/v1/responses", `{"model":"m","stream":true,"max_output_tokens":4096,"input":"hi"}`,
			[]string{"event: response.incomplete", `"id":"resp_1"`, `"reason":"max_output_tokens"`, `"status":"incomplete"`}},
		{"/v1/messages", `{"model":"m","stream":true,"max_tokens":4096,"messages":[]}`,
			[]string{"event: content_block_stop", "event: message_delta", `"stop_reason":"max_tokens"`, "event: message_stop"}},
		{"/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse", `{"contents":[],"generationConfig":{"maxOutputTokens":4096}}`,
			[]string{`"finishReason":"MAX_TOKENS"`, `"responseId":"r1"`}},
		{"/api/chat", `{"model":"llama3","messages":[],"options":{"num_predict":4096}}`,
			[]string{`"done":true`, `"done_reason":"length"`, `"message":{"content":"","role":"assistant"}`}},
	}
	for _, tt := range tests {
		format := usage.FormatFromPath(strings.Split(tt.path, "?")[0])
		t.Run(format.String(), func(t *testing.T) {
			req, err := usage.ParseRequest(format, strings.Split(tt.path, "?")[0], []byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			// Room for the prompt, the lease and 20 tokens: the first
			// extension (64 or more) is refused.
			limit := req.PromptTokens + DefaultOutputLeaseMin + 20
			h := directHandler(t, func(h *LLMBudget) { h.Budgets[0].Limit = float64(limit) })
			contentType, events := streamOf(format, 400, "ten bytes.") // 10 tokens a delta by the strict bound
			cancelled := make(chan struct{})
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				w.Header().Set("Content-Type", contentType)
				w.WriteHeader(http.StatusOK)
				for _, ev := range events {
					if r.Context().Err() != nil {
						close(cancelled)
						return r.Context().Err()
					}
					if _, err := w.Write([]byte(ev)); err != nil {
						return err
					}
				}
				return nil
			})
			r := httptest.NewRequest(http.MethodPost, tt.path, strings.NewReader(tt.body))
			r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
			rec := httptest.NewRecorder()
			if err := h.ServeHTTP(rec, r, next); err != nil {
				t.Fatalf("ServeHTTP: %v", err)
			}
			select {
			case <-cancelled:
			case <-time.After(5 * time.Second):
				t.Fatal("the upstream request was not cancelled")
			}
			got := rec.Body.String()
			tail := got[max(0, len(got)-1500):]
			at := 0
			for _, want := range tt.ends {
				i := strings.Index(tail[at:], want)
				if i < 0 {
					t.Fatalf("the stream's end lacks %q after byte %d:\n%s", want, at, tail)
				}
				at += i + len(want)
			}
			if n := strings.Count(got, "ten bytes."); n < (DefaultOutputLeaseMin-usage.OutputOverheadTokens)/10 || n >= 400 {
				t.Fatalf("%d of 400 deltas reached the client, want the lease's worth", n)
			}
			eachEventIsJSON(t, format, got)
			if format == usage.OpenAIResponses {
				// The response it ends with holds the text the client got:
				// the SDKs take that object as the answer.
				data := got[strings.LastIndex(got, "data: ")+len("data: "):]
				var end struct {
					Response struct {
						Output []struct {
							Content []struct{ Text string }
						}
					}
				}
				want := strings.Repeat("ten bytes.", strings.Count(got[:strings.LastIndex(got, "event: ")], "ten bytes."))
				if err := json.Unmarshal([]byte(data), &end); err != nil || len(end.Response.Output) != 1 ||
					len(end.Response.Output[0].Content) != 1 || end.Response.Output[0].Content[0].Text != want {
					t.Fatalf("response.incomplete holds %+v (%v), want the %d bytes of text the client got", end.Response, err, len(want))
				}
			}
			// The input charged is the estimate, or what the stream reported
			// (Anthropic's message_start says 10); the output, what the lease
			// held: up to the room the limit left it.
			input := req.PromptTokens
			if format == usage.Anthropic {
				input = 10
			}
			if output := h.usedForTest(t) - input; output > limit-req.PromptTokens || output < DefaultOutputLeaseMin {
				t.Fatalf("charged %d of output, want what the lease held, between %d and the room the limit left, %d", output, DefaultOutputLeaseMin, limit-req.PromptTokens)
			}
		})
	}
}

// streaming is an upstream that answers with events, as a stream of
// contentType.
func streaming(contentType string, events []string) caddyhttp.Handler {
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", contentType)
		w.WriteHeader(http.StatusOK)
		for _, ev := range events {
			if _, err := io.WriteString(w, ev); err != nil {
				return err
			}
		}
		return nil
	})
}

// serveStream runs body, posted to path, through h in front of next.
func serveStream(t *testing.T, h *LLMBudget, path, body string, next caddyhttp.Handler) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
	rec := httptest.NewRecorder()
	if err := h.ServeHTTP(rec, r, next); err != nil {
		t.Fatal(err)
	}
	return rec
}

// eachEventIsJSON checks that every data line (or NDJSON line) a client
// reads is a JSON object, or [DONE].
func eachEventIsJSON(t *testing.T, f usage.Format, stream string) {
	t.Helper()
	for _, line := range strings.Split(stream, "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if f == usage.Ollama {
			data, ok = line, line != ""
		}
		if !ok || data == "[DONE]" {
			continue
		}
		var v map[string]any
		if err := json.Unmarshal([]byte(data), &v); err != nil {
			t.Fatalf("an event is not a JSON object: %q: %v", data, err)
		}
	}
}

// TestLeasesAdmitWhatTheBudgetCanServe: twenty streams of 300 tokens under
// a 40,000-token budget all run at once, none cut, and the counter ends at
// what they reported; holding each one's cap of 4096 admitted nine. (A
// model with no history has its text counted at the strict bound, a token a
// byte, 4.5 for each of these words: 20 streams hold about 34,000 at their
// end.)
func TestLeasesAdmitWhatTheBudgetCanServe(t *testing.T) {
	up := newFakeLLM(t)
	up.Output, up.Words, up.Interval = 300, true, 2*time.Millisecond
	port := freePort(t)
	tc := startCaddy(t, llmCaddyfile(port, up.URL, fmt.Sprintf("fleetguard {\n prefix lease%d\n }", port), `budget g {
			limit 40000
			window 1h
			unit tokens
		}`))
	proveModels(nil, "gpt-4o")
	const clients = 20
	body := `{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"max_tokens":4096,"messages":[{"role":"user","content":"go"}]}`
	type result struct {
		status int
		body   string
	}
	results := make(chan result, clients)
	for i := 0; i < clients; i++ {
		go func() {
			resp, got := chat(t, fmt.Sprintf("http://127.0.0.1:%d", port), body)
			results <- result{resp.StatusCode, got}
		}()
	}
	var reported int64
	for i := 0; i < clients; i++ {
		r := <-results
		if r.status != http.StatusOK || !strings.Contains(r.body, `"completion_tokens":300`) || strings.Contains(r.body, `"finish_reason":"length"`) {
			t.Fatalf("stream %d: %d …%s", i, r.status, r.body[max(0, len(r.body)-600):])
		}
		reported += 300 + int64(up.Input)
	}
	waitSettles()
	used := mustInt(t, budgetWindowAt(t, http.MethodGet, "http://"+tc.admin+"/fleetguard/budgets/g").Used.String())
	if used != reported {
		t.Fatalf("counter %d, want the %d reported", used, reported)
	}
}

// The running count never falls below the upstream's own running usage,
// nor one token for each event with text, nor the text's strict bound.
func TestTheRunningCountFollowsTheHighestSignal(t *testing.T) {
	l := &lease{}
	l.observe(usage.Reading{OutputTextBytes: 40})
	if l.count != usage.OutputTokenBound(40) {
		t.Fatalf("count %d, want the strict bound %d", l.count, usage.OutputTokenBound(40))
	}
	// The upstream's running usage, and the margin of the events it may
	// generate before it sees a cut (twice the largest event's 40 bytes).
	l.observe(usage.Reading{OutputTextBytes: 41, Usage: budget.Usage{OutputTokens: 300}})
	if l.count != 380 {
		t.Fatalf("count %d, want the upstream's running 300 and a margin of 80", l.count)
	}
	l.observe(usage.Reading{OutputTextBytes: 42})
	if l.count != 380 {
		t.Fatalf("count %d fell back, want it kept at 380", l.count)
	}
}

// TestAStreamCutAtItsLeaseEndsCleanlyThroughCaddy: through reverse_proxy, a
// stream whose extension is refused reaches the client as a finished answer
// (no cut connection), the upstream stops generating, and the budget ends
// within its limit.
func TestAStreamCutAtItsLeaseEndsCleanlyThroughCaddy(t *testing.T) {
	up := newFakeLLM(t)
	up.Output, up.Words, up.Interval = 3000, true, time.Millisecond
	port := freePort(t)
	logPath := filepath.Join(t.TempDir(), "caddy.log")
	tc := startCaddy(t, llmCaddyfile(port, up.URL, fmt.Sprintf("fleetguard {\n prefix cut%d\n }\n log default {\n output file %s\n level DEBUG\n }", port, logPath), `budget g {
			limit 1000
			window 1h
			unit tokens
		}`))
	proveModels(nil, "gpt-4o")
	body := `{"model":"gpt-4o","stream":true,"max_tokens":4096,"messages":[{"role":"user","content":"go on"}]}`
	resp, err := http.Post(fmt.Sprintf("http://127.0.0.1:%d/v1/chat/completions", port), "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("%d, reading the stream: %v (the client must see a finished answer)", resp.StatusCode, err)
	}
	events := strings.Split(strings.TrimSuffix(string(got), "\n\n"), "\n\n")
	if n := len(events); n < 3 || events[n-1] != "data: [DONE]" || !strings.Contains(events[n-2], `"finish_reason":"length"`) {
		t.Fatalf("the stream ends %q, want the length chunk, then [DONE]", events[max(0, len(events)-3):])
	}
	eventuallyValue(t, 5*time.Second, "the upstream's request cancelled (tokens generated so far)", up.Generated,
		func(int64) bool { return up.Stopped() > 0 })
	if up.Generated() >= 3000 {
		t.Fatalf("the upstream generated its whole answer (%d)", up.Generated())
	}
	waitSettles()
	if used := mustInt(t, budgetWindowAt(t, http.MethodGet, "http://"+tc.admin+"/fleetguard/budgets/g").Used.String()); used > 1000 || used < 500 {
		t.Fatalf("charged %d, want what the lease held, within the limit 1000", used)
	}
	// The cut is a Caddy event (its debug log shows each), naming the
	// budget that refused.
	log, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"name":"llmbudget_truncated"`, `"budget":"g"`, `"model":"gpt-4o"`} {
		if !strings.Contains(string(log), want) {
			t.Fatalf("the log has no %s:\n%s", want, grepLines(string(log), "event"))
		}
	}
}

// TestAStallMidStreamEndsTheStreamAtItsLease: Redis stalls (DEBUG SLEEP)
// while a leased stream needs an extension: the extension fails, the stream
// ends at its lease as a finished answer, and once Redis answers again the
// settle charges what the lease held, once, and leaves no reservation
// behind. With fail_open the stream goes on unleased instead, and settles to
// what it reports.
func TestAStallMidStreamEndsTheStreamAtItsLease(t *testing.T) {
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail_open=%v", failOpen), func(t *testing.T) {
			srv := redistest.StartWith(t, "--enable-debug-command", "yes")
			up := newFakeLLM(t)
			up.Output, up.Words, up.Interval = 600, true, time.Millisecond
			port := freePort(t)
			options := ""
			if failOpen {
				options = "fail_open"
			}
			tc := startCaddy(t, llmCaddyfile(port, up.URL, fmt.Sprintf("fleetguard {\n redis %s\n prefix stallstream\n }", srv.URL()), `budget g {
			limit 1000000
			window 1h
			unit tokens
		}
		`+options))
			proveModels(nil, "gpt-4o")
			body := `{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"max_tokens":4096,"messages":[{"role":"user","content":"go on"}]}`
			resp, err := http.Post(fmt.Sprintf("http://127.0.0.1:%d/v1/chat/completions", port), "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
			defer admin.Close()
			var got strings.Builder
			sc := bufio.NewScanner(resp.Body)
			for words := 0; sc.Scan(); {
				got.WriteString(sc.Text() + "\n")
				if strings.Contains(sc.Text(), `"content"`) {
					if words++; words == 20 {
						go admin.Do(context.Background(), "DEBUG", "SLEEP", "1.5")
						srv.WaitStalled(t)
					}
				}
			}
			if err := sc.Err(); err != nil {
				t.Fatalf("reading the stream: %v", err)
			}
			var usageChunk struct {
				Usage struct {
					PromptTokens     int64 `json:"prompt_tokens"`
					CompletionTokens int64 `json:"completion_tokens"`
				} `json:"usage"`
			}
			lines := strings.Split(strings.TrimSpace(got.String()), "\n\n")
			finish := `"finish_reason":"length"`
			if failOpen {
				finish = `"finish_reason":"stop"`
			}
			if n := len(lines); n < 4 || lines[n-1] != "data: [DONE]" || !strings.Contains(lines[n-3], finish) ||
				json.Unmarshal([]byte(strings.TrimPrefix(lines[n-2], "data: ")), &usageChunk) != nil {
				t.Fatalf("the stream ends %q, want the %s chunk, the usage chunk, [DONE]", lines[max(0, len(lines)-3):], finish)
			}
			charged := usageChunk.Usage.PromptTokens + usageChunk.Usage.CompletionTokens
			switch {
			case failOpen && usageChunk.Usage.CompletionTokens != 600:
				t.Fatalf("reported %d output tokens, want the whole answer, 600", usageChunk.Usage.CompletionTokens)
			case !failOpen && (usageChunk.Usage.CompletionTokens < DefaultOutputLeaseMin || usageChunk.Usage.CompletionTokens >= 4096):
				t.Fatalf("cut at %d output tokens, want the lease it held", usageChunk.Usage.CompletionTokens)
			}
			type standing struct{ used, records int64 }
			eventuallyValue(t, 15*time.Second, fmt.Sprintf("after the stall, %d used and no records", charged), func() standing {
				records, _ := admin.Keys(context.Background(), "stallstream:bg:{b}:res:*").Result()
				used := mustInt(t, budgetWindowAt(t, http.MethodGet, "http://"+tc.admin+"/fleetguard/budgets/g").Used.String())
				return standing{used, int64(len(records))}
			}, func(s standing) bool { return s.records == 0 && s.used == charged })
		})
	}
}

// TestShadowNeverCutsAStream: in shadow mode nothing is enforced, so a
// stream past its budget runs to its end, and is charged what it reports.
func TestShadowNeverCutsAStream(t *testing.T) {
	h := directHandler(t, func(h *LLMBudget) {
		h.Shadow = true
		h.Budgets[0].Limit = 300
	})
	contentType, events := streamOf(usage.OpenAIChat, 400, "ten bytes.")
	next := streaming(contentType, events)
	const body = `{"model":"m","stream":true,"max_tokens":4096,"messages":[]}`
	rec := serveStream(t, h, "/v1/chat/completions", body, next)
	if n := strings.Count(rec.Body.String(), "ten bytes."); n != 400 || strings.Contains(rec.Body.String(), `"finish_reason":"length"`) {
		t.Fatalf("%d of 400 deltas reached the client (cut: %v), want all, uncut", n, strings.Contains(rec.Body.String(), `"length"`))
	}
}

// TestALeasedRequestAnsweredInJSONHoldsItsCap: an upstream that answers a
// streamed request with plain JSON gives the meter nothing to count as it
// passes, so the lease is extended to the whole cap before the body does.
func TestALeasedRequestAnsweredInJSONHoldsItsCap(t *testing.T) {
	h := directHandler(t)
	body := `{"model":"gpt-4o","stream":true,"max_tokens":4096,"messages":[]}`
	req, err := usage.ParseRequest(usage.OpenAIChat, "/v1/chat/completions", []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	var atHeader, atBody int64
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		atHeader = h.usedForTest(t)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		atBody = h.usedForTest(t)
		_, err := io.WriteString(w, `{"choices":[{"index":0,"message":{"content":"hi"}}],"usage":{"prompt_tokens":7,"completion_tokens":3000,"total_tokens":3007}}`)
		return err
	})
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
	if err := h.ServeHTTP(httptest.NewRecorder(), r, next); err != nil {
		t.Fatal(err)
	}
	if atHeader != req.PromptTokens+DefaultOutputLeaseMin || atBody != req.PromptTokens+4096 {
		t.Fatalf("held %d before the answer and %d once it was JSON, want the lease %d then the cap %d",
			atHeader, atBody, req.PromptTokens+DefaultOutputLeaseMin, req.PromptTokens+4096)
	}
	if used := h.usedForTest(t); used != 3007 {
		t.Fatalf("settled at %d, want the 3007 reported", used)
	}
}

// TestAProxyTokenizerIsTrustedWithinWhatItsAnswersShowed: a model counted
// by another's tokenizer is not counted by it until 4 answers taught the
// scale (1.1 times the most billed per proxy token) and the density; a
// denser answer billed within the scale widens the density, one billed above
// it does not end the proxy (it was counted a token a byte), and one within
// the density billed above the scale ends it for good.
func TestAProxyTokenizerIsTrustedWithinWhatItsAnswersShowed(t *testing.T) {
	var o outputHistory
	// English-like answers: 1,000 bytes the proxy counts as 230 tokens,
	// billed 250, 260, 240 and 255 tokens (plus the overhead).
	for i, billed := range []int64{250, 260, 240, 255} {
		if o.countsTokens() {
			t.Fatalf("trusted after %d answers", i)
		}
		o.learn(answerSeen{count: 1016, bound: 1016, text: 1000, tokens: 230, proxy: true, reported: billed + usage.OutputOverheadTokens})
	}
	if !o.countsTokens() {
		t.Fatal("not trusted after 4 answers within their text's bound")
	}
	wantScale := int64((260+usage.OutputOverheadTokens)*1024+229) / 230 * 11 / 10
	if got := o.scale.Load(); got != wantScale {
		t.Fatalf("scale %d/1024, want 1.1 times the whole bill per proxy token, (260+%d)/230 = %d", got, usage.OutputOverheadTokens, wantScale)
	}
	if !o.trusts(230, 1000) || o.trusts(600, 1000) {
		t.Fatal("the proxy is trusted for text as dense as its answers', and not for a CSV's 0.6 tokens a byte")
	}
	// Tool-call arguments counted a token a byte, billed at a third of
	// that: dense by the count alone, so they widen nothing.
	o.learn(answerSeen{count: 1016, bound: 1016, text: 1000, tokens: 1000, proxy: true, reported: 350})
	if o.trusts(600, 1000) {
		t.Fatal("an answer counted a token a byte widened the density")
	}
	// A CSV answer billed within the scale widens the density.
	o.learn(answerSeen{count: 1016, bound: 1016, text: 1000, tokens: 600, proxy: true, reported: 650})
	if !o.trusts(600, 1000) || !o.countsTokens() {
		t.Fatal("a denser answer billed within the scale does not widen the density")
	}
	// A CJK answer billed far above the scale, denser than any: not a lost
	// bet (it counted a token a byte), so nothing ends.
	o.learn(answerSeen{count: 1016, bound: 1016, text: 1000, tokens: 700, proxy: true, reported: 990})
	if !o.countsTokens() || o.trusts(700, 1000) {
		t.Fatal("an answer denser than the proxy is trusted for ended it, or widened the density")
	}
	// Within the density, above the scale: the proxy ends for good.
	o.learn(answerSeen{count: 1016, bound: 1016, text: 1000, tokens: 230, proxy: true, reported: 400})
	if o.countsTokens() {
		t.Fatal("an answer within the density billed above the scale did not end the proxy")
	}
	o.learn(answerSeen{count: 1016, bound: 1016, text: 1000, tokens: 230, proxy: true, reported: 240})
	if o.countsTokens() {
		t.Fatal("the proxy came back")
	}
	// A model that bills 1,000 tokens of output it does not stream with
	// 300 of text: within the text's strict bound, but a scale would spread
	// what the upstream bills first over the text.
	var hidden outputHistory
	for range proxyProofs {
		hidden.learn(answerSeen{count: 1316, bound: 1316, text: 1300, tokens: 300, proxy: true, reported: 1300})
	}
	if hidden.countsTokens() || !hidden.tokensRevoked.Load() {
		t.Fatal("a model billing four times its proxy's count is counted by it")
	}
}

// A scale taught by short answers holds for long ones: no overhead is taken
// out of the evidence, so a model that bills 1.3 tokens a proxy token on
// every token, taught by five answers of 40 words, counts a stream of 5,000
// words at no less than its bill.
func TestAProxyScaleFromShortAnswersHoldsForLongOnes(t *testing.T) {
	var o outputHistory
	for range 5 {
		o.learn(answerSeen{count: 216, bound: 216, text: 200, tokens: 45, proxy: true, reported: 45 * 13 / 10})
	}
	if !o.countsTokens() {
		t.Fatal("not trusted after 5 answers within their text's bound")
	}
	const longTokens = 5600 // a proxy's count of 5,000 English words
	billed := int64(longTokens * 13 / 10)
	if counted := o.tokensCountOf(longTokens, true); counted < billed {
		t.Fatalf("a long answer counted %d of the %d it bills (%.2fx)", counted, billed, float64(billed)/float64(counted))
	}
}

// TestOutputHistoryLearns: after 8 answers a model's lease is the 90th
// percentile of their final counts, a token a byte and, apart, by its
// tokenizer (from the answers it counted only, so that answers counted
// before its tokenizer loaded do not teach a tokenized stream a token a
// byte); a model that bills more output than its text can hold is hidden;
// models past 256 share one history, so a client naming random models
// cannot grow memory.
func TestOutputHistoryLearns(t *testing.T) {
	var o outputHistory
	for i := int64(1); i <= 10; i++ {
		tokensCount := int64(0)
		if i > 2 {
			tokensCount = i * 30 // the first two were not counted by it
		}
		o.learn(answerSeen{count: i * 100, tokensCount: tokensCount, bound: i * 100, text: i * 100, reported: i * 50})
		if i < historyTrusted && o.leaseSize.Load() != 0 {
			t.Fatalf("after %d answers the history is used: lease %d", i, o.leaseSize.Load())
		}
		if i < historyTrusted+2 && o.tokensLeaseSize.Load() != 0 {
			t.Fatalf("after %d answers, %d counted by the tokenizer, its lease is used: %d", i, i-2, o.tokensLeaseSize.Load())
		}
	}
	if got := o.leaseSize.Load(); got != 900 {
		t.Fatalf("lease %d, want the 90th percentile of 100..1000, 900", got)
	}
	if got := o.tokensLeaseSize.Load(); got != 300 {
		t.Fatalf("the tokenizer's lease %d, want the 90th percentile of 90..300, 300", got)
	}
	if o.hidden.Load() {
		t.Fatal("answers within their text's bound do not make a model hidden")
	}
	if o.learn(answerSeen{count: 20, bound: 20, text: 20, reported: 4096}); !o.hidden.Load() {
		t.Fatal("a model that billed 4096 for 20 bytes of text is not marked hidden")
	}
	var hs histories
	for i := 0; i < 300; i++ {
		hs.of(fmt.Sprint("model-", i))
	}
	if a, b := hs.of("model-299"), hs.of("model-298"); a != b || a != &hs.others || hs.of("model-1") == a {
		t.Fatal("models past the first 256 share one history; the first keep their own")
	}
}

// TestAUsageReportIsNeverHeldAtTheLease: an event that carries no output
// (the final usage chunk) delivers nothing, so it passes even when the usage
// it reports is past the lease and the budget has no room: the answer was
// already delivered, and the settle charges what the upstream reports.
func TestAUsageReportIsNeverHeldAtTheLease(t *testing.T) {
	const body = `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":4096,"messages":[]}`
	req, err := usage.ParseRequest(usage.OpenAIChat, "/v1/chat/completions", []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	h := directHandler(t, func(h *LLMBudget) { h.Budgets[0].Limit = float64(req.PromptTokens + DefaultOutputLeaseMin + 10) })
	contentType, events := streamOf(usage.OpenAIChat, 10, "short")
	events = append(events[:len(events)-1], `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2000,"total_tokens":2005}}`+"\n\n", events[len(events)-1])
	next := streaming(contentType, events)
	rec := serveStream(t, h, "/v1/chat/completions", body, next)
	got := rec.Body.String()
	if strings.Contains(got, `"length"`) || !strings.Contains(got, `"completion_tokens":2000`) || !strings.HasSuffix(got, "data: [DONE]\n\n") {
		t.Fatalf("the stream ends …%s, want the upstream's own end, its usage chunk included", got[max(0, len(got)-400):])
	}
	if used := h.usedForTest(t); used != 2005 {
		t.Fatalf("charged %d, want the 2005 reported", used)
	}
}

// FuzzLeasedStream: whatever an upstream streams, and however its writes are
// cut, a leased stream reaches the client unchanged, or unchanged up to the
// event held at its lease and then the API's terminal form; nothing panics.
// Seeds: the golden transcripts.
func FuzzLeasedStream(f *testing.F) {
	paths := map[string]string{"openai_chat": "/v1/chat/completions", "openai_responses": "/v1/responses", "anthropic": "/v1/messages",
		"gemini": "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse", "ollama": "/api/chat", "openai_completions": "/v1/completions"}
	names := make([]string, 0, len(paths))
	for name := range paths {
		names = append(names, name)
	}
	slices.Sort(names)
	files, _ := filepath.Glob("budget/usage/testdata/streams/*")
	for _, file := range files {
		parts := strings.Split(filepath.Base(file), ".")
		if len(parts) != 3 || parts[2] == "golden" {
			continue
		}
		data, err := os.ReadFile(file)
		if err != nil {
			f.Fatal(err)
		}
		if i := slices.Index(names, parts[1]); i >= 0 {
			f.Add(uint8(i), data, uint16(7), uint16(3))
		}
	}
	f.Fuzz(func(t *testing.T, which uint8, data []byte, split, room uint16) {
		name := names[int(which)%len(names)]
		path := paths[name]
		format := usage.FormatFromPath(strings.Split(path, "?")[0])
		// Each body has only fields its API knows: one it does not would
		// hold the request's worst case, refused at these limits.
		body := map[usage.Format]string{
			usage.OpenAIChat:        `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":4096,"messages":[]}`,
			usage.OpenAICompletions: `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":4096,"prompt":"hi"}`,
			usage.OpenAIResponses:   `{"model":"m","stream":true,"max_output_tokens":4096,"input":"hi"}`,
			usage.Anthropic:         `{"model":"m","stream":true,"max_tokens":4096,"messages":[]}`,
			usage.Gemini:            `{"contents":[],"generationConfig":{"maxOutputTokens":4096}}`,
			usage.Ollama:            `{"model":"m","stream":true,"messages":[],"options":{"num_predict":4096}}`,
		}[format]
		h := directHandler(t, func(h *LLMBudget) {
			h.Budgets[0].Limit = float64(24 + int64(room%512))
			h.OutputLeaseMin = 16
		})
		contentType := "text/event-stream"
		if format == usage.Ollama {
			contentType = "application/x-ndjson"
		}
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			w.Header().Set("Content-Type", contentType)
			w.WriteHeader(http.StatusOK)
			step := int(split%64) + 1
			for rest := data; len(rest) > 0; {
				n := min(step, len(rest))
				if _, err := w.Write(rest[:n]); err != nil {
					return err
				}
				rest = rest[n:]
			}
			return nil
		})
		r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
		r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
		rec := httptest.NewRecorder()
		if err := h.ServeHTTP(rec, r, next); err != nil || rec.Code != http.StatusOK {
			return // refused before forwarding: nothing to compare
		}
		got := rec.Body.Bytes()
		if bytes.Equal(got, data) {
			return
		}
		// Cut: a prefix of the stream that ends on an event, then the end.
		for i := len(got); i >= 0; i-- {
			if i <= len(data) && bytes.Equal(got[:i], data[:i]) {
				if tail := got[i:]; !bytes.Contains(tail, []byte("length")) && !bytes.Contains(tail, []byte("max_tokens")) &&
					!bytes.Contains(tail, []byte("MAX_TOKENS")) && !bytes.Contains(tail, []byte("max_output_tokens")) {
					t.Fatalf("%s: the client got %q after the upstream's first %d bytes, not a terminal form", name, tail, i)
				}
				return
			}
		}
	})
}

// TestADollarBudgetExtendsAndCutsInDollars: a lease is extended in every
// budget's unit, a dollar budget at the output price; the dollar budget
// that has no room cuts the stream, and both budgets end at what the lease
// held, the dollar one within its limit.
func TestADollarBudgetExtendsAndCutsInDollars(t *testing.T) {
	h := directHandler(t, func(h *LLMBudget) {
		h.Budgets = []BudgetConfig{
			{Name: "tokens", Unit: "tokens", Limit: 1e9, Window: caddy.Duration(time.Hour)},
			{Name: "dollars", Unit: "usd", Limit: 0.004, Window: caddy.Duration(time.Hour)}, // 400 output tokens at $10/1M
		}
		h.Prices = map[string]PriceConfig{"gpt-4o": {Input: 2.5, Output: 10}}
	})
	const body = `{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"max_tokens":4096,"messages":[{"role":"user","content":"go on"}]}`
	contentType, events := streamOf(usage.OpenAIChat, 400, "ten bytes.")
	got := serveStream(t, h, "/v1/chat/completions", body, streaming(contentType, events)).Body.String()
	if !strings.Contains(got, `"finish_reason":"length"`) {
		t.Fatalf("the stream was not cut: …%s", got[max(0, len(got)-300):])
	}
	var end struct {
		Usage struct {
			Prompt     int64 `json:"prompt_tokens"`
			Completion int64 `json:"completion_tokens"`
		} `json:"usage"`
	}
	chunks := strings.Split(strings.TrimSpace(got), "\n\n")
	if err := json.Unmarshal([]byte(strings.TrimPrefix(chunks[len(chunks)-2], "data: ")), &end); err != nil {
		t.Fatal(err)
	}
	h.engines.waitSettles(5 * time.Second)
	used, err := h.engines.budgets.Used(context.Background(), h.budgets, budget.Dims{Model: "gpt-4o"})
	if err != nil {
		t.Fatal(err)
	}
	price := budget.Price{Rates: budget.Rates{Input: 2_500_000, Output: 10_000_000}}
	wantUSD := price.CostMicros(budget.Usage{InputTokens: end.Usage.Prompt, OutputTokens: end.Usage.Completion})
	if used[0] != end.Usage.Prompt+end.Usage.Completion || used[1] != wantUSD || used[1] > budget.USDToMicros(0.004) || end.Usage.Completion <= DefaultOutputLeaseMin {
		t.Fatalf("charged %d tokens and %d micro-dollars for a cut at %d+%d tokens; want the same usage in both units (%d micro-dollars), within $0.004, past the first lease",
			used[0], used[1], end.Usage.Prompt, end.Usage.Completion, wantUSD)
	}
}

// TestALeaseAtItsCapAdmitsWhatTheCountPassed: the running count over-counts,
// so it can pass the forwarded cap; once the lease holds the cap, the cap
// bounds what the upstream writes, and nothing more is held back for it.
func TestALeaseAtItsCapAdmitsWhatTheCountPassed(t *testing.T) {
	h := directHandler(t)
	res, denial, err := h.engines.budgets.Reserve(context.Background(), h.budgets, budget.Dims{}, budget.Spend{Tokens: 256})
	if err != nil || denial != nil {
		t.Fatal(denial, err)
	}
	l := newLease(h, res, &call{leaseSize: 256, outputCap: 300, history: new(outputHistory)})
	l.count = 400 // one event of much text: past the lease and the cap
	if !l.admit() || l.held != 300 {
		t.Fatalf("admit: held %d (refused %v), want the event admitted with the cap, 300, held", l.held, l.refused)
	}
}

// TestALeaseGrowsGeometricallyAtAnyEventRate: a stream of 300 events, one
// every 10 ms (each extension is answered before the next event) or all at
// once, extends its lease a few times, not once an event: each extension
// takes the lease about as far past the count as the count has come.
func TestALeaseGrowsGeometricallyAtAnyEventRate(t *testing.T) {
	for _, iv := range []time.Duration{10 * time.Millisecond, 0} {
		h := directHandler(t)
		_, events := streamOf(usage.OpenAIChat, 300, " word")
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(200)
			for _, ev := range events {
				w.Write([]byte(ev))
				w.(http.Flusher).Flush()
				if iv > 0 {
					time.Sleep(iv) // the event rate under test
				}
			}
			return nil
		})
		before := testutil.ToFloat64(metrics.llmLeaseExtensions.WithLabelValues("granted"))
		serveStream(t, h, "/v1/chat/completions", `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":4096,"messages":[]}`, next)
		// 1,516 counted (a token a byte) from a first lease of 256, about
		// 1.75 times more each time: 4 extensions, with one to spare for
		// the count that passes while one is in flight.
		n := testutil.ToFloat64(metrics.llmLeaseExtensions.WithLabelValues("granted")) - before
		t.Logf("an event every %v: %v extensions", iv, n)
		if n > 5 {
			t.Fatalf("an event every %v: %v extensions for 300 events, want at most 5", iv, n)
		}
	}
}

// TestATrainedStreamEndsWithinItsLearnedLease: once a model's answers have
// taught its lease, a stream like them ends within its first lease and
// makes no extension (2 store calls in all: its reserve and its settle);
// one longer than them is extended once it needs more.
func TestATrainedStreamEndsWithinItsLearnedLease(t *testing.T) {
	for _, c := range []struct {
		events int
		want   float64
	}{{300, 0}, {400, 1}} {
		h := directHandler(t)
		// Ten answers of 300 " word" events: 1,516 counted a token a byte.
		o := h.engines.histories.of("m")
		for range 10 {
			o.learn(answerSeen{count: 1516, bound: 1516, text: 1500, reported: 300})
		}
		next := streaming(streamOf(usage.OpenAIChat, c.events, " word"))
		before := testutil.ToFloat64(metrics.llmLeaseExtensions.WithLabelValues("granted"))
		serveStream(t, h, "/v1/chat/completions", `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":4096,"messages":[]}`, next)
		if n := testutil.ToFloat64(metrics.llmLeaseExtensions.WithLabelValues("granted")) - before; n != c.want {
			t.Errorf("a stream of %d events under a lease learned from answers of 300: %v extensions, want %v", c.events, n, c.want)
		}
	}
}

// A lease of a model counted by its tokenizer counts each event's text by
// it (plus the overhead and the margin of its largest event), far below a
// token a byte; the moment any answer of the model bills more than the
// tokenizer counts, the streams in flight count a token a byte from their
// next event.
func TestATokenizedLeaseCountsByTheTokenizerUntilTheModelIsRevoked(t *testing.T) {
	o := new(outputHistory)
	o.tokensProven.Store(true)
	c := &call{history: o, tokens: bpe.Load(bpe.O200k), outputCap: 4096, leaseSize: 256}
	l := newLease(nil, nil, c)
	if !l.tokenized {
		t.Fatal("a lease of a model proven by its tokenizer is not counted by it")
	}
	m := usage.NewMeter(usage.OpenAIChat, usage.SSE)
	m.CountTokens(c.tokens)
	event := func(text string) {
		_, _ = m.Write([]byte(`data: {"choices":[{"index":0,"delta":{"content":"` + text + `"}}]}` + "\n\n"))
		l.observe(m.Reading())
	}
	for range 50 {
		event(" the budget") // two tokens, 11 bytes
	}
	if want := int64(50*2 + usage.OutputOverheadTokens + 2*len(" the budget")); l.count != want {
		t.Fatalf("50 events of two tokens: count %d, want %d", l.count, want)
	}
	o.tokensRevoked.Store(true)
	event(" the budget")
	if want := usage.OutputTokenBound(51 * int64(len(" the budget"))); l.count != want {
		t.Fatalf("after the model was revoked: count %d, want the strict bound %d", l.count, want)
	}
}

// TestALeaseStepsAsFarAsItsCountUnlessRoomIsShort: an extension takes a
// lease as far past the count as the count has come (at least a quarter of
// output_lease_min), and at most a quarter of its share (with the requests
// in flight) of the least room the request's budgets had left, in each
// budget's unit (a dollar budget at the output price), so that streams near
// a budget's end hold little more than they need.
func TestALeaseStepsAsFarAsItsCountUnlessRoomIsShort(t *testing.T) {
	tokens := &budget.Budget{Name: "tokens", Unit: budget.Tokens, Limit: 1_000_000}
	dollars := &budget.Budget{Name: "dollars", Unit: budget.USD, Limit: 1_000_000}
	h := &LLMBudget{outputLeaseMin: 256, engines: new(engines)}
	res := &budget.Reservation{Holds: []budget.Hold{{Budget: tokens, Used: 0}}}
	l := newLease(h, res, &call{leaseSize: 256, outputCap: 4096})
	for _, c := range []struct {
		count, used, inFlight, want int64
	}{
		{10, 0, 1, 64},           // at least a quarter of output_lease_min
		{1000, 0, 1, 1000},       // as far as the count has come
		{1000, 998_000, 1, 500},  // a quarter of 2,000 left
		{1000, 996_000, 2, 500},  // of the 2,000 that are this stream's share
		{1000, 999_000, 100, 64}, // and never below the least step
		{1000, 0, 1000, 250},     // a thousand requests in flight
		{1000, 1_000_001, 1, 64}, // past the limit (a reload lowered it)
	} {
		l.count, res.Holds[0].Used = c.count, c.used
		h.engines.inFlight.n.Store(c.inFlight)
		if got := l.ahead(); got != c.want {
			t.Errorf("count %d, %d of 1,000,000 used, %d in flight: step %d, want %d", c.count, c.used, c.inFlight, got, c.want)
		}
	}
	// $10 per million output tokens: 10 micro-dollars a token, so 80,000
	// micro-dollars left are room for 8,000 tokens; 4 in flight, a share
	// of 2,000, a quarter of it 500.
	h.hasUSD = true
	l.c.rates = budget.Rates{Output: 10_000_000}
	res.Holds = []budget.Hold{{Budget: tokens}, {Budget: dollars, Used: 920_000}}
	l.count = 5000
	h.engines.inFlight.n.Store(4)
	if got := l.ahead(); got != 500 {
		t.Errorf("a dollar budget with room for 8,000 output tokens: step %d, want 500", got)
	}
}
