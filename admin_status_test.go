package fleetguard

import (
	"crypto/md5"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// statusCaddyfile has a fleet limit and a budget in front of an upstream.
func statusCaddyfile(port int, upstream, global string) string {
	return testCaddyfile{Global: []string{global}, Port: port, Upstream: upstream,
		FleetLimit: []string{perKeyZone(100000, "")},
		LLMBudget:  []string{"budget g {\n\t\t\tlimit 100000000\n\t\t\twindow 1h\n\t\tunit tokens\n\t\t}"},
	}.String()
}

// storeStatusOf is the status of the store whose identity has prefix.
func storeStatusOf(t *testing.T, tc *testCaddy, prefix string) storeStatus {
	t.Helper()
	enginePool := storeStatuses(t, tc.admin)
	for _, st := range enginePool {
		if strings.Contains(st.Store, "|"+prefix) {
			return st
		}
	}
	t.Fatalf("no store with prefix %q in %+v", prefix, enginePool)
	return storeStatus{}
}

// storeStatuses is every store in the status of the Caddy whose admin
// endpoint is admin (GET /fleetguard/status).
func storeStatuses(t *testing.T, admin string) []storeStatus {
	t.Helper()
	resp, body := get(t, "http://"+admin+"/fleetguard/status")
	var status struct {
		Stores []storeStatus `json:"stores"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(body), &status) != nil {
		t.Fatalf("GET /fleetguard/status: %d %s", resp.StatusCode, body)
	}
	return status.Stores
}

// waitStatus reads the status, calling poke between reads, until ok holds.
func waitStatus(t *testing.T, tc *testCaddy, prefix, what string, poke func(), ok func(storeStatus) bool) storeStatus {
	t.Helper()
	reads := 0
	return eventuallyValue(t, 10*time.Second, what, func() storeStatus {
		if reads++; reads > 1 {
			poke()
		}
		return storeStatusOf(t, tc, prefix)
	}, ok)
}

// The status shows when the reconciler last reached the store and the errors
// since the store started, on the memory store and on Redis; when Redis is
// killed the error counts grow and the last sync ages.
func TestAdminStatusShowsSyncAgeAndErrors(t *testing.T) {
	srv := redistest.Start(t)
	enginePool := []struct{ name, prefix, global string }{
		{"memory", "statusmem", "fleetguard {\n prefix statusmem\n sync_interval 50ms\n }"},
		{"redis", "statusredis", "fleetguard {\n redis " + srv.URL() + "\n prefix statusredis\n sync_interval 50ms\n }"},
	}
	for _, sc := range enginePool {
		t.Run(sc.name, func(t *testing.T) {
			up := newFakeLLM(t)
			port := freePort(t)
			url := fmt.Sprintf("http://127.0.0.1:%d", port)
			tc := startCaddy(t, statusCaddyfile(port, up.URL, sc.global))
			request := func() int {
				resp, _ := chat(t, url, chatBody, "X-API-Key: status-secret-key")
				return resp.StatusCode
			}

			st := storeStatusOf(t, tc, sc.prefix)
			// A Redis store is reached before any request: the instance
			// heartbeats to learn the fleet's size (see README).
			if (sc.name == "memory") != (st.LastSyncAgeMS == nil) || st.ReconcileErrors != 0 || st.BudgetStoreErrors != 0 || st.BudgetStoreDown || !slices.Equal(st.Budgets, []string{"g"}) {
				t.Fatalf("before any request: %+v, want a heartbeat on Redis only, no errors and budget g", st)
			}
			if code := request(); code != http.StatusOK {
				t.Fatalf("request: %d", code)
			}
			st = waitStatus(t, tc, sc.prefix, "a pass with the new key", func() {}, func(st storeStatus) bool { return st.LastSyncAgeMS != nil })
			if *st.LastSyncAgeMS < 0 || *st.LastSyncAgeMS > 5000 || !st.Healthy || st.ReconcileErrors != 0 || st.BudgetStoreErrors != 0 {
				t.Fatalf("after a pass: %+v", st)
			}
			_, body := get(t, "http://"+tc.admin+"/fleetguard/status")
			if strings.Contains(body, "status-secret") {
				t.Fatalf("the status shows a user key: %s", body)
			}
			if sc.name == "memory" {
				return
			}

			srv.Stop()
			if code := request(); code != http.StatusServiceUnavailable {
				t.Fatalf("a budgeted request with Redis down: %d, want 503", code)
			}
			down := waitStatus(t, tc, sc.prefix, "Redis killed", func() { request() }, func(st storeStatus) bool {
				return st.ReconcileErrors > 0 && st.BudgetStoreErrors > 0 && !st.Healthy && st.BudgetStoreDown
			})
			// The reconciler keeps failing while the key is active, and the
			// last good sync only ages.
			later := waitStatus(t, tc, sc.prefix, "more failed passes", func() { request() }, func(st storeStatus) bool {
				return st.ReconcileErrors > down.ReconcileErrors
			})
			if later.LastSyncAgeMS == nil || *later.LastSyncAgeMS <= *down.LastSyncAgeMS {
				t.Fatalf("the last sync must age while Redis is down: %v then %v ms", *down.LastSyncAgeMS, later.LastSyncAgeMS)
			}
			if resp, body := get(t, "http://"+tc.admin+budgetsPath+"g"); resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(body, "budget store is unavailable") {
				t.Fatalf("a budget read with Redis down: %d %s, want 503", resp.StatusCode, body)
			}
		})
	}
}

// A Redis that requires a password: the status names the store exactly as
// the store label of /metrics does, and neither shows the password or any
// hash of it, the one the pool compares included.
func TestAdminStatusShowsNoPassword(t *testing.T) {
	const password = "status-pw-8Zq2"
	srv := redistest.StartWith(t, "--requirepass", password)
	up := newFakeLLM(t)
	port := freePort(t)
	global := "metrics\n fleetguard {\n redis redis://:" + password + "@" + srv.Addr() + "/0\n prefix statuspw\n sync_interval 50ms\n }"
	tc := startCaddy(t, statusCaddyfile(port, up.URL, global))
	// A fleet-limit key in use makes the reconciler sync, and a sync that
	// reaches the store has logged in with the password. (What the budget
	// answers does not matter here: on a loaded machine a reserve may take
	// longer than its 100ms.)
	request := func() { chat(t, fmt.Sprintf("http://127.0.0.1:%d", port), chatBody, "X-API-Key: statuspw-key") }
	request()
	st := waitStatus(t, tc, "statuspw", "a pass that logs in", request, func(st storeStatus) bool { return st.Healthy && st.LastSyncAgeMS != nil })
	if want := "redis|" + srv.Addr() + "|0|statuspw|plain"; st.Store != want {
		t.Fatalf("status store %q, want %q", st.Store, want)
	}
	m := scrape(t, tc)
	if v, ok := metricValue(m, `fleetguard_store_healthy{component="fleetlimit",store="`+st.Store+`"}`); !ok || v != 1 {
		t.Fatalf("no healthy series with the status's store %q in /metrics:\n%s", st.Store, grepLines(m, "store_healthy"))
	}
	_, status := get(t, "http://"+tc.admin+"/fleetguard/status")
	for _, trace := range passwordTraces(password) {
		if strings.Contains(status, trace) {
			t.Fatalf("the status shows %q, the password or a hash of it: %s", trace, status)
		}
		if strings.Contains(m, trace) {
			t.Fatalf("/metrics shows %q, the password or a hash of it:\n%s", trace, grepLines(m, trace))
		}
	}
}

// passwordTraces are the password and its hashes in the forms a status could
// show: hex of keyhash (the store identity's hash; any 16 digits of it, as the
// status once showed), SHA-256 (as Redis ACLs keep it), SHA-1 and MD5.
func passwordTraces(password string) []string {
	traces := []string{password}
	kh := keyhash.Of(password).String()
	for i := 0; i+16 <= len(kh); i += 16 {
		traces = append(traces, kh[i:i+16])
	}
	sha256Sum, sha1Sum, md5Sum := sha256.Sum256([]byte(password)), sha1.Sum([]byte(password)), md5.Sum([]byte(password))
	for _, sum := range [][]byte{sha256Sum[:], sha1Sum[:], md5Sum[:]} {
		traces = append(traces, hex.EncodeToString(sum)[:16])
	}
	return traces
}
