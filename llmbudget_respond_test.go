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
