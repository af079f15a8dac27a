package fleetguard

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
)

// directHandler is an llmbudget handler on its own memory engine, for tests
// that drive ServeHTTP with a next handler of their own.
func directHandler(t *testing.T) *LLMBudget {
	t.Helper()
	eng, err := newEngine(nil, "direct", time.Second, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Destruct() })
	h := &LLMBudget{Budgets: []BudgetConfig{{Name: "g", Limit: 100000, Window: caddy.Duration(time.Hour)}}}
	if err := h.compile(); err != nil {
		t.Fatal(err)
	}
	h.engine, h.logger = eng, zap.NewNop()
	return h
}

func (h *LLMBudget) usedForTest(t *testing.T) int64 {
	t.Helper()
	h.engine.waitSettles(5 * time.Second)
	used, err := h.engine.budgets.Used(context.Background(), h.budgets, budget.Dims{Model: "gpt-4o"})
	if err != nil {
		t.Fatal(err)
	}
	return used[0]
}

// waitSettles waits for the background settles of every engine in the pool,
// so a test reads counters after the settles of the responses it has.
func waitSettles() {
	engines.Range(func(_, v any) bool {
		v.(*engine).waitSettles(5 * time.Second)
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
	if got, want := h.usedForTest(t), prompt.PromptTokens+2; got != want {
		t.Fatalf("a panic mid-stream: counter %d, want %d (prompt + 8 bytes of output)", got, want)
	}
}

func TestMeteringWriterPassesFlushesThrough(t *testing.T) {
	rec := httptest.NewRecorder()
	mw := newMeteringWriter(rec, usage.OpenAIChat)
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
