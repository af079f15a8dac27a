package fleetguard

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/internal/wait"
)

// alertsCaddyfile is one instance of a two-Caddy fleet whose team and global
// budgets alert at 50%, 80% and 95% of 5000 tokens, logging every level
// (Caddy's events app logs each event at debug) to logPath.
func alertsCaddyfile(adminPort, port int, redisURL, upstream, logPath string) string {
	c := fleetInstance(adminPort, port, redisURL, "alerts", upstream,
		"budget per_team {\n\t\t\tscope team\n\t\t\tlimit 5000\n\t\t\twindow 1h\n\t\t\talert_at 50% 80% 95%\n\t\tunit tokens\n\t\t}",
		"budget all {\n\t\t\tlimit 5000\n\t\t\twindow 1h\n\t\t\talert_at 50% 80% 95%\n\t\tunit tokens\n\t\t}",
	)
	c.Global = append([]string{logTo(logPath)}, c.Global...)
	return c.String()
}

// Two Caddy instances on one Redis, under concurrent load past every
// threshold of two budgets: each threshold of each budget's scope value
// is reported exactly once across the fleet, as an llmbudget_threshold
// event and in threshold_crossings_total, whichever instance settled it.
func TestThresholdEventsOncePerCrossingAcrossTheFleet(t *testing.T) {
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	dir := t.TempDir()
	var urls, admins, logs []string
	for i := range 2 {
		admin, port, logPath := freePort(t), freePort(t), filepath.Join(dir, fmt.Sprint("caddy", i, ".log"))
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		startCaddyProcess(t, alertsCaddyfile(admin, port, srv.URL(), up.URL, logPath), addr)
		urls, admins, logs = append(urls, "http://"+addr), append(admins, fmt.Sprintf("localhost:%d", admin)), append(logs, logPath)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	admitted := 0
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 10 { // 80 requests of 100 tokens: past 5000, some denied
				resp, _ := chat(t, urls[g%2], chatBody, "X-Team: green")
				mu.Lock()
				admitted += map[bool]int{true: 1}[resp.StatusCode == http.StatusOK]
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	// Every settle has run once the counter holds the admitted requests' 100.
	settled := func() {
		want := fmt.Sprint(admitted * 100)
		eventually(t, 10*time.Second, "the settles of "+fmt.Sprint(admitted)+" requests", func() bool {
			return budgetWindowAt(t, http.MethodGet, "http://"+admins[0]+"/fleetguard/budgets/all").Used.String() == want
		})
	}
	settled()
	// Requests in flight hold about 210 each: under load the instances
	// may deny while the counter is short of 95%. One at a time, the rest
	// of the way (a request fits while 4790 or less is used).
	for i := 0; admitted*100 < 4800; i++ {
		if resp, body := chat(t, urls[i%2], chatBody, "X-Team: green"); resp.StatusCode != http.StatusOK {
			t.Fatalf("at %d used: %d %s", admitted*100, resp.StatusCode, body)
		}
		admitted++
		settled()
	}
	events := map[string]int{}
	for _, path := range logs {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if !strings.Contains(line, `"name":"llmbudget_threshold"`) {
				continue
			}
			var e struct {
				Data struct {
					Budget      string
					ScopeHash   string `json:"scope_hash"`
					Threshold   int
					Used, Limit int64
				}
			}
			if err := json.Unmarshal([]byte(line), &e); err != nil {
				t.Fatalf("%v: %s", err, line)
			}
			if e.Data.Limit != 5000 || e.Data.Used*100 < int64(e.Data.Threshold)*5000 {
				t.Fatalf("an event below its threshold: %s", line)
			}
			events[fmt.Sprint(e.Data.Budget, " ", e.Data.ScopeHash, " ", e.Data.Threshold)]++
		}
	}
	expected := map[string]int{}
	for _, pct := range []int{50, 80, 95} {
		expected[fmt.Sprint("per_team ", keyhash.Of("green").String(), " ", pct)] = 1
		expected[fmt.Sprint("all  ", pct)] = 1
	}
	if fmt.Sprint(events) != fmt.Sprint(expected) {
		t.Fatalf("llmbudget_threshold events %v, want each threshold once:\n%v", events, expected)
	}
	for _, budget := range []string{"per_team", "all"} {
		for _, pct := range []string{"50", "80", "95"} {
			var sum float64
			for _, admin := range admins {
				resp, body := get(t, "http://"+admin+"/metrics")
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("GET /metrics: %d", resp.StatusCode)
				}
				v, _ := metricValue(body, `fleetguard_llmbudget_threshold_crossings_total{budget="`+budget+`",threshold="`+pct+`"}`)
				sum += v
			}
			if sum != 1 {
				t.Fatalf("threshold_crossings_total{budget=%s,threshold=%s} sums to %v over the fleet, want 1", budget, pct, sum)
			}
		}
	}
}

