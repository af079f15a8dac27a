package fleetguard

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// observedCaddyfile runs both handlers on one Redis with Caddy's metrics on
// and a debug log in logPath: fleetlimit on /limited (3 per minute per
// X-API-Key), llmbudget with a token budget per key and a dollar budget on
// the priced model "obsmodel*", and a second llmbudget under /other for an
// unpriced model.
func observedCaddyfile(port int, redisURL, upstream, logPath string) string {
	return fmt.Sprintf(`{
	admin {ADMIN}
	metrics
	log {
		output file %s
		level DEBUG
	}
	fleetguard {
		redis %s
		prefix obs
		sync_interval 50ms
		near_limit off # exact counts for the test: every admit leased
	}
}
:%d {
	handle /limited {
		fleetlimit {
			zone obs_zone {
				key {http.request.header.X-API-Key}
				events 3
				window 1m
			}
		}
		respond "ok"
	}
	handle_path /other/* {
		llmbudget {
			budget obs_other {
				limit 1000000
				window 1h
				unit tokens
			}
		}
		reverse_proxy %s
	}
	handle {
		llmbudget {
			store_timeout 2s # a loaded test machine is no store outage
			budget obs_tokens {
				scope key
				limit 250
				window 1h
				unit tokens
			}
			budget obs_usd {
				unit usd
				limit 100
				window 1h
				alert_at 80%% 95%%
			}
			price obsmodel* 2.50 10.00 1.25
		}
		reverse_proxy %s
	}
}`, logPath, redisURL, port, strings.TrimPrefix(upstream, "http://"), strings.TrimPrefix(upstream, "http://"))
}

// metricValue reads one series (name{labels in alphabetical order}) from a
// Prometheus text exposition; ok is false when it is absent.
func metricValue(exposition, series string) (float64, bool) {
	for _, line := range strings.Split(exposition, "\n") {
		if rest, found := strings.CutPrefix(line, series+" "); found {
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			return v, err == nil
		}
	}
	return 0, false
}

func scrape(t *testing.T, tc *testCaddy) string {
	t.Helper()
	resp, body := get(t, "http://"+tc.admin+"/metrics")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %d", resp.StatusCode)
	}
	return body
}

