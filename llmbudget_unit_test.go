package fleetguard

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/wait"
)

// directHandler is an llmbudget handler with one budget, g (100,000 tokens
// an hour), and the options set on its config, provisioned as Caddy does on
// a memory store of its own, for tests that drive ServeHTTP with a next
// handler of their own.
func directHandler(t testing.TB, options ...func(h *LLMBudget)) *LLMBudget {
	t.Helper()
	noWait := caddy.Duration(0) // a refusal is answered at once
	cfg := &LLMBudget{Budgets: []BudgetConfig{{Unit: "tokens", Name: "g", Limit: 100000, Window: caddy.Duration(time.Hour)}}, SettleWait: &noWait}
	for _, option := range options {
		option(cfg)
	}
	h := provisionedHandler(t, cfg, nil)
	proveModels(h.engines, leasedTestModels...)
	return h
}

// leasedTestModels are the models the tests of leases name. A model leases
// once an answer of its has shown no output beyond its text
// (llmbudget_lease_history.go); those tests start there. A test of that
// probation names a model of its own.
var leasedTestModels = []string{"gpt-4o", "gpt-3.5-turbo-instruct", "claude-sonnet-4-5", "gemini-2.0-flash", "llama3", "m", "o3-mini"}

// proveModels makes models leasing in e's histories, or in every store's
// when e is nil.
func proveModels(e *engines, models ...string) {
	prove := func(e *engines) {
		for _, m := range models {
			e.histories.of(m).proven.Store(true)
		}
	}
	if e != nil {
		prove(e)
		return
	}
	enginePool.Range(func(_, v any) bool {
		prove(v.(*engines))
		return true
	})
}

func (h *LLMBudget) usedForTest(t testing.TB) int64 {
	t.Helper()
	h.engines.waitSettles(5 * time.Second)
	used, err := h.engines.budgets.Used(context.Background(), h.budgets, budget.Dims{Model: "gpt-4o"})
	if err != nil {
		t.Fatal(err)
	}
	return used[0]
}

// waitSettles waits for the background settles of every engine in the pool,
// so a test reads counters after the settles of the responses it has.
func waitSettles() {
	enginePool.Range(func(_, v any) bool {
		// Every reservation's settle has run once none is in flight; only
		// then is a wait on the settles' WaitGroup free of a race with a
		// handler still on its way to its settle.
		e := v.(*engines)
		wait.Poll(5*time.Second, func() bool { return e.inFlight.n.Load() == 0 })
		e.waitSettles(5 * time.Second)
		return true
	})
}

// serveRecovering calls ServeHTTP and swallows a panic of next, as Caddy's
// server does.
func serveRecovering(h *LLMBudget, body string, next caddyhttp.HandlerFunc) (panicked bool) {
	req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
	req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
	defer func() { panicked = recover() != nil }()
	_ = h.ServeHTTP(httptest.NewRecorder(), req, next)
	return false
}

func TestSettleRunsWhenALaterHandlerPanics(t *testing.T) {
	h := directHandler(t)
	if !serveRecovering(h, streamBody, func(http.ResponseWriter, *http.Request) error { panic("boom") }) {
		t.Fatal("the panic must propagate")
	}
	if got := h.usedForTest(t); got != 0 {
		t.Fatalf("a panic before any response: counter %d, want 0 (released)", got)
	}

	// A panic after the stream started charges the prompt and the output seen.
	serveRecovering(h, streamBody, func(w http.ResponseWriter, _ *http.Request) error {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"12345678\"}}]}\n\n")
		panic("boom")
	})
	prompt, _ := usage.ParseRequest(usage.OpenAIChat, "/v1/chat/completions", []byte(streamBody))
	if got, want := h.usedForTest(t), prompt.PromptTokens+usage.OutputTokenBound(8); got != want {
		t.Fatalf("a panic mid-stream: counter %d, want %d (prompt + 8 bytes of output)", got, want)
	}
}

func TestMeteringWriterPassesFlushesThrough(t *testing.T) {
	rec := httptest.NewRecorder()
	mw, _ := newMeteringWriter(rec, nil, nil, nil, &call{format: usage.OpenAIChat})
	mw.Header().Set("Content-Type", "text/event-stream")
	_, _ = io.WriteString(mw, "data: {}\n\n")
	if err := http.NewResponseController(mw).Flush(); err != nil {
		t.Fatalf("http.ResponseController cannot flush through the writer: %v", err)
	}
	if !rec.Flushed || rec.Body.String() != "data: {}\n\n" {
		t.Fatalf("flushed %v, body %q", rec.Flushed, rec.Body.String())
	}
	if mw.meter == nil {
		t.Fatal("a 2xx event stream is metered")
	}
}