// TestThresholdAlertNamesItsScopeInItsUnit: an llmbudget_threshold event
// and its log line name the budget, the team by name (a limit_for team's
// and one the request named), never a key's value, and carry the amounts
// in the budget's unit, a dollar budget's in dollars; a threshold below the
// limit logs at info, the limit itself at warn.
func TestThresholdAlertNamesItsScopeInItsUnit(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	logPath := filepath.Join(t.TempDir(), "caddy.log")
	startCaddy(t, llmCaddyfile(port, up.URL, logTo(logPath), `budget team_usd {
			scope team
			unit usd
			limit 0.01
			limit_for team research 0.02
			alert_at 10%
			window 1h
		}
		budget per_key {
			scope key
			unit tokens
			limit 10000
			alert_at 1%
			window 1h
		}
		budget all {
			unit tokens
			limit 500
			alert_at 100%
			window 1h
		}`))
	// Each request reserves its prompt and 70 output tokens and settles
	// to 100 tokens, $0.000775.
	const body = `{"model":"gpt-4o","max_tokens":70,"messages":[{"role":"user","content":"hi"}]}`
	for _, team := range []string{"research", "green", "research", "green", "research"} {
		waitSettles()
		if resp, b := chat(t, url, body, "Authorization: Bearer sk-alert-key", "X-Team: "+team); resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	waitSettles()
	type line struct {
		Level, Msg, Name string
		Budget, Value    string
		ScopeHash        string  `json:"scope_hash"`
		UsedUSD          float64 `json:"used_usd"`
		Data             map[string]any
	}
	var events, logs []line
	ok := wait.Poll(5*time.Second, func() bool {
		b, _ := os.ReadFile(logPath)
		events, logs = nil, nil
		for _, s := range strings.Split(string(b), "\n") {
			var l line
			if json.Unmarshal([]byte(s), &l) != nil {
				continue
			}
			switch {
			case l.Name == "llmbudget_threshold":
				events = append(events, l)
			case l.Msg == "budget threshold reached":
				logs = append(logs, l)
			}
		}
		return len(events) == 4 && len(logs) == 4
	})
	if !ok {
		b, _ := os.ReadFile(logPath)
		t.Logf("log: %s", b)
	}
	got := map[string]string{}
	for _, e := range events {
		got[fmt.Sprint(e.Data["budget"], " ", e.Data["value"])] = fmt.Sprintf("value=%v used=%v limit=%v unit=%v threshold=%v hash=%v",
			e.Data["value"], e.Data["used"], e.Data["limit"], e.Data["unit"], e.Data["threshold"], e.Data["scope_hash"] != nil)
	}
	want := map[string]string{
		// research's limit is $0.02: 10% is reached at the third request.
		"team_usd research": "value=research used=0.002325 limit=0.02 unit=usd threshold=10 hash=true",
		// green, which no limit_for names, by the name the request gave.
		"team_usd green": "value=green used=0.00155 limit=0.01 unit=usd threshold=10 hash=true",
		"per_key <nil>":  "value=<nil> used=100 limit=10000 unit=tokens threshold=1 hash=true",
		"all <nil>":      "value=<nil> used=500 limit=500 unit=tokens threshold=100 hash=false",
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("threshold events:\n%v\nwant\n%v", got, want)
	}
	levels := map[string]string{}
	for _, l := range logs {
		levels[l.Budget+" "+l.Value] = l.Level
		if l.Budget == "team_usd" && l.Value == "research" && l.UsedUSD != 0.002325 {
			t.Errorf("the dollar budget's log line: used_usd %v, want 0.002325", l.UsedUSD)
		}
	}
	if fmt.Sprint(levels) != fmt.Sprint(map[string]string{"team_usd research": "info", "team_usd green": "info", "per_key ": "info", "all ": "warn"}) {
		t.Errorf("log lines by budget: %v; want info below the limit, warn at it, the team by name", levels)
	}
	if b, _ := os.ReadFile(logPath); strings.Contains(string(b), "sk-alert-key") {
		t.Errorf("the log holds the key")
	}
}
