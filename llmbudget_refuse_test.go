package fleetguard

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/fleetguard/fleetguard/budget"
)

func TestFormatAmountInTheBudgetsUnit(t *testing.T) {
	for _, tt := range []struct {
		unit budget.Unit
		n    int64
		want string
	}{
		{budget.Tokens, 39880, "39880 tokens"},
		{budget.USD, 25_000_000, "$25.00"},
		{budget.USD, 25_204_725, "$25.204725"},
		{budget.USD, 10_013, "$0.010013"},
		{budget.USD, 500_000, "$0.50"},
		{budget.USD, 1, "$0.000001"},
		{budget.USD, 0, "$0.00"},
		{budget.USD, -1_500_000, "-$1.50"},
	} {
		if got := formatAmount(tt.unit, tt.n); got != tt.want {
			t.Errorf("formatAmount(%v, %d) = %q, want %q", tt.unit, tt.n, got, tt.want)
		}
	}
}

// In shadow mode, a model without a price under a dollar budget is a refusal
// that is not enforced: counted shadow_rejected, never as a budget's denial,
// and forwarded.
func TestShadowCountsAnUnpricedModelAsShadowRejected(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, llmCaddyfile(port, up.URL, "", `shadow
		budget shadow_usd {
			unit usd
			limit 10
			window 1h
		}`))
	shadowRejected := testutil.ToFloat64(metrics.llmRequests.WithLabelValues("", "shadow_rejected"))
	deniedUSD := testutil.ToFloat64(metrics.llmRequests.WithLabelValues("shadow_usd", "denied"))
	hits := up.Hits()
	resp, body := chat(t, url, `{"model":"mystery-1","max_tokens":5,"messages":[]}`)
	if resp.StatusCode != http.StatusOK || up.Hits() != hits+1 {
		t.Fatalf("shadow with an unpriced model: %d %s (upstream hits +%d), want it forwarded", resp.StatusCode, body, up.Hits()-hits)
	}
	if got := testutil.ToFloat64(metrics.llmRequests.WithLabelValues("", "shadow_rejected")) - shadowRejected; got != 1 {
		t.Errorf("requests_total{decision=\"shadow_rejected\"} moved by %v, want 1", got)
	}
	if got := testutil.ToFloat64(metrics.llmRequests.WithLabelValues("shadow_usd", "denied")) - deniedUSD; got != 0 {
		t.Errorf("requests_total{budget=\"shadow_usd\",decision=\"denied\"} moved by %v in shadow mode, want 0", got)
	}
}

