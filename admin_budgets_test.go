package fleetguard

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// adminBudgets are the budgets of the admin tests: per key 1000 tokens (the
// upstream reports 100 per request, a reservation needs about 210), a dollar
// budget per team and a global one. The store timeout is generous: a first
// reserve that dials Redis on a loaded machine is not what these test.
const adminBudgets = `store_timeout 2s
		budget per_key {
			scope key
			unit tokens
			limit 1000
			window 1h
		}
		budget team_usd {
			scope team
			unit usd
			limit 1.5
			window 1h
		}
		budget all {
			limit 100000000
			window 24h
			unit tokens
		}`

// logTo is a global `log` option writing every level, as JSON, to a file.
func logTo(path string) string {
	return fmt.Sprintf("log {\n output file %s\n format json\n level DEBUG\n }", path)
}

// budgetWindowAt asks a budget endpoint and decodes its answer, keeping
// numbers as written.
func budgetWindowAt(t *testing.T, method, url string) budgetWindow {
	t.Helper()
	resp, body := do(t, method, url, "")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s %s: %d %s", method, url, resp.StatusCode, body)
	}
	var bw budgetWindow
	dec := json.NewDecoder(strings.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&bw); err != nil {
		t.Fatalf("%s: %v", body, err)
	}
	return bw
}

// storeWithPrefix is the store in the pool whose identity has prefix.
func storeWithPrefix(t *testing.T, prefix string) *engines {
	t.Helper()
	var found *engines
	enginePool.Range(func(_, v any) bool {
		if e := v.(*engines); e.identity.name.prefix == prefix {
			found = e
		}
		return found == nil
	})
	if found == nil {
		t.Fatalf("no store with prefix %q in the pool", prefix)
	}
	return found
}

// storeCounter reads a budget's counter for dims from the store, past the
// admin API, once the settles so far have run.
func storeCounter(t *testing.T, prefix string, b budget.Budget, dims budget.Dims) int64 {
	t.Helper()
	waitSettles()
	used, err := storeWithPrefix(t, prefix).budgets.Used(context.Background(), []budget.Budget{b}, dims)
	if err != nil {
		t.Fatal(err)
	}
	return used[0]
}

