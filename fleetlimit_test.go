package fleetguard

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/ratelimit"
)

// fleetSite is a site on port that answers "ok" under a fleet limit of 5 a
// minute per X-API-Key (zone per_key, with zoneExtra in its block), and
// says so when it refuses, with the global options extraGlobal.
func fleetSite(port int, extraGlobal, zoneExtra string) testCaddyfile {
	return testCaddyfile{Global: []string{extraGlobal}, Port: port,
		FleetLimit: []string{perKeyZone(5, zoneExtra)},
		Directives: []string{`handle_errors 429 {
		respond "limited by {http.fleetlimit.zone}, retry in {http.fleetlimit.retry_after}s" 429
	}`}}
}

// perKeyZone is the zone per_key: events a minute per X-API-Key, with extra
// in its block.
func perKeyZone(events int, extra string) string {
	return fmt.Sprintf("zone per_key {\n\t\t\tkey {http.request.header.X-API-Key}\n\t\t\tevents %d\n\t\t\twindow 1m\n\t\t\t%s\n\t\t}", events, extra)
}

func fleetCaddyfile(port int, extraGlobal, zoneExtra string) string {
	return fleetSite(port, extraGlobal, zoneExtra).String()
}

// assertFiveThenLimited sends five admitted requests and one denied one.
func assertFiveThenLimited(t *testing.T, url, key string) {
	t.Helper()
	for i := 1; i <= 5; i++ {
		resp, body := get(t, url, "X-API-Key: "+key)
		if resp.StatusCode != http.StatusOK || body != "ok" {
			t.Fatalf("request %d: %d %q, want 200 ok", i, resp.StatusCode, body)
		}
		if got, want := resp.Header.Get("RateLimit-Policy"), `"per_key";q=5;w=60`; got != want {
			t.Fatalf("RateLimit-Policy = %q, want %q", got, want)
		}
		if got := resp.Header.Get("RateLimit"); !strings.HasPrefix(got, fmt.Sprintf(`"per_key";r=%d;t=`, 5-i)) {
			t.Fatalf("request %d: RateLimit = %q, want r=%d", i, got, 5-i)
		}
	}
	assertLimited(t, url, key)
}

func assertLimited(t *testing.T, url, key string) {
	t.Helper()
	resp, body := get(t, url, "X-API-Key: "+key)
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("6th request: %d %q, want 429", resp.StatusCode, body)
	}
	retry, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	// The sliding window can hold a key for up to two windows: admits late in
	// one epoch weigh on the next.
	if err != nil || retry < 1 || retry > 120 {
		t.Fatalf("Retry-After = %q, want whole seconds in [1, 120]", resp.Header.Get("Retry-After"))
	}
	if !strings.HasPrefix(resp.Header.Get("RateLimit"), `"per_key";r=0;t=`) {
		t.Fatalf("RateLimit on a denial = %q", resp.Header.Get("RateLimit"))
	}
	if want := fmt.Sprintf("limited by per_key, retry in %ds", retry); body != want {
		t.Fatalf("handle_errors body = %q, want %q", body, want)
	}
}

func TestFleetLimitCaddyfileAndReload(t *testing.T) {
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	cfg := fleetCaddyfile(port, "", "")
	tc := startCaddy(t, cfg)
	assertFiveThenLimited(t, url, "alice")

	// Another key has its own budget.
	if resp, _ := get(t, url, "X-API-Key: bob"); resp.StatusCode != http.StatusOK {
		t.Fatalf("bob: %d, want 200", resp.StatusCode)
	}

	// A reload with the same zone keeps the counters.
	if code, body := tc.load("text/caddyfile", cfg); code != http.StatusOK {
		t.Fatalf("reload: %d %s", code, body)
	}
	assertLimited(t, url, "alice")

	// A bad config is refused with the field named, and the running one stays.
	badSite := fleetSite(port, "", "")
	badSite.FleetLimit = []string{perKeyZone(0, "")}
	bad := badSite.String()
	code, body := tc.load("text/caddyfile", bad)
	if code == http.StatusOK || !strings.Contains(body, "events must be > 0") {
		t.Fatalf("bad reload: %d %s, want an error naming events", code, body)
	}
	assertLimited(t, url, "alice")
	if resp, _ := get(t, url, "X-API-Key: carol"); resp.StatusCode != http.StatusOK {
		t.Fatalf("after a refused reload the old config still serves: %d", resp.StatusCode)
	}
}