func TestEncodedResponseKeepsTheReservation(t *testing.T) {
	h := directHandler(t)
	serveRecovering(h, streamBody, func(w http.ResponseWriter, _ *http.Request) error {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Content-Encoding", "gzip")
		w.WriteHeader(http.StatusOK)
		_, err := w.Write([]byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0})
		return err
	})
	prompt, _ := usage.ParseRequest(usage.OpenAIChat, "/v1/chat/completions", []byte(streamBody))
	if got, want := h.usedForTest(t), prompt.PromptTokens+200; got != want {
		t.Fatalf("an unreadable (compressed) stream: counter %d, want the whole reservation %d", got, want)
	}
}

// A stream cut before its usage, with an event over the meter's 1 MiB bound,
// is estimated, but never beyond the output cap it reserved.
func TestEstimatedStreamNeverExceedsTheReservedCap(t *testing.T) {
	h := directHandler(t)
	big := strings.Repeat("x", 2<<20)
	serveRecovering(h, streamBody, func(w http.ResponseWriter, _ *http.Request) error {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		_, err := io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\""+big+"\"}}]}\n\n")
		return err
	})
	prompt, _ := usage.ParseRequest(usage.OpenAIChat, "/v1/chat/completions", []byte(streamBody))
	if got, want := h.usedForTest(t), prompt.PromptTokens+200; got != want {
		t.Fatalf("a cut stream with 2 MiB of text: counter %d, want the prompt plus the reserved cap of 200 (%d)", got, want)
	}
}

// FuzzLLMBudgetBodies: whatever the body, the request is either refused with
// a 4xx and not forwarded, or forwarded holding a reservation.
func FuzzLLMBudgetBodies(f *testing.F) {
	for _, s := range []string{
		chatBody, streamBody, `{"model":"gpt-4o","MODEL":"x"}`, `{"model":"gpt-4o","max_tokens":1,"max_tokens":9}`,
		`{"model":"gpt-4o","n":3,"max_completion_tokens":7,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}`,
		`not json`, `[]`, `{"model":""}`,
	} {
		f.Add([]byte(s))
	}
	h := directHandler(f)
	f.Fuzz(func(t *testing.T, body []byte) {
		h.engines.waitSettles(5 * time.Second)
		before := h.usedForTest(t)
		forwarded, held := false, false
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
			forwarded = true
			used, err := h.engines.budgets.Used(context.Background(), h.budgets, budget.Dims{})
			held = err == nil && used[0] > before
			w.WriteHeader(http.StatusInternalServerError) // released after
			return nil
		})
		req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(string(body)))
		req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
		rec := httptest.NewRecorder()
		err := h.ServeHTTP(rec, req, next)
		status := rec.Code
		if he, ok := err.(caddyhttp.HandlerError); ok {
			status = he.StatusCode
		}
		switch {
		case forwarded && !held:
			t.Fatalf("body %q was forwarded without a reservation", body)
		case !forwarded && (status < 400 || status >= 500):
			t.Fatalf("body %q was neither forwarded nor refused with a 4xx (status %d, %v)", body, status, err)
		}
	})
}

// However the upstream splits its writes, stripping the usage chunk gives the
// client the stream less that one event, and the meter still reads it.
func TestStripUsageChunkAtAnySplit(t *testing.T) {
	for _, name := range []string{"chat_usage.openai_chat.sse", "chat_crlf.openai_chat.sse"} {
		stream, err := os.ReadFile("budget/usage/testdata/streams/" + name)
		if err != nil {
			t.Fatal(err)
		}
		var want []byte
		for rest := stream; len(rest) > 0; {
			end := usage.EventEnd(rest, 0)
			if end < 0 {
				end = len(rest)
			}
			if !usage.IsUsageOnlyChunk(rest[:end]) {
				want = append(want, rest[:end]...)
			}
			rest = rest[end:]
		}
		if len(want) == len(stream) {
			t.Fatalf("%s has no usage chunk: the test proves nothing", name)
		}
		for split := 1; split < len(stream); split += 7 {
			rec := httptest.NewRecorder()
			mw, _ := newMeteringWriter(rec, nil, nil, nil, &call{format: usage.OpenAIChat})
			mw.stripUsage = true
			mw.Header().Set("Content-Type", "text/event-stream")
			for rest := stream; len(rest) > 0; {
				n := min(split, len(rest))
				if _, err := mw.Write(rest[:n]); err != nil {
					t.Fatal(err)
				}
				rest = rest[n:]
			}
			mw.drain()
			if got := rec.Body.String(); got != string(want) {
				t.Fatalf("%s split every %d bytes: the client got\n%q\nwant\n%q", name, split, got, want)
			}
			if out := outcomeOf(mw, 10, 1000, false); out.source != sourceReported {
				t.Fatalf("%s split every %d bytes: settled as %q, want the reported usage", name, split, out.source)
			}
		}
	}
}