// The budget endpoints on the memory store and on Redis: used is the
// counter, remaining the rest of the limit, a reset zeroes the window and
// admits what was denied, and the raw key reaches no log of fleetguard.
func TestAdminBudgetWindowAndReset(t *testing.T) {
	enginePool := []struct {
		name    string
		engines func(t *testing.T) (global string, counter func(prefix, budgetName string) int64)
	}{
		{"memory", func(*testing.T) (string, func(string, string) int64) { return "", nil }},
		{"redis", func(t *testing.T) (string, func(string, string) int64) {
			srv := redistest.Start(t)
			rc := redis.NewClient(&redis.Options{Addr: srv.Addr()})
			t.Cleanup(func() { rc.Close() })
			return "fleetguard {\n redis " + srv.URL() + "\n prefix adminbudget\n }",
				func(prefix, name string) int64 { return budgetCounter(t, rc, prefix, name) }
		}},
	}
	for _, sc := range enginePool {
		t.Run(sc.name, func(t *testing.T) {
			global, redisCounter := sc.engines(t)
			prefix := "fleetguard"
			if redisCounter != nil {
				prefix = "adminbudget"
			}
			logFile := filepath.Join(t.TempDir(), "caddy.log")
			up := newFakeLLM(t)
			port := freePort(t)
			llm := fmt.Sprintf("http://127.0.0.1:%d", port)
			tc := startCaddy(t, llmCaddyfile(port, up.URL, global+"\n"+logTo(logFile), adminBudgets))
			admin := "http://" + tc.admin + budgetsPath

			// alice is only ever named to the admin API by her key's hash;
			// bob by his raw key.
			const aliceKey, bobKey = "Bearer sk-admin-alice-3141", "Bearer sk-admin-bob-2718"
			aliceHash := keyhash.Of(aliceKey).String()
			perKey := storeWithPrefix(t, prefix).budgetDefsFor(t, "per_key")
			for i := 1; i <= 8; i++ {
				waitSettles()
				for _, key := range []string{aliceKey, bobKey} {
					if resp, body := chat(t, llm, chatBody, "Authorization: "+key, "X-Team: red"); resp.StatusCode != http.StatusOK {
						t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
					}
				}
			}
			waitSettles()
			for _, key := range []string{aliceKey, bobKey} {
				if resp, body := chat(t, llm, chatBody, "Authorization: "+key, "X-Team: red"); resp.StatusCode != http.StatusTooManyRequests {
					t.Fatalf("9th request: %d %s, want 429", resp.StatusCode, body)
				}
			}

			bob := budgetWindowAt(t, http.MethodGet, admin+"per_key?key="+url.QueryEscape(bobKey))
			counter := storeCounter(t, prefix, perKey, budget.Dims{Principal: bobKey})
			if counter != 800 || bob.Used != "800" || bob.Limit != "1000" || bob.Remaining != "200" ||
				bob.Budget != "per_key" || bob.Scope != "key" || bob.Unit != "tokens" {
				t.Fatalf("bob's window %+v; the store counts %d, want 800 used of 1000", bob, counter)
			}
			if now := time.Now(); bob.WindowEnd.Sub(bob.WindowStart) != time.Hour || now.Before(bob.WindowStart) || !now.Before(bob.WindowEnd) {
				t.Fatalf("window [%v, %v) is not the current hour", bob.WindowStart, bob.WindowEnd)
			}
			// The answer names bob's key by the hash key_hash= takes, and
			// that hash names the same window again.
			if bob.ScopeHash != keyhash.Of(bobKey).String() {
				t.Fatalf("bob's scope_hash %q, want keyhash.Of(his key) %s", bob.ScopeHash, keyhash.Of(bobKey))
			}
			if again := budgetWindowAt(t, http.MethodGet, admin+"per_key?key_hash="+bob.ScopeHash); again != bob {
				t.Fatalf("bob by the scope_hash of the answer: %+v, want %+v", again, bob)
			}
			alice := budgetWindowAt(t, http.MethodGet, admin+"per_key?key_hash="+aliceHash)
			if alice.Used != "800" || alice.Remaining != "200" || alice.ScopeHash != aliceHash {
				t.Fatalf("alice by hash: %+v, want 800 used under her hash", alice)
			}
			if redisCounter != nil {
				// Both principals' counters, read from Redis itself.
				if got := redisCounter(prefix, "per_key"); got != 1600 {
					t.Fatalf("Redis holds %d for per_key, want 1600", got)
				}
			}
			// Dollars as a decimal number: 16 requests at 775 micro-dollars.
			team := budgetWindowAt(t, http.MethodGet, admin+"team_usd?team=red")
			if team.Used != "0.0124" || team.Limit != "1.5" || team.Remaining != "1.4876" || team.Unit != "usd" {
				t.Fatalf("team window %+v, want 0.0124 of 1.5 USD", team)
			}
			if team.ScopeHash != keyhash.Of("red").String() {
				t.Fatalf("team scope_hash %q, want keyhash.Of(\"red\") %s", team.ScopeHash, keyhash.Of("red"))
			}
			if again := budgetWindowAt(t, http.MethodGet, admin+"team_usd?team_hash="+team.ScopeHash); again != team {
				t.Fatalf("team by the scope_hash of the answer: %+v, want %+v", again, team)
			}
			if all := budgetWindowAt(t, http.MethodGet, admin+"all"); all.Used != "1600" || all.Scope != "global" || all.ScopeHash != "" {
				t.Fatalf("global window %+v, want 1600 used and no scope hash", all)
			}

			// Reset alice's window: bob's stays, and alice is admitted again.
			if reset := budgetWindowAt(t, http.MethodPost, admin+"per_key/reset?key_hash="+aliceHash); reset.Used != "0" || reset.Remaining != "1000" || reset.WindowStart != alice.WindowStart || reset.ScopeHash != aliceHash {
				t.Fatalf("reset answer %+v", reset)
			}
			if got := storeCounter(t, prefix, perKey, budget.Dims{Principal: aliceKey}); got != 0 {
				t.Fatalf("alice's counter after the reset: %d", got)
			}
			if bob := budgetWindowAt(t, http.MethodGet, admin+"per_key?key="+url.QueryEscape(bobKey)); bob.Used != "800" {
				t.Fatalf("bob's window after alice's reset: %+v", bob)
			}
			if resp, body := chat(t, llm, chatBody, "Authorization: "+aliceKey, "X-Team: red"); resp.StatusCode != http.StatusOK {
				t.Fatalf("alice after the reset: %d %s, want 200", resp.StatusCode, body)
			}
			waitSettles()
			if alice := budgetWindowAt(t, http.MethodGet, admin+"per_key?key_hash="+aliceHash); alice.Used != "100" {
				t.Fatalf("alice after one request past the reset: %+v, want 100", alice)
			}
			// Bob, reset by his raw key: the answer names him by hash.
			if reset := budgetWindowAt(t, http.MethodPost, admin+"per_key/reset?key="+url.QueryEscape(bobKey)); reset.ScopeHash != bob.ScopeHash {
				t.Fatalf("bob's reset answer %+v, want scope_hash %s", reset, bob.ScopeHash)
			}
			if resp, body := chat(t, llm, chatBody, "Authorization: "+bobKey, "X-Team: red"); resp.StatusCode != http.StatusOK {
				t.Fatalf("bob after the reset: %d %s, want 200", resp.StatusCode, body)
			}

			// What the admin API refuses, and why.
			refusals := []struct {
				method, path string
				status       int
				reason       string
			}{
				{http.MethodGet, "nope?key=x", http.StatusNotFound, `defines budget \"nope\"`},
				{http.MethodPost, "nope/reset?key=x", http.StatusNotFound, `defines budget \"nope\"`},
				{http.MethodGet, "per_key", http.StatusBadRequest, "the key query parameter is required"},
				{http.MethodPost, "per_key/reset", http.StatusBadRequest, "the key query parameter is required"},
				{http.MethodGet, "team_usd?key=x", http.StatusBadRequest, "not key"},
				{http.MethodGet, "all?team=red", http.StatusBadRequest, "is global"},
				{http.MethodGet, "per_key?key=a&key=b", http.StatusBadRequest, "once"},
				{http.MethodGet, "per_key?key=a&key_hash=" + aliceHash, http.StatusBadRequest, "not both"},
				{http.MethodGet, "per_key?key_hash=" + url.QueryEscape(bobKey), http.StatusBadRequest, "32 lowercase hex"},
				{http.MethodPost, "per_key?key=x", http.StatusMethodNotAllowed, "use GET"},
				{http.MethodDelete, "per_key?key=x", http.StatusMethodNotAllowed, "use GET"},
				{http.MethodGet, "per_key/reset?key=x", http.StatusMethodNotAllowed, "use POST"},
			}
			for _, rf := range refusals {
				resp, body := do(t, rf.method, admin+rf.path, "")
				if resp.StatusCode != rf.status || !strings.Contains(body, rf.reason) {
					t.Errorf("%s %s: %d %s, want %d naming %q", rf.method, rf.path, resp.StatusCode, body, rf.status, rf.reason)
				}
				if allow := resp.Header.Get("Allow"); rf.status == http.StatusMethodNotAllowed && (allow == "" || !strings.Contains(rf.reason, allow)) {
					t.Errorf("%s %s: Allow %q, want the method named in %q", rf.method, rf.path, allow, rf.reason)
				}
				if strings.Contains(body, "sk-admin") {
					t.Errorf("%s %s: the answer %s echoes a key", rf.method, rf.path, body)
				}
			}

			// The log: each reset is one line naming the budget and the
			// scope hash. Alice's key, never sent to the admin API, is in no
			// line; bob's, sent in a query, only in Caddy's own admin request
			// log (which logs every URI), never in a line of fleetguard.
			if err := caddy.Stop(); err != nil { // the log file is complete
				t.Fatal(err)
			}
			resets := 0
			for _, line := range logLines(t, logFile) {
				var entry struct {
					Logger, Msg, Budget, Scope string
					ScopeHash                  string `json:"scope_hash"`
				}
				_ = json.Unmarshal([]byte(line), &entry)
				if strings.Contains(line, "sk-admin-alice") {
					t.Errorf("alice's raw key is in the log: %s", line)
				}
				if strings.Contains(line, "sk-admin-bob") && !(entry.Logger == "admin.api" && entry.Msg == "received request") {
					t.Errorf("bob's raw key is in a log line other than Caddy's request log: %s", line)
				}
				if entry.Msg == "budget window reset" {
					resets++
					if entry.Logger != "admin.api.fleetguard" || entry.Budget != "per_key" || entry.Scope != "key" ||
						(entry.ScopeHash != aliceHash && entry.ScopeHash != keyhash.Of(bobKey).String()) {
						t.Errorf("reset log line %s", line)
					}
				}
			}
			if resets != 2 {
				t.Fatalf("%d reset log lines, want 2", resets)
			}
		})
	}
}