// A new user's view of the metrics: after traffic through both handlers,
// /metrics shows every series the README lists, with values that match the
// traffic, no user key anywhere, and they keep counting across a reload.
func TestMetricsTellTheStory(t *testing.T) {
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	logPath := filepath.Join(t.TempDir(), "caddy.log")
	cfg := observedCaddyfile(port, srv.URL(), up.URL, logPath)
	tc := startCaddy(t, cfg)
	before := scrape(t, tc)
	otherInput, _ := metricValue(before, `fleetguard_llmbudget_tokens_total{kind="input",model="other"}`)

	traffic := func() (admittedLLM int) {
		for range 5 {
			get(t, url+"/limited", "X-API-Key: obs-secret-key")
		}
		for range 4 {
			waitSettles()
			resp, body := chat(t, url, `{"model":"obsmodel-1","max_tokens":70,"messages":[{"role":"user","content":"hi"}]}`, "Authorization: Bearer obs-secret-bearer")
			switch resp.StatusCode {
			case http.StatusOK:
				admittedLLM++
			case http.StatusTooManyRequests:
			default:
				t.Fatalf("chat: %d %s", resp.StatusCode, body)
			}
		}
		if resp, body := chat(t, url+"/other", `{"model":"llama-local","max_tokens":20,"messages":[]}`); resp.StatusCode != http.StatusOK {
			t.Fatalf("unpriced chat: %d %s", resp.StatusCode, body)
		}
		waitSettles()
		return admittedLLM
	}
	admitted := traffic()
	if admitted == 0 || admitted == 4 {
		t.Fatalf("%d of 4 chats admitted: the test wants both admissions and denials (250 tokens, 100 per request)", admitted)
	}

	want := func(m, series string, check func(v float64) bool, what string) float64 {
		t.Helper()
		v, ok := metricValue(m, series)
		if !ok || !check(v) {
			t.Fatalf("%s = %v (present %v), want %s\n%s", series, v, ok, what, grepLines(m, "fleetguard"))
		}
		return v
	}
	eq := func(n float64) func(float64) bool { return func(v float64) bool { return v == n } }
	pos := func(v float64) bool { return v > 0 }

	// The reconciler's pass metrics come on its own schedule.
	m := eventuallyValue(t, 5*time.Second, "a reconcile pass on /metrics", func() string { return scrape(t, tc) }, func(m string) bool {
		v, _ := metricValue(m, `fleetguard_fleetlimit_reconcile_duration_seconds_count`)
		return v > 0
	})
	allowed := want(m, `fleetguard_fleetlimit_requests_total{decision="allowed",zone="obs_zone"}`, eq(3), "3 (events 3)")
	deniedFleet, _ := metricValue(m, `fleetguard_fleetlimit_requests_total{decision="denied_fleet",zone="obs_zone"}`)
	deniedLocal, _ := metricValue(m, `fleetguard_fleetlimit_requests_total{decision="denied_local",zone="obs_zone"}`)
	if deniedFleet+deniedLocal != 2 {
		t.Fatalf("denied %v + %v, want 2", deniedFleet, deniedLocal)
	}
	want(m, `fleetguard_fleetlimit_tracked_keys{zone="obs_zone"}`, eq(1), "1")
	want(m, `fleetguard_store_healthy{component="fleetlimit",store="redis|`+srv.Addr()+`|0|obs|plain"}`, eq(1), "1")
	want(m, `fleetguard_store_healthy{component="llmbudget",store="redis|`+srv.Addr()+`|0|obs|plain"}`, eq(1), "1")
	want(m, `fleetguard_llmbudget_requests_total{budget="obs_tokens",decision="admitted"}`, eq(float64(admitted)), "the admitted chats")
	want(m, `fleetguard_llmbudget_requests_total{budget="obs_usd",decision="admitted"}`, eq(float64(admitted)), "the admitted chats")
	want(m, `fleetguard_llmbudget_requests_total{budget="obs_tokens",decision="denied"}`, eq(float64(4-admitted)), "the denied chats")
	want(m, `fleetguard_llmbudget_tokens_total{kind="input",model="obsmodel*"}`, eq(float64(30*admitted)), "30 per admitted chat (fakellm)")
	want(m, `fleetguard_llmbudget_tokens_total{kind="output",model="obsmodel*"}`, eq(float64(70*admitted)), "70 per admitted chat")
	want(m, `fleetguard_llmbudget_cost_usd_total{model="obsmodel*"}`, func(v float64) bool {
		return v > float64(admitted)*(30*2.5+70*10)/1e6*0.999 && v < float64(admitted)*(30*2.5+70*10)/1e6*1.001
	}, "the price book's cost of the reported usage")
	want(m, `fleetguard_llmbudget_tokens_total{kind="input",model="other"}`, func(v float64) bool { return v == otherInput+30 }, "30 more for the unpriced model")
	want(m, `fleetguard_llmbudget_usage_ratio_count`, pos, "> 0")
	want(m, `fleetguard_llmbudget_settle_outcomes_total{outcome="ok"}`, pos, "> 0")
	want(m, `fleetguard_llmbudget_settles_total{usage_source="reported"}`, pos, "> 0")
	want(m, `fleetguard_fleetlimit_early_syncs_total`, func(float64) bool { return true }, "present")
	for _, secret := range []string{"obs-secret-key", "obs-secret-bearer"} {
		if strings.Contains(m, secret) {
			t.Fatalf("/metrics carries the user key %q", secret)
		}
	}

	// The same config again (a reload): the series keep counting.
	if code, body := tc.load("text/caddyfile", cfg); code != http.StatusOK {
		t.Fatalf("reload: %d %s", code, body)
	}
	get(t, url+"/limited", "X-API-Key: obs-secret-key") // still denied: the window survives
	traffic()
	m = scrape(t, tc)
	want(m, `fleetguard_fleetlimit_requests_total{decision="allowed",zone="obs_zone"}`, eq(allowed), "unchanged: the key's window survived the reload")
	want(m, `fleetguard_llmbudget_requests_total{budget="obs_tokens",decision="denied"}`, func(v float64) bool { return v >= float64(4-admitted)+4 }, "growing across the reload")

	// Events reach Caddy's events app (its debug log shows each), with the
	// zone or budget and a hash of the key, never the key.
	log, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{`"name":"fleetlimit_exceeded"`, `"name":"llmbudget_denied"`, `"zone":"obs_zone"`, `"budget":"obs_tokens"`,
		`"key_hash":"` + keyhash.Of("obs-secret-key").String() + `"`} {
		if !strings.Contains(string(log), name) {
			t.Fatalf("the log has no %s:\n%s", name, grepLines(string(log), "event"))
		}
	}
	// Caddy's own request logs (http.log.*) show headers unless the config
	// filters them (README, examples/llm.Caddyfile); fleetguard's and the
	// events' lines never do.
	var ours []string
	for _, line := range strings.Split(string(log), "\n") {
		if !strings.Contains(line, `"logger":"http.log.`) {
			ours = append(ours, line)
		}
	}
	for _, secret := range []string{"obs-secret-key", "obs-secret-bearer"} {
		if strings.Contains(strings.Join(ours, "\n"), secret) {
			t.Fatalf("the log carries the user key %q:\n%s", secret, grepLines(string(log), secret))
		}
	}
}

