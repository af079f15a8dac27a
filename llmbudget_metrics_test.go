package fleetguard

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// /metrics shows each budget's used and limit for the scope values the
// config names (the global one, limit_for teams and models), with a limit
// set at run time, and counts each denied key once per window; no series
// names a key.
func TestBudgetMetricsShowNamedValuesAndDeniedKeys(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	tc := startCaddy(t, llmCaddyfile(port, up.URL, "", `budget mx_all {
			limit 100000
			window 1h
		}
		budget mx_team {
			scope team
			limit 100000
			limit_for team research 2000
			window 1h
		}
		budget mx_model {
			scope model
			limit 100000
			limit_for model gpt-4o 5000
			window 1h
		}
		budget mx_key {
			scope key
			limit 400
			window 1h
		}`))
	send := func(key, team string) int {
		waitSettles()
		resp, _ := chat(t, url, chatBody, "Authorization: Bearer "+key, "X-Team: "+team)
		return resp.StatusCode
	}
	// sk-mx-a: 100, 200, then 200 + 210 reserved is over 400: denied twice.
	codes := []int{send("sk-mx-a", "research"), send("sk-mx-a", "research"), send("sk-mx-a", "ops"), send("sk-mx-a", "ops"), send("sk-mx-b", "ops")}
	if fmt.Sprint(codes) != "[200 200 429 429 200]" {
		t.Fatalf("statuses %v", codes)
	}
	waitSettles()
	if resp, body := do(t, http.MethodPut, "http://"+tc.admin+"/fleetguard/budgets/mx_team/limit?team=research", `{"limit": 2500}`); resp.StatusCode != http.StatusOK {
		t.Fatalf("PUT: %d %s", resp.StatusCode, body)
	}
	var m string
	eventually(t, 5*time.Second, "keys_denied_total of mx_key at 1", func() bool {
		m = scrape(t, tc)
		v, _ := metricValue(m, `fleetguard_llmbudget_keys_denied_total{budget="mx_key"}`)
		return v == 1
	})
	for series, want := range map[string]float64{
		`fleetguard_llmbudget_used{budget="mx_all",value="global"}`:     300,
		`fleetguard_llmbudget_limit{budget="mx_all",value="global"}`:    100000,
		`fleetguard_llmbudget_used{budget="mx_team",value="research"}`:  200,
		`fleetguard_llmbudget_limit{budget="mx_team",value="research"}`: 2500,
		`fleetguard_llmbudget_used{budget="mx_model",value="gpt-4o"}`:   300,
		`fleetguard_llmbudget_limit{budget="mx_model",value="gpt-4o"}`:  5000,
	} {
		if v, ok := metricValue(m, series); !ok || v != want {
			t.Errorf("%s = %v (present %v), want %v", series, v, ok, want)
		}
	}
	for _, line := range strings.Split(m, "\n") {
		if strings.HasPrefix(line, "fleetguard_llmbudget_used{") && (strings.Contains(line, "mx_key") || strings.Contains(line, `value="ops"`)) {
			t.Errorf("a series for a value the config does not name: %s", line)
		}
		if strings.Contains(line, "sk-mx") {
			t.Errorf("a series carries a key: %s", line)
		}
	}
}