// budgetDefsFor is the running definition of a budget, as the admin API
// finds it.
func (e *engines) budgetDefsFor(t *testing.T, name string) budget.Budget {
	t.Helper()
	eng, b, err := lookupBudget(name)
	if err != nil || eng != e {
		t.Fatalf("budget %q: %v (store %p, want %p)", name, err, eng, e)
	}
	return b
}

func logLines(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if len(lines) == 0 {
		t.Fatalf("%s is empty", path)
	}
	return lines
}

// budgetListAt asks for the budget list, at a path that must answer without
// a redirect, and decodes it, keeping numbers as written.
func budgetListAt(t *testing.T, url string) []listedBudget {
	t.Helper()
	resp, body := get(t, url)
	if resp.StatusCode != http.StatusOK || resp.Request.URL.String() != url {
		t.Fatalf("GET %s: %d %s (answered at %s)", url, resp.StatusCode, body, resp.Request.URL)
	}
	var list struct{ Budgets []listedBudget }
	dec := json.NewDecoder(strings.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&list); err != nil {
		t.Fatalf("%s: %v", body, err)
	}
	return list.Budgets
}

// The budget list: every budget of the running config, by name, in its own
// unit, on its store, at /fleetguard/budgets with or without the slash; a
// reload that moves the budgets to Redis, adds one and drops one shows in
// the list.
func TestAdminBudgetList(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	tc := startCaddy(t, llmCaddyfile(port, up.URL, "", adminBudgets))
	list := "http://" + tc.admin + budgetListPath
	want := []listedBudget{
		{Name: "all", Scope: "global", Unit: "tokens", Limit: "100000000", Window: "24h0m0s", Store: "memory|fleetguard"},
		{Name: "per_key", Scope: "key", Unit: "tokens", Limit: "1000", Window: "1h0m0s", Store: "memory|fleetguard"},
		{Name: "team_usd", Scope: "team", Unit: "usd", Limit: "1.5", Window: "1h0m0s", Store: "memory|fleetguard"},
	}
	for _, url := range []string{list, list + "/"} {
		if got := budgetListAt(t, url); !slices.Equal(got, want) {
			t.Fatalf("GET %s:\n got %+v\nwant %+v", url, got, want)
		}
	}

	refusals := []struct {
		method, url string
		status      int
		reason      string
	}{
		{http.MethodPost, list, http.StatusMethodNotAllowed, "use GET"},
		{http.MethodDelete, list + "/", http.StatusMethodNotAllowed, "use GET"},
		{http.MethodGet, list + "?key_hash=" + keyhash.Of("x").String(), http.StatusBadRequest, "takes no query parameter (got key_hash)"},
		{http.MethodGet, list + "/?team=red&key=x", http.StatusBadRequest, "(got key, team)"},
	}
	for _, rf := range refusals {
		resp, body := do(t, rf.method, rf.url, "")
		if resp.StatusCode != rf.status || !strings.Contains(body, rf.reason) {
			t.Errorf("%s %s: %d %s, want %d naming %q", rf.method, rf.url, resp.StatusCode, body, rf.status, rf.reason)
		}
		if allow := resp.Header.Get("Allow"); rf.status == http.StatusMethodNotAllowed && allow != http.MethodGet {
			t.Errorf("%s %s: Allow %q, want GET", rf.method, rf.url, allow)
		}
	}

	// A reload onto Redis that drops team_usd, raises per_key and adds a
	// dollar budget per model.
	srv := redistest.Start(t)
	onRedis := "fleetguard {\n redis " + srv.URL() + "\n prefix adminlist\n }"
	budgets := `budget per_key {
			scope key
			limit 2000
			window 1h
			unit tokens
		}
		budget model_usd {
			scope model
			unit usd
			limit 0.25
			window 30m
		}
		budget all {
			limit 100000000
			window 24h
			unit tokens
		}`
	if code, body := tc.load("application/json", string(tc.adapt(llmCaddyfile(port, up.URL, onRedis, budgets)))); code != http.StatusOK {
		t.Fatalf("reload: %d %s", code, body)
	}
	redisStore := "redis|" + srv.Addr() + "|0|adminlist|plain"
	want = []listedBudget{
		{Name: "all", Scope: "global", Unit: "tokens", Limit: "100000000", Window: "24h0m0s", Store: redisStore},
		{Name: "model_usd", Scope: "model", Unit: "usd", Limit: "0.25", Window: "30m0s", Store: redisStore},
		{Name: "per_key", Scope: "key", Unit: "tokens", Limit: "2000", Window: "1h0m0s", Store: redisStore},
	}
	if got := budgetListAt(t, list); !slices.Equal(got, want) {
		t.Fatalf("after the reload:\n got %+v\nwant %+v", got, want)
	}
}