// A budget's limit_for and alert_at in JSON: values by name or hash, in the
// budget's unit; refusals name the field.
func TestBudgetConfigLimitForAndAlertAt(t *testing.T) {
	research := budget.ScopeID(&budget.Budget{Scope: budget.PerTeam}, budget.Dims{Team: "research"})
	for _, tt := range []struct {
		name  string
		bc    BudgetConfig
		fixed map[string]int64 // when no error
		err   string
	}{
		{"a team by name, in dollars", BudgetConfig{Scope: "team", Unit: "usd", Limit: 25, LimitFor: []LimitForConfig{{Value: "research", Limit: 100.5}}, AlertAt: []int{80, 95}},
			map[string]int64{research: 100_500_000}, ""},
		{"a team by hash", BudgetConfig{Unit: "tokens", Scope: "team", Limit: 10, LimitFor: []LimitForConfig{{ValueHash: research[len("team-"):], Limit: 20}}},
			map[string]int64{research: 20}, ""},
		{"value and hash", BudgetConfig{Unit: "tokens", Scope: "team", Limit: 10, LimitFor: []LimitForConfig{{Value: "x", ValueHash: research[len("team-"):], Limit: 20}}}, nil, "limit_for[0]: give value or value_hash"},
		{"a global budget", BudgetConfig{Unit: "tokens", Limit: 10, LimitFor: []LimitForConfig{{Value: "x", Limit: 20}}}, nil, "a global budget has no scope value"},
		{"no limit", BudgetConfig{Unit: "tokens", Scope: "model", Limit: 10, LimitFor: []LimitForConfig{{Value: "gpt-4o"}}}, nil, "limit_for[0]: limit must be > 0"},
		{"fractional tokens", BudgetConfig{Unit: "tokens", Scope: "model", Limit: 10, LimitFor: []LimitForConfig{{Value: "gpt-4o", Limit: 1.5}}}, nil, "whole number"},
		{"alert_at descending", BudgetConfig{Unit: "tokens", Limit: 10, AlertAt: []int{95, 80}}, nil, "alert_at: each percentage once, in ascending order"},
		{"alert_at 0", BudgetConfig{Unit: "tokens", Limit: 10, AlertAt: []int{0, 80}}, nil, "alert_at: percentages of the limit, 1% to 100%"},
		{"no unit", BudgetConfig{Limit: 5}, nil, "unit is required: tokens or usd"},
		{"an unknown unit", BudgetConfig{Unit: "eur", Limit: 5}, nil, `unit "eur": want tokens or usd`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tt.bc.Name, tt.bc.Window = "b", caddy.Duration(time.Hour)
			b, err := tt.bc.compile()
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) || !strings.Contains(err.Error(), `budget "b"`) {
					t.Fatalf("error %v, want one naming budget \"b\" and %q", err, tt.err)
				}
				return
			}
			if err != nil || len(b.Fixed) != len(tt.fixed) {
				t.Fatalf("fixed %v, %v; want %v", b.Fixed, err, tt.fixed)
			}
			for id, n := range tt.fixed {
				if b.Fixed[id] != n {
					t.Fatalf("fixed %v, want %v", b.Fixed, tt.fixed)
				}
			}
		})
	}
}

// TestABudgetWithoutUnitDoesNotLoad: a JSON config whose budget says no
// unit is refused as it is provisioned, naming the budget; `limit 5` is not
// read as 5 tokens, which would refuse every request.
func TestABudgetWithoutUnitDoesNotLoad(t *testing.T) {
	_, err := provisionHandler(t, &LLMBudget{Budgets: []BudgetConfig{{Name: "team_usd", Limit: 5, Window: caddy.Duration(time.Hour)}}}, nil)
	if err == nil || !strings.Contains(err.Error(), `budget "team_usd": unit is required`) {
		t.Fatalf("a budget without unit: %v, want it refused naming the budget", err)
	}
}