// The store going away shows on /metrics: store_healthy drops to 0 and
// sync errors count, then it comes back.
func TestMetricsShowAStoreOutage(t *testing.T) {
	srv := redistest.Start(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	tc := startCaddy(t, fleetCaddyfile(port, "fleetguard {\n redis "+srv.URL()+"\n prefix outage\n sync_interval 50ms\n }", ""))
	healthy := `fleetguard_store_healthy{component="fleetlimit",store="redis|` + srv.Addr() + `|0|outage|plain"}`
	// waitFor reads the fleetguard_store series until ok holds of them.
	waitFor := func(what string, ok func(m string) bool) string {
		t.Helper()
		return eventuallyValue(t, 5*time.Second, what+" on /metrics", func() string {
			get(t, url, "X-API-Key: outage-key") // keep a key active, so passes run
			return grepLines(scrape(t, tc), "fleetguard_store")
		}, ok)
	}
	m := waitFor("healthy", func(m string) bool { v, _ := metricValue(m, healthy); return v == 1 })
	errorsBefore, _ := metricValue(m, `fleetguard_store_errors_total{op="sync"}`)
	srv.Stop()
	waitFor("an outage", func(m string) bool {
		v, _ := metricValue(m, healthy)
		e, _ := metricValue(m, `fleetguard_store_errors_total{op="sync"}`)
		return v == 0 && e > errorsBefore
	})
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	waitFor("the recovery", func(m string) bool { v, _ := metricValue(m, healthy); return v == 1 })
}

// shadow: nothing is refused, what would have been is counted, logged and
// announced, and the usage is still charged (past the limit).
func TestShadowForwardsCountsAndCharges(t *testing.T) {
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, testCaddyfile{Port: port, Upstream: up.URL,
		Global:    []string{"fleetguard {\n redis " + srv.URL() + "\n prefix shadow\n }"},
		LLMBudget: []string{"shadow", "budget shadow_tokens {\n scope key\n limit 150\n window 1h\n unit tokens\n }"},
	}.String())
	before := scrapeDefault(t)
	for i := range 4 {
		waitSettles()
		if resp, body := chat(t, url, chatBody, "Authorization: Bearer shadow-user"); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d in shadow mode: %d %s", i+1, resp.StatusCode, body)
		}
	}
	// What llmbudget would refuse is forwarded too.
	if resp, body := do(t, http.MethodPost, url+"/v1/unknown/thing", `{}`, "Content-Type: application/json"); strings.Contains(body, "unbudgeted_path") {
		t.Fatalf("shadow refused an unknown path: %d %s", resp.StatusCode, body)
	}
	if resp, body := chat(t, url, `{"model":"gpt-4o","model":"other","messages":[]}`); strings.Contains(body, "ambiguous_request") {
		t.Fatalf("shadow refused an ambiguous body: %d %s", resp.StatusCode, body)
	}
	if got := up.Hits(); got != 6 {
		t.Fatalf("upstream saw %d requests, want all 6", got)
	}
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { rc.Close() })
	// 4 requests of 100 tokens each (fakellm), whether the limit (150)
	// would have admitted them or not.
	if got := budgetCounter(t, rc, "shadow", "shadow_tokens"); got != 400 {
		t.Fatalf("shadow budget counter %d, want 400: shadow still records usage", got)
	}
	after := scrapeDefault(t)
	delta := func(series string) float64 {
		a, _ := metricValue(after, series)
		b, _ := metricValue(before, series)
		return a - b
	}
	if d := delta(`fleetguard_llmbudget_requests_total{budget="shadow_tokens",decision="shadow_denied"}`); d < 2 {
		t.Fatalf("shadow_denied grew by %v, want at least 2 (150 tokens fit one 100-token request)", d)
	}
	if d := delta(`fleetguard_llmbudget_requests_total{budget="",decision="shadow_rejected"}`); d != 2 {
		t.Fatalf("shadow_rejected grew by %v, want 2 (unknown path, ambiguous body)", d)
	}
	if d := delta(`fleetguard_llmbudget_requests_total{budget="shadow_tokens",decision="denied"}`); d != 0 {
		t.Fatalf("denied grew by %v in shadow mode", d)
	}
}