// limitsFleetCaddyfile is one instance of a two-Caddy fleet on one Redis: a
// team budget of 1000 tokens with research's own 2000 and blue's 100000 in
// the config, and a key budget of 1200.
func limitsFleetCaddyfile(adminPort, port int, redisURL, upstream string) string {
	return fleetInstance(adminPort, port, redisURL, "limits", upstream,
		"budget per_team {\n\t\t\tscope team\n\t\t\tlimit 1000\n\t\t\tlimit_for team research 2000\n\t\t\tlimit_for team blue 100000\n\t\t\twindow 1h\n\t\tunit tokens\n\t\t}",
		"budget per_key {\n\t\t\tscope key\n\t\t\tlimit 1200\n\t\t\twindow 1h\n\t\tunit tokens\n\t\t}",
	).String()
}

// fleetInstance is one Caddy process of a fleet on the Redis at redisURL
// (under prefix), its admin endpoint on adminPort: llmbudget with budgets,
// teams from X-Team, a 2 s store timeout (a loaded machine is no outage) and
// settles not waited for, in front of upstream.
func fleetInstance(adminPort, port int, redisURL, prefix, upstream string, budgets ...string) testCaddyfile {
	return testCaddyfile{Admin: fmt.Sprintf("localhost:%d", adminPort), Port: port, Upstream: upstream,
		Global:    []string{"fleetguard {\n\t\tredis " + redisURL + "\n\t\tprefix " + prefix + "\n\t}"},
		LLMBudget: append([]string{"team {http.request.header.X-Team}", "store_timeout 2s", "settle_wait 0"}, budgets...),
	}
}