func TestFleetLimitJSONConfig(t *testing.T) {
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	tc := startCaddy(t, fmt.Sprintf("{\n\tadmin {ADMIN}\n}\n:%d {\n\trespond \"before\"\n}", port))
	json := fmt.Sprintf(`{
	"admin": {"listen": "{ADMIN}"},
	"apps": {
		"http": {"servers": {"srv0": {
			"listen": [":%d"],
			"routes": [{"handle": [
				{"handler": "fleetlimit", "zones": {"per_key": {
					"key": "{http.request.header.X-API-Key}", "events": 5, "window": "1m"}}},
				{"handler": "static_response", "body": "ok"}
			]}],
			"errors": {"routes": [{"handle": [{"handler": "static_response",
				"status_code": 429,
				"body": "limited by {http.fleetlimit.zone}, retry in {http.fleetlimit.retry_after}s"}]}]}
		}}}
	}
}`, port)
	if code, body := tc.load("application/json", json); code != http.StatusOK {
		t.Fatalf("POST /load: %d %s", code, body)
	}
	assertFiveThenLimited(t, url, "json-user")

	for _, tt := range []struct{ name, from, to, want string }{
		{"unknown field", `"events": 5`, `"events": 5, "evnets": 3`, "evnets"},
		{"zero window", `"window": "1m"`, `"window": "0s"`, "window must be > 0"},
		{"negative burst", `"events": 5`, `"events": 5, "burst": -1`, "burst must be >= 0"},
		{"missing events", `"events": 5, `, ``, "events must be > 0"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			code, body := tc.load("application/json", strings.Replace(json, tt.from, tt.to, 1))
			if code == http.StatusOK || !strings.Contains(body, tt.want) {
				t.Fatalf("got %d %s, want an error containing %q", code, body, tt.want)
			}
			assertLimited(t, url, "json-user")
		})
	}
}

func TestInvalidRedisURLIsRefusedAtLoad(t *testing.T) {
	port := freePort(t)
	tc := startCaddy(t, fleetCaddyfile(port, "", ""))
	bad := fleetCaddyfile(port, "fleetguard {\n redis 127.0.0.1:6379\n }", "")
	code, body := tc.load("text/caddyfile", bad)
	if code == http.StatusOK || !strings.Contains(body, "fleetguard: redis") {
		t.Fatalf("got %d %s, want an error naming the redis option", code, body)
	}
	if resp, _ := get(t, fmt.Sprintf("http://127.0.0.1:%d/", port), "X-API-Key: x"); resp.StatusCode != http.StatusOK {
		t.Fatal("the running config must stay")
	}
}

func TestFleetLimitDryRunAdmits(t *testing.T) {
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	site := fleetSite(port, "", "")
	site.FleetLimit = append([]string{"dry_run"}, site.FleetLimit...)
	startCaddy(t, site.String())
	for i := 0; i < 8; i++ {
		if resp, _ := get(t, url, "X-API-Key: dry"); resp.StatusCode != http.StatusOK {
			t.Fatalf("dry run request %d: %d, want 200", i+1, resp.StatusCode)
		}
	}
}

