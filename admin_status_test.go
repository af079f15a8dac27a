package fleetguard

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/redistest"
)

// statusCaddyfile has a fleet limit and a budget in front of an upstream.
func statusCaddyfile(port int, upstream, global string) string {
	return fmt.Sprintf(`{
	admin {ADMIN}
	%s
}
:%d {
	fleetlimit {
		zone per_key {
			key {http.request.header.X-API-Key}
			events 100000
			window 1m
		}
	}
	llmbudget {
		budget g {
			limit 100000000
			window 1h
		}
	}
	reverse_proxy %s
}`, global, port, strings.TrimPrefix(upstream, "http://"))
}

// storeStatusOf is the status of the store whose identity has prefix.
func storeStatusOf(t *testing.T, tc *testCaddy, prefix string) storeStatus {
	t.Helper()
	resp, body := get(t, "http://"+tc.admin+"/fleetguard/status")
	var status struct {
		Stores []storeStatus `json:"stores"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(body), &status) != nil {
		t.Fatalf("GET /fleetguard/status: %d %s", resp.StatusCode, body)
	}
	for _, st := range status.Stores {
		if strings.Contains(st.Store, "|"+prefix) {
			return st
		}
	}
	t.Fatalf("no store with prefix %q in %s", prefix, body)
	return storeStatus{}
}

// waitStatus polls the status, calling poke between reads, until ok holds.
func waitStatus(t *testing.T, tc *testCaddy, prefix, what string, poke func(), ok func(storeStatus) bool) storeStatus {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st := storeStatusOf(t, tc, prefix)
		if ok(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: status still %+v", what, st)
		}
		poke()
		time.Sleep(50 * time.Millisecond)
	}
}

// The status shows when the reconciler last reached the store and the errors
// since the engine started, on the memory store and on Redis; when Redis is
// killed the error counts grow and the last sync ages.
func TestAdminStatusShowsSyncAgeAndErrors(t *testing.T) {
	srv := redistest.Start(t)
	stores := []struct{ name, prefix, global string }{
		{"memory", "statusmem", "fleetguard {\n prefix statusmem\n sync_interval 50ms\n }"},
		{"redis", "statusredis", "fleetguard {\n redis " + srv.URL() + "\n prefix statusredis\n sync_interval 50ms\n }"},
	}
	for _, sc := range stores {
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
			if st.LastSyncAgeMS != nil || st.ReconcileErrors != 0 || st.BudgetStoreErrors != 0 || st.BudgetStoreDown || !slices.Equal(st.Budgets, []string{"g"}) {
				t.Fatalf("before any request: %+v, want no sync yet, no errors and budget g", st)
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