// A limit set through one instance's admin API applies on the other at its
// next request, for team, key and a team with a limit_for; a DELETE
// restores the configured limit; GET says which limit holds and where it
// comes from. Two Caddy processes share one Redis.
func TestAdminLimitSetOnOneInstanceAppliesOnTheOther(t *testing.T) {
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	adminA, adminB, portA, portB := freePort(t), freePort(t), freePort(t), freePort(t)
	startCaddyProcess(t, limitsFleetCaddyfile(adminA, portA, srv.URL(), up.URL), fmt.Sprintf("127.0.0.1:%d", portA))
	startCaddyProcess(t, limitsFleetCaddyfile(adminB, portB, srv.URL(), up.URL), fmt.Sprintf("127.0.0.1:%d", portB))
	onA := fmt.Sprintf("http://localhost:%d/fleetguard/budgets/", adminA)
	onB := fmt.Sprintf("http://localhost:%d/fleetguard/budgets/", adminB)
	// A request of about 1100 tokens (1050 of output) is over a team's
	// 1000 and within a key's 1200; one of 1300 over a key's 1200.
	ask := func(key, team string) *http.Response {
		out := map[bool]int{true: 1300, false: 1050}[team == "blue"]
		body := fmt.Sprintf(`{"model":"gpt-4o","max_tokens":%d,"messages":[{"role":"user","content":"hi"}]}`, out)
		resp, _ := chat(t, fmt.Sprintf("http://127.0.0.1:%d", portB), body, "Authorization: Bearer "+key, "X-Team: "+team)
		return resp
	}
	keyHash := keyhash.Of("Bearer sk-alice").String()
	for _, tt := range []struct {
		name, budget, query string
		key, team           string
		configured          string // the limit GET shows after the DELETE
		source              string // and where it comes from
	}{
		{"team", "per_team", "team=green", "sk-carol", "green", "1000", "budget"},
		{"key", "per_key", "key_hash=" + keyHash, "sk-alice", "blue", "1200", "budget"},
		{"team with limit_for", "per_team", "team=research", "sk-dave", "research", "2000", "config"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.source == "budget" {
				if resp := ask(tt.key, tt.team); resp.StatusCode != http.StatusTooManyRequests {
					t.Fatalf("before the PUT: %d, want 429 (1500 tokens over the limit 1000)", resp.StatusCode)
				}
			}
			resp, body := do(t, http.MethodPut, onA+tt.budget+"/limit?"+tt.query, `{"limit": 300}`)
			if resp.StatusCode != http.StatusOK || !strings.Contains(body, `"limit":300,"limit_source":"admin"`) {
				t.Fatalf("PUT on A: %d %s", resp.StatusCode, body)
			}
			if resp := ask(tt.key, tt.team); resp.StatusCode != http.StatusTooManyRequests {
				t.Fatalf("on B after a PUT of 300 on A: %d, want 429", resp.StatusCode)
			}
			do(t, http.MethodPut, onA+tt.budget+"/limit?"+tt.query, `{"limit": 3000}`)
			resp = ask(tt.key, tt.team)
			if resp.StatusCode != http.StatusOK || !strings.Contains(resp.Header.Get("RateLimit-Policy"), `"`+tt.budget+`";q=3000;`) {
				t.Fatalf("on B after a PUT of 3000 on A: %d, RateLimit-Policy %q; want 200 under q=3000", resp.StatusCode, resp.Header.Get("RateLimit-Policy"))
			}
			if bw := budgetWindowAt(t, http.MethodGet, onB+tt.budget+"?"+tt.query); bw.Limit != "3000" || bw.LimitSource != "admin" {
				t.Fatalf("GET on B: limit %s from %q, want 3000 from admin", bw.Limit, bw.LimitSource)
			}
			// B settles after its answer: the next request must find 100 used.
			eventually(t, 10*time.Second, "the settle of B's request", func() bool {
				return budgetWindowAt(t, http.MethodGet, onB+tt.budget+"?"+tt.query).Used == "100"
			})
			if bw := budgetWindowAt(t, http.MethodDelete, onA+tt.budget+"/limit?"+tt.query); bw.Limit.String() != tt.configured || bw.LimitSource != tt.source {
				t.Fatalf("DELETE on A: limit %s from %q, want %s from %s", bw.Limit, bw.LimitSource, tt.configured, tt.source)
			}
			resp = ask(tt.key+"-next", tt.team) // the same team, 100 of it spent
			if tt.name == "key" {
				resp = ask(tt.key, tt.team) // the same key, 100 of it spent
			}
			if want := map[string]int{"budget": http.StatusTooManyRequests, "config": http.StatusOK}[tt.source]; resp.StatusCode != want {
				t.Fatalf("on B after the DELETE: %d, want %d under the configured %s", resp.StatusCode, want, tt.configured)
			}
		})
	}
	resp, body := do(t, http.MethodPut, onA+"per_team/limit?team=green", `{"limit": -5}`)
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "must be") {
		t.Fatalf("a PUT of -5: %d %s, want 400", resp.StatusCode, body)
	}
	resp, body = do(t, http.MethodPut, onA+"per_team/limit?team=green", `{"limit": 5, "window": "1h"}`)
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "unknown field") {
		t.Fatalf("a PUT with an unknown field: %d %s, want 400", resp.StatusCode, body)
	}
	if resp, _ := do(t, http.MethodPost, onA+"per_team/limit?team=green", `{"limit": 5}`); resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != "PUT, DELETE" {
		t.Fatalf("a POST of a limit: %d Allow %q, want 405 with PUT, DELETE", resp.StatusCode, resp.Header.Get("Allow"))
	}
}

