package fleetguard

import (
	"fmt"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestDenialNamesTheResetAsATime: a denial says when its window resets as
// a time (RFC 3339, UTC), never as a count of seconds, and says "may fit
// once requests in flight settle" only while a request is in flight.
func TestDenialNamesTheResetAsATime(t *testing.T) {
	// 1000 tokens an hour; chatBody reserves its 200 output tokens plus
	// its prompt, and settles to what the upstream reports.
	h := directHandler(t, func(h *LLMBudget) { h.Budgets[0].Limit = 1000 })
	nextWindow := time.Now().UTC().Truncate(time.Hour).Add(time.Hour).Format(time.RFC3339)
	ok := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		_, err := w.Write([]byte(`{"usage":{"prompt_tokens":400,"completion_tokens":300,"total_tokens":700}}`))
		return err
	})
	held, release := make(chan struct{}), make(chan struct{})
	holding := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		close(held)
		<-release
		return ok(w, r)
	})
	const big = `{"model":"gpt-4o","max_tokens":600,"messages":[{"role":"user","content":"hi"}]}`
	// One request in flight holds about 600 of the 1000; another of the
	// same size does not fit while it is.
	done := make(chan struct{})
	go func() {
		defer close(done)
		serveStream(t, h, "/v1/chat/completions", big, holding)
	}()
	<-held
	denied := serveStream(t, h, "/v1/chat/completions", big, ok)
	msg := decodeError(t, denied.Body.String()).Error.Message
	if denied.Code != http.StatusTooManyRequests || !strings.Contains(msg, "may fit once requests in flight settle") ||
		!strings.Contains(msg, "resets at "+nextWindow) || strings.Contains(msg, "resets in") {
		t.Fatalf("with a request in flight: %d %q; want it to say requests in flight and the reset at %s", denied.Code, msg, nextWindow)
	}
	close(release)
	<-done
	h.engines.waitSettles(5 * time.Second)
	// 700 used, nothing in flight: the request does not fit, and nothing
	// in flight will make room.
	denied = serveStream(t, h, "/v1/chat/completions", big, ok)
	msg = decodeError(t, denied.Body.String()).Error.Message
	if !strings.Contains(msg, "does not fit") || strings.Contains(msg, "in flight") || !strings.Contains(msg, "the window resets at "+nextWindow) {
		t.Fatalf("with nothing in flight: %q; want no word of requests in flight, and the reset at %s", msg, nextWindow)
	}
	// Exhausted: the same.
	small := `{"model":"gpt-4o","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`
	for range 2 {
		serveStream(t, h, "/v1/chat/completions", small, ok)
		h.engines.waitSettles(5 * time.Second)
	}
	denied = serveStream(t, h, "/v1/chat/completions", small, ok)
	msg = decodeError(t, denied.Body.String()).Error.Message
	if !strings.Contains(msg, "is exhausted") || !strings.Contains(msg, "it resets at "+nextWindow) {
		t.Fatalf("exhausted: %q; want the reset at %s", msg, nextWindow)
	}
}

// TestDollarBudgetMetricsReadInDollars: a usd budget's used, limit and
// charged amounts have _usd series in dollars (Prometheus's base unit),
// beside the series in the budget's counting unit that dashboards query.
func TestDollarBudgetMetricsReadInDollars(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	tc := startCaddy(t, llmCaddyfile(port, up.URL, fmt.Sprintf("fleetguard {\n prefix usdmetrics%d\n }", port), `budget m_usd {
			unit usd
			limit 25.00
			window 1h
		}`))
	if resp, body := chat(t, url, chatBody); resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	waitSettles()
	// 30 input tokens at $2.50 and 70 output at $10 per 1M: $0.000775.
	m := scrape(t, tc)
	for series, want := range map[string]float64{
		`fleetguard_llmbudget_used_usd{budget="m_usd",value="global"}`:  0.000775,
		`fleetguard_llmbudget_limit_usd{budget="m_usd",value="global"}`: 25,
		`fleetguard_llmbudget_charged_usd_total{budget="m_usd"}`:        0.000775,
		`fleetguard_llmbudget_used{budget="m_usd",value="global"}`:      775,
		`fleetguard_llmbudget_charged_total{budget="m_usd",unit="usd"}`: 775,
	} {
		if v, ok := metricValue(m, series); !ok || math.Abs(v-want) > 1e-12 {
			t.Errorf("%s = %v (present %v), want %v", series, v, ok, want)
		}
	}
}