func TestFleetLimitWithRedisDownServesPerInstance(t *testing.T) {
	srv := redistest.Start(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	srv.Stop() // Redis is unreachable from the start
	startCaddy(t, fleetCaddyfile(port, "fleetguard {\n redis "+srv.URL()+"\n sync_interval 50ms\n }", ""))
	assertFiveThenLimited(t, url, "outage")
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	if resp, _ := get(t, url, "X-API-Key: after"); resp.StatusCode != http.StatusOK {
		t.Fatalf("after Redis returns: %d", resp.StatusCode)
	}
}

func TestRedisAndRedisClusterAreExclusive(t *testing.T) {
	port := freePort(t)
	tc := startCaddy(t, fleetCaddyfile(port, "", ""))
	code, body := tc.load("text/caddyfile", fleetCaddyfile(port, "fleetguard {\n redis redis://127.0.0.1:1\n redis_cluster redis://127.0.0.1:2\n }", ""))
	if code == http.StatusOK || !strings.Contains(body, "redis and redis_cluster") {
		t.Fatalf("got %d %s, want an error naming both options", code, body)
	}
}

func TestAdminStatusAndMetrics(t *testing.T) {
	srv := redistest.Start(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	tc := startCaddy(t, fleetCaddyfile(port, "fleetguard {\n redis "+srv.URL()+"\n prefix status\n sync_interval 50ms\n }", ""))
	get(t, url, "X-API-Key: status-key")
	resp, body := get(t, "http://"+tc.admin+"/fleetguard/status")
	var status struct {
		Stores []storeStatus `json:"stores"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(body), &status) != nil {
		t.Fatalf("GET /fleetguard/status: %d %s", resp.StatusCode, body)
	}
	var found bool
	for _, st := range status.Stores {
		if strings.Contains(st.Store, "|status|plain") { // prefix "status", no TLS, no password
			found = true
			if !st.Healthy || st.SyncInterval != "50ms" || len(st.Zones) != 1 || st.Zones[0].Name != "per_key" || st.Zones[0].Keys != 1 {
				t.Fatalf("status %+v", st)
			}
		}
	}
	if !found {
		t.Fatalf("the Redis store is not listed: %s", body)
	}
	if strings.Contains(body, "status-key") {
		t.Fatal("the status must not show user keys")
	}

	// The collectors are on Caddy's metrics endpoint, and survive a reload.
	if code, body := tc.load("text/caddyfile", fleetCaddyfile(port, "fleetguard {\n redis "+srv.URL()+"\n prefix status\n sync_interval 50ms\n }", "")); code != http.StatusOK {
		t.Fatalf("reload: %d %s", code, body)
	}
	m := eventuallyValue(t, 5*time.Second, "the fleetguard metrics on /metrics", func() string {
		_, m := get(t, "http://"+tc.admin+"/metrics")
		return m
	}, func(m string) bool {
		return strings.Contains(m, `fleetguard_fleetlimit_requests_total{decision="allowed",zone="per_key"}`) &&
			strings.Contains(m, "fleetguard_fleetlimit_early_syncs_total") &&
			strings.Contains(m, `fleetguard_fleetlimit_reconcile_passes_total{result="ok"}`)
	})
	if strings.Contains(m, "status-key") {
		t.Fatal("metrics must not carry user keys")
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// A config that fails to load, here at start (its port is taken), changes
// nothing the running config uses: not the sync interval, not a zone's cap.
func TestFailedLoadChangesNothing(t *testing.T) {
	port := freePort(t)
	tc := startCaddy(t, fleetCaddyfile(port, "fleetguard {\n sync_interval 100ms\n }", ""))
	memoryStore := func() *engines {
		var found *engines
		enginePool.Range(func(_, v any) bool {
			if e := v.(*engines); e.identity == memoryIdentity(DefaultPrefix) {
				found = e
			}
			return true
		})
		if found == nil {
			t.Fatal("no memory store in the pool")
		}
		return found
	}
	e := memoryStore()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	bad := fleetCaddyfile(busy.Addr().(*net.TCPAddr).Port, "fleetguard {\n sync_interval 3s\n }", "max_keys 1")
	if code, _ := tc.load("text/caddyfile", bad); code == http.StatusOK {
		t.Fatal("a config whose port is taken must fail to load")
	}
	if got := memoryStore(); got != e || e.limiter.SyncInterval() != 100*time.Millisecond {
		t.Fatalf("after the failed load the store syncs every %s, want 100ms", e.limiter.SyncInterval())
	}
	for _, z := range e.limiter.Zones() {
		if z.MaxKeys() != ratelimit.DefaultMaxKeys {
			t.Fatalf("zone %s caps %d keys after the failed load, want the default %d", z.Name(), z.MaxKeys(), ratelimit.DefaultMaxKeys)
		}
	}
	assertFiveThenLimited(t, fmt.Sprintf("http://127.0.0.1:%d/", port), "still-running")
}

// One zone name with two different limits in one config is refused at load.
func TestConflictingZoneDefinitionsAreRefused(t *testing.T) {
	port := freePort(t)
	tc := startCaddy(t, fleetCaddyfile(port, "", ""))
	conflicting := fmt.Sprintf(`{
	admin {ADMIN}
}
:%d {
	route /a {
		fleetlimit {
			zone z {
				key {http.request.remote.host}
				events 5
				window 10s
			}
		}
	}
	route /b {
		fleetlimit {
			zone z {
				key {http.request.remote.host}
				events 6
				window 1m
			}
		}
	}
	respond ok
}`, port)
	code, body := tc.load("text/caddyfile", conflicting)
	if code == http.StatusOK || !strings.Contains(body, `zone "z" is defined twice`) || !strings.Contains(body, "events 5 per 10s") || !strings.Contains(body, "events 6 per 1m0s") {
		t.Fatalf("%d %s: want the load refused, naming both definitions", code, body)
	}
}

// Decisions are counted by reason: the window, the local burst cap, dry run.
func TestFleetLimitDecisionsByReason(t *testing.T) {
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, fmt.Sprintf(`{
	admin {ADMIN}
}
:%d {
	route /window {
		fleetlimit {
			zone reason_window {
				key {http.request.remote.host}
				events 2
				window 1m
			}
		}
	}
	route /burst {
		fleetlimit {
			zone reason_burst {
				key {http.request.remote.host}
				events 100
				window 1m
				burst 2
			}
		}
	}
	route /dry {
		fleetlimit {
			dry_run
			zone reason_dry {
				key {http.request.remote.host}
				events 2
				window 1m
			}
		}
	}
	respond ok
}`, port))
	count := func(zone, decision string) float64 {
		return testutil.ToFloat64(metrics.fleetDecisions.WithLabelValues(zone, decision))
	}
	for _, p := range []string{"/window", "/burst", "/dry"} {
		for i := 0; i < 3; i++ {
			get(t, url+p)
		}
	}
	tests := []struct{ zone, decision string }{
		{"reason_window", "denied_fleet"}, {"reason_burst", "denied_local"}, {"reason_dry", "dry_run_denied"},
	}
	for _, tt := range tests {
		if got := count(tt.zone, tt.decision); got != 1 {
			t.Errorf("zone %s: %s = %v, want 1", tt.zone, tt.decision, got)
		}
		if got := count(tt.zone, "allowed"); got != 2 {
			t.Errorf("zone %s: allowed = %v, want 2", tt.zone, got)
		}
	}
}

// ratelimit_headers picks the responses that carry RateLimit and
// RateLimit-Policy; Retry-After is on every denial.
func TestRateLimitHeadersOption(t *testing.T) {
	for _, tc := range []struct {
		mode            string
		onAdmit, onDeny bool
	}{
		{"", true, true},
		{"ratelimit_headers always", true, true},
		{"ratelimit_headers denied", false, true},
		{"ratelimit_headers off", false, false},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			port := freePort(t)
			url := fmt.Sprintf("http://127.0.0.1:%d/", port)
			startCaddy(t, testCaddyfile{Port: port,
				FleetLimit: []string{"zone one {\n key {http.request.header.X-API-Key}\n events 1\n window 1m\n }", tc.mode}}.String())
			for i, want := range []struct {
				status  int
				headers bool
			}{{http.StatusOK, tc.onAdmit}, {http.StatusTooManyRequests, tc.onDeny}} {
				resp, _ := get(t, url, "X-API-Key: headers-"+strings.ReplaceAll(tc.mode, " ", "-"))
				got := resp.Header.Get("RateLimit") != "" && resp.Header.Get("RateLimit-Policy") != ""
				none := resp.Header.Get("RateLimit") == "" && resp.Header.Get("RateLimit-Policy") == ""
				if resp.StatusCode != want.status || (want.headers && !got) || (!want.headers && !none) {
					t.Fatalf("request %d: %d with RateLimit %q, RateLimit-Policy %q; want %d with headers %v",
						i+1, resp.StatusCode, resp.Header.Get("RateLimit"), resp.Header.Get("RateLimit-Policy"), want.status, want.headers)
				}
				if resp.StatusCode == http.StatusTooManyRequests && resp.Header.Get("Retry-After") == "" {
					t.Fatal("a denial without Retry-After")
				}
			}
		})
	}
	if _, _, err := adaptCaddyfile(":80 {\n fleetlimit {\n zone z {\n key k\n events 1\n window 1s\n }\n ratelimit_headers sometimes\n }\n }"); err == nil || !strings.Contains(err.Error(), "ratelimit_headers takes always, denied or off") {
		t.Fatalf("a bad ratelimit_headers: %v", err)
	}
}

// Past max_keys a flood of unique keys must not cost a new key its own
// requests: the new key is limited by its local burst on this instance, not
// by what the flood did.
func TestMaxKeysFloodDoesNotRefuseANewKey(t *testing.T) {
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	startCaddy(t, testCaddyfile{Port: port,
		FleetLimit: []string{"zone flood {\n key {http.request.header.X-Key}\n events 2\n window 1m\n max_keys 8\n }"}}.String())
	for i := range 1000 {
		get(t, url, "X-Key: flood-"+strconv.Itoa(i))
	}
	for i := 1; i <= 2; i++ {
		if resp, body := get(t, url, "X-Key: newcomer"); resp.StatusCode != http.StatusOK {
			t.Fatalf("a new key's request %d after the flood: %d %q, want 200", i, resp.StatusCode, body)
		}
	}
	// Its burst (= events) spent, the new key is limited on its own account.
	if resp, _ := get(t, url, "X-Key: newcomer"); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("the new key past its burst: %d, want 429", resp.StatusCode)
	}
}

// TestRemainingNeverPromisesMoreThanTheFleetGives: Caddy instances in
// processes of their own on one Redis, a client that sends one key's
// requests one after another to a random instance: after every admitted
// response, its RateLimit r is at most the limit less what the fleet
// admitted in the window (this request included), counted from the
// client's side as a lower bound, give or take the 2% the fleet's window
// itself may be over.
func TestRemainingNeverPromisesMoreThanTheFleetGives(t *testing.T) {
	srv := redistest.Start(t)
	const events, window = 60, 3 * time.Second
	for _, n := range []int{2, 4} {
		t.Run(strconv.Itoa(n)+" instances", func(t *testing.T) {
			prefix := "remaining" + strconv.Itoa(n)
			var urls, admins []string
			for range n {
				port := freePort(t)
				addr := "127.0.0.1:" + strconv.Itoa(port)
				admin := "127.0.0.1:" + strconv.Itoa(freePort(t))
				admins = append(admins, admin)
				startCaddyProcess(t, fmt.Sprintf(`{
	admin %s
	fleetguard {
		redis %s
		prefix %s
		sync_interval 100ms
	}
}
http://%s {
	fleetlimit {
		zone per_key {
			key {http.request.header.X-API-Key}
			events %d
			window %s
		}
	}
	respond "ok"
}`, admin, srv.URL(), prefix, addr, events, window), addr)
				urls = append(urls, "http://"+addr+"/")
			}
			// Every instance knows the fleet before the first request (as
			// when a balancer sends traffic to instances that are up).
			for _, admin := range admins {
				eventually(t, 5*time.Second, admin+" seeing the whole fleet", func() bool {
					return fleetMembers(t, admin) == n
				})
			}
			type answer struct {
				sent, recv time.Time
				admitted   bool
			}
			var answers []answer
			rng := rand.New(rand.NewPCG(uint64(n), 3))
			checked := 0
			for range 300 { // about 2x the limit, for two windows
				url := urls[rng.IntN(len(urls))]
				sent := time.Now()
				resp, _ := get(t, url, "X-API-Key: k")
				a := answer{sent: sent, recv: time.Now(), admitted: resp.StatusCode == http.StatusOK}
				if a.admitted {
					r := remainingOf(t, resp.Header.Get("RateLimit"), "per_key")
					// The admits the fleet surely made in the window that
					// ended when this one was decided: those answered before
					// it was sent, and sent less than a window before it was
					// answered.
					fleet := 1
					for _, b := range answers {
						if b.admitted && b.sent.After(a.recv.Add(-window)) {
							fleet++
						}
					}
					if most := max(events-fleet, 0) + events/50; r > int64(most) {
						t.Fatalf("r=%d after %d admitted in the window: the fleet can give at most %d", r, fleet, most)
					}
					checked++
				}
				answers = append(answers, a)
				time.Sleep(time.Duration(rng.IntN(50)) * time.Millisecond) // a client's uneven pace, not a wait
			}
			if checked < events {
				t.Fatalf("only %d admitted responses to check", checked)
			}
		})
	}
}

// remainingOf reads r of the item named name in a RateLimit header.
func remainingOf(t *testing.T, header, name string) int64 {
	t.Helper()
	for _, item := range strings.Split(header, ",") {
		item = strings.TrimSpace(item)
		if !strings.HasPrefix(item, strconv.Quote(name)+";") {
			continue
		}
		for _, p := range strings.Split(item, ";")[1:] {
			if v, ok := strings.CutPrefix(p, "r="); ok {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					t.Fatalf("RateLimit %q: %v", header, err)
				}
				return n
			}
		}
	}
	t.Fatalf("RateLimit %q has no item %q with r", header, name)
	return 0
}

// fleetMembers is fleet_members in the status of the Caddy whose admin
// endpoint is admin (its one store).
func fleetMembers(t *testing.T, admin string) int {
	t.Helper()
	enginePool := storeStatuses(t, admin)
	if len(enginePool) != 1 {
		t.Fatalf("%d stores in the status, want 1: %+v", len(enginePool), enginePool)
	}
	return int(enginePool[0].FleetMembers)
}