// A body that cannot be read (a malformed chunked encoding) is refused like
// any bad body: 400 in the API's shape, counted rejected; in shadow mode it
// is counted shadow_rejected and not answered by llmbudget.
func TestUnreadableBodyGoesThroughTheRefusal(t *testing.T) {
	for _, shadow := range []bool{false, true} {
		t.Run(fmt.Sprintf("shadow=%v", shadow), func(t *testing.T) {
			up := newFakeLLM(t)
			port := freePort(t)
			extra := ""
			if shadow {
				extra = "shadow\n\t\t"
			}
			startCaddy(t, llmCaddyfile(port, up.URL, "", extra+oneBudget))
			label := "rejected"
			if shadow {
				label = "shadow_rejected"
			}
			before := testutil.ToFloat64(metrics.llmRequests.WithLabelValues("", label))
			conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			io.WriteString(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\nzz\r\n")
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if got := testutil.ToFloat64(metrics.llmRequests.WithLabelValues("", label)) - before; got != 1 {
				t.Errorf("requests_total{decision=%q} moved by %v, want 1", label, got)
			}
			isRefusal := resp.StatusCode == http.StatusBadRequest && strings.Contains(string(b), `"code":"unreadable_body"`)
			if isRefusal == shadow {
				t.Errorf("answer %d %s: want llmbudget's 400 unreadable_body %v", resp.StatusCode, b, !shadow)
			}
		})
	}
}

// A client's RateLimit items name only the budgets of its own scopes by
// default: team green's responses carry no item of the global budget, whose
// room moves with every tenant's traffic, and their team item counts green's
// spending only, however much team blue spends. ratelimit_scopes adds the
// global and model items back.
func TestRateLimitItemsNameOnlyTheClientsOwnBudgets(t *testing.T) {
	budgets := `budget all {
			limit 100000
			window 1h
			unit tokens
		}
		budget per_model {
			scope model
			limit 100000
			window 1h
			unit tokens
		}
		budget per_team {
			scope team
			limit 5000
			window 1h
			unit tokens
		}
		budget per_key {
			scope key
			limit 3000
			window 1h
			unit tokens
		}`
	for _, tt := range []struct {
		name, option string
		want         []string // the items of green's response, in order
	}{
		{"default", "", []string{"per_team", "per_key"}},
		{"with global and model", "ratelimit_scopes global model team key", []string{"all", "per_model", "per_team", "per_key"}},
		{"none", "ratelimit_scopes none", nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			up := newFakeLLM(t)
			port := freePort(t)
			url := fmt.Sprintf("http://127.0.0.1:%d", port)
			startCaddy(t, llmCaddyfile(port, up.URL, "", budgets+"\n\t\t"+tt.option))
			for range 3 {
				if resp, body := chat(t, url, chatBody, "Authorization: Bearer sk-blue", "X-Team: blue"); resp.StatusCode != http.StatusOK {
					t.Fatalf("team blue: %d %s", resp.StatusCode, body)
				}
			}
			waitSettles() // blue has spent 300 of every budget it shares with green
			resp, body := chat(t, url, chatBody, "Authorization: Bearer sk-green", "X-Team: green")
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("team green: %d %s", resp.StatusCode, body)
			}
			if tt.want == nil {
				if _, ok := resp.Header["Ratelimit"]; ok || resp.Header.Get("RateLimit-Policy") != "" {
					t.Fatalf("RateLimit %q, RateLimit-Policy %q; want neither", resp.Header.Get("RateLimit"), resp.Header.Get("RateLimit-Policy"))
				}
				return
			}
			items := parseSFList(t, resp.Header.Get("RateLimit"))
			policy := parseSFList(t, resp.Header.Get("RateLimit-Policy"))
			if len(items) != len(tt.want) || len(policy) != len(tt.want) {
				t.Fatalf("RateLimit %q, RateLimit-Policy %q; want the items %v", resp.Header.Get("RateLimit"), resp.Header.Get("RateLimit-Policy"), tt.want)
			}
			for i, name := range tt.want {
				if items[i].name != name || policy[i].name != name {
					t.Fatalf("item %d: %q / %q, want %q", i, items[i].name, policy[i].name, name)
				}
			}
			// Green's own items count green's reservation only; the global
			// item, where shown, counts blue's 300 tokens too (the spending
			// the default keeps from green).
			held := 5000 - itemR(t, items, "per_team")
			if other := 3000 - itemR(t, items, "per_key"); other != held {
				t.Fatalf("per_team holds %d of green's, per_key %d: a team item counts another tenant", held, other)
			}
			if indexOf(items, "all") >= 0 && 100000-itemR(t, items, "all") != held+300 {
				t.Fatalf("the global item shows %d used, want blue's 300 and green's %d", 100000-itemR(t, items, "all"), held)
			}
		})
	}
}

// itemR is the r of the item named name.
func itemR(t *testing.T, items []sfItem, name string) int64 {
	t.Helper()
	i := indexOf(items, name)
	if i < 0 {
		t.Fatalf("no item %q in %v", name, items)
	}
	return mustInt(t, items[i].params["r"])
}

func indexOf(items []sfItem, name string) int {
	for i, it := range items {
		if it.name == name {
			return i
		}
	}
	return -1
}