// scrapeDefault reads the process's fleetguard metrics without an admin
// endpoint (they are process-wide).
func scrapeDefault(t *testing.T) string {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := registerMetrics(reg); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, f := range families {
		if _, err := expfmt.MetricFamilyToText(&b, f); err != nil {
			t.Fatal(err)
		}
	}
	return b.String()
}

// Every series examples/grafana-dashboard.json queries exists, with the
// labels the query groups and filters by.
func TestGrafanaDashboardQueriesExistingMetrics(t *testing.T) {
	raw, err := os.ReadFile("examples/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
		Templating struct {
			List []struct{ Definition string }
		}
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	var exprs []string
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			exprs = append(exprs, tg.Expr)
		}
	}
	for _, v := range dash.Templating.List {
		exprs = append(exprs, v.Definition)
	}
	if queried := checkQueries(t, exprs); queried < 15 {
		t.Fatalf("the dashboard queries %d series; it should show every area", queried)
	}
}

// The alerting rules of examples/prometheus-alerts.yml query metrics and
// labels fleetguard exports.
func TestPrometheusAlertsQueryExistingMetrics(t *testing.T) {
	raw, err := os.ReadFile("examples/prometheus-alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	var exprs []string
	for _, line := range strings.Split(string(raw), "\n") {
		if e, ok := strings.CutPrefix(strings.TrimSpace(line), "expr: "); ok {
			exprs = append(exprs, e)
		}
	}
	if len(exprs) < 5 || checkQueries(t, exprs) < 5 {
		t.Fatalf("%d rules: want the budgets' and the store's", len(exprs))
	}
}

// checkQueries fails t for each metric or label exprs query that fleetguard
// does not export, and returns how many metric names they query.
func checkQueries(t *testing.T, exprs []string) int {
	t.Helper()
	labels := describedMetrics(t)
	metricName := regexp.MustCompile(`fleetguard_[a-z_]+`)
	grouping := regexp.MustCompile(`by \(([a-z_, ]+)\)`)
	matcher := regexp.MustCompile(`([a-z_]+)=~?"`)
	labelValues := regexp.MustCompile(`label_values\((fleetguard_[a-z_]+), ([a-z_]+)\)`)
	queried := 0
	for _, e := range exprs {
		names := metricName.FindAllString(e, -1)
		for _, n := range names {
			queried++
			base := n
			for _, suffix := range []string{"_bucket", "_count", "_sum"} {
				if _, ok := labels[base]; !ok {
					base = strings.TrimSuffix(base, suffix)
				}
			}
			have, ok := labels[base]
			if !ok {
				t.Errorf("%q queries %s, which fleetguard does not export", e, n)
				continue
			}
			var used []string
			for _, m := range grouping.FindAllStringSubmatch(e, -1) {
				for _, l := range strings.Split(m[1], ",") {
					used = append(used, strings.TrimSpace(l))
				}
			}
			for _, m := range matcher.FindAllStringSubmatch(e, -1) {
				used = append(used, m[1])
			}
			for _, m := range labelValues.FindAllStringSubmatch(e, -1) {
				used = append(used, m[2])
			}
			for _, l := range used {
				if l != "le" && !slices.Contains(have, l) && len(names) == 1 {
					t.Errorf("%q uses label %q, which %s does not have (it has %v)", e, l, base, have)
				}
			}
		}
	}
	return queried
}

// describedMetrics maps every fleetguard metric name to its labels.
func describedMetrics(t *testing.T) map[string][]string {
	t.Helper()
	ch := make(chan *prometheus.Desc, 64)
	go func() {
		for _, c := range collectors() {
			c.Describe(ch)
		}
		close(ch)
	}()
	// Desc has no accessors; its String is stable: fqName: "…", …,
	// variableLabels: {a,b}.
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	vl := regexp.MustCompile(`variableLabels: \{([^}]*)\}`)
	out := make(map[string][]string)
	for d := range ch {
		s := d.String()
		name := fq.FindStringSubmatch(s)
		if name == nil {
			t.Fatalf("cannot read %s", s)
		}
		var labels []string
		if m := vl.FindStringSubmatch(s); m != nil && m[1] != "" {
			labels = strings.Split(m[1], ",")
		}
		out[name[1]] = labels
	}
	return out
}

// Two stores of one name (the same server under two passwords, while a
// reload that rotates the password overlaps the old config and the new) are
// one store_healthy series per component: a duplicate series would fail the
// whole scrape.
func TestStoreHealthyOncePerName(t *testing.T) {
	for _, password := range []string{"pw-one", "pw-two"} {
		poolStore(t, redisIdentity(&redis.Options{Addr: "127.0.0.1:1", Password: password}, "onename"))
	}
	m := scrapeDefault(t)
	for _, component := range []string{"fleetlimit", "llmbudget"} {
		series := `fleetguard_store_healthy{component="` + component + `",store="redis|127.0.0.1:1|0|onename|plain"} `
		if n := strings.Count(m, series); n != 1 {
			t.Fatalf("%d series %s, want one:\n%s", n, series, grepLines(m, "store_healthy"))
		}
	}
}

// shadow forwards a body over max_request_body whole, whether its length was
// announced (Content-Length) or found by reading (chunked).
func TestShadowForwardsATooLargeBodyWhole(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d/v1/chat/completions", port)
	startCaddy(t, testCaddyfile{Port: port, Upstream: up.URL,
		LLMBudget: []string{"shadow", "max_request_body 1KiB", "budget big {\n limit 1000000\n window 1h\n unit tokens\n }"}}.String())
	body := `{"model":"gpt-4o","messages":[{"role":"user","content":"` + strings.Repeat("x", 3000) + `"}]}`
	for _, chunked := range []bool{false, true} {
		var reader io.Reader = strings.NewReader(body)
		if chunked {
			reader = struct{ io.Reader }{reader} // unknown length: sent chunked
		}
		req, err := http.NewRequest(http.MethodPost, url, reader)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || up.LastBody() != body {
			t.Fatalf("chunked %v: %d, the upstream got %d of %d bytes", chunked, resp.StatusCode, len(up.LastBody()), len(body))
		}
	}
}

// A fresh Caddy's /metrics holds every series the dashboard queries, with the
// label values it matches on, at 0: no panel shows "No data" before traffic.
// It runs in a process of its own (this test binary again), so that no
// earlier test has created a series.
func TestFreshInstanceHasEveryDashboardSeries(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run", "^TestFreshInstanceExposition$", "-test.count", "1")
	cmd.Env = append(os.Environ(), "FLEETGUARD_FRESH_METRICS=1")
	var stderr strings.Builder
	cmd.Stderr = &stderr // Caddy's logs
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("the fresh instance: %v\n%s\n%s", err, out, stderr.String())
	}
	_, exposition, found := strings.Cut(string(out), "EXPOSITION\n")
	if !found {
		t.Fatalf("no exposition from the fresh instance:\n%s", out)
	}
	raw, err := os.ReadFile("examples/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	metricName := regexp.MustCompile(`fleetguard_[a-z_]+`)
	exactMatcher := regexp.MustCompile(`([a-z_]+)="([a-z_]+)"`)
	checked := 0
	for _, expr := range regexp.MustCompile(`"(?:expr|definition)": "((?:[^"\\]|\\.)*)"`).FindAllStringSubmatch(string(raw), -1) {
		e := strings.ReplaceAll(expr[1], `\"`, `"`)
		for _, name := range metricName.FindAllString(e, -1) {
			checked++
			var lines []string
			for _, l := range strings.Split(exposition, "\n") {
				if strings.HasPrefix(l, name+"{") || strings.HasPrefix(l, name+" ") {
					lines = append(lines, l)
				}
			}
			if len(lines) == 0 {
				t.Errorf("%s (queried by %q) has no series on a fresh instance", name, e)
				continue
			}
			for _, m := range exactMatcher.FindAllStringSubmatch(e, -1) {
				if !slices.ContainsFunc(lines, func(l string) bool { return strings.Contains(l, m[0]) }) {
					t.Errorf("%s has no series with %s (queried by %q) on a fresh instance", name, m[0], e)
				}
			}
		}
	}
	if checked < 15 {
		t.Fatalf("checked %d series; the dashboard should show every area", checked)
	}
}

// TestFreshInstanceExposition is the child of
// TestFreshInstanceHasEveryDashboardSeries: a Caddy with both handlers on
// Redis, scraped before any request.
func TestFreshInstanceExposition(t *testing.T) {
	if os.Getenv("FLEETGUARD_FRESH_METRICS") != "1" {
		t.Skip("run by TestFreshInstanceHasEveryDashboardSeries in a process of its own")
	}
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	port := freePort(t)
	tc := startCaddy(t, observedCaddyfile(port, srv.URL(), up.URL, filepath.Join(t.TempDir(), "caddy.log")))
	// The reconciler's first pass and the store's health come on their own.
	fmt.Print("EXPOSITION\n" + scrape(t, tc))
}

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
			unit tokens
		}
		budget mx_team {
			scope team
			limit 100000
			limit_for team research 2000
			window 1h
			unit tokens
		}
		budget mx_model {
			scope model
			limit 100000
			limit_for model gpt-4o 5000
			window 1h
			unit tokens
		}
		budget mx_key {
			scope key
			limit 400
			window 1h
			unit tokens
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