// GET .../top lists the scope values that spent most in the window, largest
// first, with the raw value of those the config names; n bounds it.
func TestAdminTopListsTheLargestSpenders(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	tc := startCaddy(t, llmCaddyfile(port, up.URL, "", `budget per_team {
			scope team
			limit 100000
			limit_for team research 200000
			window 1h
			unit tokens
		}
		budget all {
			limit 100000000
			window 1h
			unit tokens
		}`))
	for team, n := range map[string]int{"research": 3, "green": 2, "blue": 1} {
		for range n {
			if resp, body := chat(t, url, chatBody, "X-Team: "+team); resp.StatusCode != http.StatusOK {
				t.Fatalf("team %s: %d %s", team, resp.StatusCode, body)
			}
		}
	}
	waitSettles()
	resp, body := get(t, "http://"+tc.admin+"/fleetguard/budgets/per_team/top?n=2")
	var top budgetTop
	if err := json.Unmarshal([]byte(body), &top); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s: %v", resp.StatusCode, body, err)
	}
	want := []topEntry{
		{ScopeHash: keyhash.Of("research").String(), Value: "research", Used: "300"},
		{ScopeHash: keyhash.Of("green").String(), Used: "200"},
	}
	if fmt.Sprint(top.Top) != fmt.Sprint(want) || top.Scope != "team" || !time.Now().Before(top.WindowEnd) {
		t.Fatalf("top %s, want %v in the current window", body, want)
	}
	for _, bad := range []string{"per_team/top?n=0", "per_team/top?n=101", "per_team/top?team=green", "all/top"} {
		if resp, body := get(t, "http://"+tc.admin+"/fleetguard/budgets/"+bad); resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("GET %s: %d %s, want 400", bad, resp.StatusCode, body)
		}
	}
}
