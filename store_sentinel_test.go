package fleetguard

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// The Caddyfile option takes one URL, once; its errors quote no URL.
func TestRedisSentinelCaddyfile(t *testing.T) {
	const url = "redis://:s3cret@127.0.0.1:26379?addr=127.0.0.1:26380&master_name=mymaster&password=s3cret"
	cfg, _, err := adaptCaddyfile("{\n fleetguard {\n redis_sentinel " + url + "\n }\n}\n:0 {\n respond ok\n}")
	if err != nil {
		t.Fatal(err)
	}
	var parsed struct {
		Apps struct {
			Fleetguard App `json:"fleetguard"`
		} `json:"apps"`
	}
	if err := json.Unmarshal(cfg, &parsed); err != nil || parsed.Apps.Fleetguard.RedisSentinel != url {
		t.Fatalf("adapted to %s (%v), want apps.fleetguard.redis_sentinel = the URL", cfg, err)
	}
	for _, tt := range []struct{ name, option, want string }{
		{"set twice", "redis_sentinel " + url + "\n redis_sentinel " + url, "redis_sentinel is set twice"},
		{"two URLs", "redis_sentinel " + url + " " + url, "redis_sentinel takes one URL"},
		{"no URL", "redis_sentinel", "redis_sentinel takes one URL"},
		{"redis with two URLs", "redis " + url + " " + url, "redis takes one URL"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := adaptCaddyfile("{\n fleetguard {\n " + tt.option + "\n }\n}\n:0 {\n respond ok\n}")
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
			if strings.Contains(err.Error(), "s3cret") {
				t.Fatalf("error %q echoes a password", err)
			}
		})
	}
}

// answer is one request of a traffic run, as the client saw it.
type answer struct {
	sent, got time.Time
	status    int
	retry     string // Retry-After
	body      string
	label     string // what the request was sent as (a team)
	err       error
}

// traffic sends requests from workers goroutines until stopped, each
// waiting pause between its requests, and keeps every answer.
type traffic struct {
	stop    chan struct{}
	wg      sync.WaitGroup
	mu      sync.Mutex
	answers []answer
}

func startTraffic(workers int, pause time.Duration, send func(client *http.Client) answer) *traffic {
	tr := &traffic{stop: make(chan struct{})}
	for i := 0; i < workers; i++ {
		tr.wg.Add(1)
		go func() {
			defer tr.wg.Done()
			client := &http.Client{Timeout: 10 * time.Second}
			for {
				select {
				case <-tr.stop:
					return
				default:
				}
				a := send(client)
				tr.mu.Lock()
				tr.answers = append(tr.answers, a)
				tr.mu.Unlock()
				time.Sleep(pause) // the client's pace, which the test sets
			}
		}()
	}
	return tr
}

// count is how many answers so far satisfy keep.
func (tr *traffic) count(keep func(a answer) bool) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	n := 0
	for _, a := range tr.answers {
		if keep(a) {
			n++
		}
	}
	return n
}

func (tr *traffic) finish() []answer {
	close(tr.stop)
	tr.wg.Wait()
	return tr.answers
}

func send(client *http.Client, req *http.Request, label string) answer {
	a := answer{sent: time.Now(), label: label}
	resp, err := client.Do(req)
	a.got = time.Now()
	if err != nil {
		a.err = err
		return a
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	a.status, a.retry, a.body = resp.StatusCode, resp.Header.Get("Retry-After"), string(b)
	return a
}

// sentinelStoreHealthy reads /fleetguard/status for the Sentinel store of
// prefix.
func sentinelStoreHealthy(admin, prefix string) (healthy, found bool) {
	st, found := sentinelStoreStatus(admin, prefix)
	return st.Healthy, found
}

// sentinelStoreStatus reads the status of the Sentinel store of prefix.
func sentinelStoreStatus(admin, prefix string) (storeStatus, bool) {
	resp, err := http.Get("http://" + admin + "/fleetguard/status")
	if err != nil {
		return storeStatus{}, false
	}
	defer resp.Body.Close()
	var status struct {
		Stores []storeStatus `json:"stores"`
	}
	if json.NewDecoder(resp.Body).Decode(&status) != nil {
		return storeStatus{}, false
	}
	for _, st := range status.Stores {
		if strings.HasPrefix(st.Store, "sentinel|") && strings.Contains(st.Store, "|"+prefix+"|") {
			return st, true
		}
	}
	return storeStatus{}, false
}

// fleetSlots reads the slot counts of the one fleet-limit key under prefix
// straight from a server.
func fleetSlots(t *testing.T, srv *redistest.Server, prefix string) map[int64]int64 {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: -1})
	defer c.Close()
	ctx := context.Background()
	keys, err := c.Keys(ctx, prefix+":rl3:{*").Result()
	if err != nil || len(keys) > 1 {
		t.Fatalf("fleet keys on %s: %v %v, want at most one", srv.Addr(), keys, err)
	}
	slots := map[int64]int64{}
	if len(keys) == 0 {
		return slots
	}
	fields, err := c.HGetAll(ctx, keys[0]).Result()
	if err != nil {
		t.Fatal(err)
	}
	for f, v := range fields {
		if f[0] < '0' || f[0] > '9' {
			continue // grants ("g…") and the slots' marks ("p…")
		}
		slots[mustInt(t, f)] = mustInt(t, v)
	}
	return slots
}

// worstWindow is the most admitted requests that surely fell, on the
// server, into one interval of length window: requests sent at or after its
// start and answered by its end.
func worstWindow(admitted []answer, window time.Duration) int {
	sort.Slice(admitted, func(i, j int) bool { return admitted[i].sent.Before(admitted[j].sent) })
	worst := 0
	for i, first := range admitted {
		end, n := first.sent.Add(window), 0
		for _, a := range admitted[i:] {
			if a.sent.After(end) {
				break
			}
			if !a.got.After(end) {
				n++
			}
		}
		worst = max(worst, n)
	}
	return worst
}

// A fleet limit on a Sentinel-managed Redis while the master is killed
// (SIGKILL) under steady traffic: every request is answered (the limit is
// per instance while the store is away), the reconciler finds the promoted
// replica and syncs to it, the status turns healthy again, and no interval
// of the window ever admits more than the limit (one instance: its own
// admits count in full whether the store is reachable or not).
func TestFleetLimitAcrossSentinelFailover(t *testing.T) {
	const (
		events = 60
		window = 4 * time.Second
		slot   = window / 20 // the default precision
		prefix = "sfleet"
	)
	s := redistest.StartSentinel(t, 3)
	port := freePort(t)
	tc := startCaddy(t, testCaddyfile{Port: port,
		Global:     []string{fmt.Sprintf("fleetguard {\n redis_sentinel %s\n prefix %s\n sync_interval 50ms\n }", s.URL(), prefix)},
		FleetLimit: []string{fmt.Sprintf("zone failover {\n key {http.request.header.X-API-Key}\n events %d\n window %s\n }", events, window)},
	}.String())
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)

	// About 20 requests/s for one key, against a limit of 15/s: once the
	// window is full, admits go on at the pace old ones leave it.
	tr := startTraffic(1, 45*time.Millisecond, func(c *http.Client) answer {
		req, _ := http.NewRequest(http.MethodGet, url, nil)
		req.Header.Set("X-API-Key", "k")
		return send(c, req, "")
	})
	sum := func(slots map[int64]int64, from int64) (n int64) {
		for s, c := range slots {
			if s >= from {
				n += c
			}
		}
		return n
	}
	eventually(t, 5*time.Second, "counts on the master", func() bool { return sum(fleetSlots(t, s.Master, prefix), 0) > 0 })
	eventually(t, 2*window, "a full window", func() bool {
		return tr.count(func(a answer) bool { return a.status == http.StatusTooManyRequests }) > 0
	})

	// Watch the status through the outage: failed syncs, and whether the
	// instance gave up on the fleet (only once nothing reached the store
	// for 2 s: a quick failover need not show it).
	before, _ := sentinelStoreStatus(tc.admin, prefix)
	var unhealthy, failed atomic.Int64 // polls that saw the store unhealthy; failed syncs since the kill
	watchDone := make(chan struct{})
	stopWatch := make(chan struct{})
	go func() {
		defer close(watchDone)
		for {
			select {
			case <-stopWatch:
				return
			case <-time.After(25 * time.Millisecond):
			}
			if st, found := sentinelStoreStatus(tc.admin, prefix); found {
				if !st.Healthy {
					unhealthy.Add(1)
				}
				failed.Store(int64(st.ReconcileErrors - before.ReconcileErrors))
			}
		}
	}()

	from := s.Master.Addr()
	killed := time.Now()
	s.Master.Stop()
	promoted, err := s.AwaitFailover(from, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	promotedAt := time.Now()
	// The reconciler pushes to the new master: a slot that began after the
	// promotion holds counts there.
	after := int64(promotedAt.UnixNano()/int64(slot)) + 1
	eventually(t, 10*time.Second, "counts on the promoted replica", func() bool { return sum(fleetSlots(t, promoted, prefix), after) > 0 })
	recovered := time.Now()
	// What the store kept of the outage: pushes that failed are dropped,
	// never re-sent (reported, not asserted: the instance counts its own).
	outageSlots := fleetSlots(t, promoted, prefix)
	eventually(t, 5*time.Second, "a healthy status", func() bool { h, _ := sentinelStoreHealthy(tc.admin, prefix); return h })
	close(stopWatch)
	<-watchDone

	// One more window, all of it after the recovery, then a last sync: the
	// traffic of a window is what the test measures, so it sleeps that long.
	time.Sleep(window + 2*slot)
	answers := tr.finish()
	// The last admits are pushed by the first pass after the grant they
	// were made on ends (a grant lives half a window at most).
	finished := time.Now()
	eventually(t, 5*time.Second, "a pass after the last grant", func() bool {
		st := storeStatusOf(t, tc, prefix)
		return st.LastSyncAgeMS != nil && time.Duration(*st.LastSyncAgeMS)*time.Millisecond < time.Since(finished)-window/2-100*time.Millisecond
	})
	readAt := time.Now()
	final := fleetSlots(t, promoted, prefix)

	killSlot, recoveredSlot := killed.UnixNano()/int64(slot), recovered.UnixNano()/int64(slot)
	var storedOutage int64
	for s, c := range outageSlots {
		if s > killSlot && s < recoveredSlot {
			storedOutage += c
		}
	}
	var admitted []answer
	var duringOutage, inOutageSlots int
	for _, a := range answers {
		if a.err != nil || (a.status != http.StatusOK && a.status != http.StatusTooManyRequests) {
			t.Fatalf("a request sent %s after the kill: %d %v, want 200 or 429", a.sent.Sub(killed), a.status, a.err)
		}
		if a.status == http.StatusOK {
			admitted = append(admitted, a)
			if !a.sent.Before(killed) && a.got.Before(recovered) {
				duringOutage++
			}
			if a.sent.UnixNano()/int64(slot) > killSlot && a.got.UnixNano()/int64(slot) < recoveredSlot {
				inOutageSlots++
			}
		}
	}
	if failed.Load() == 0 {
		t.Fatal("the status never showed a failed sync: the kill did not cut the store off")
	}
	if duringOutage == 0 {
		t.Fatal("nothing was admitted while the store was away: the limit must hold per instance, not fail closed")
	}
	if worst := worstWindow(admitted, window); worst > events {
		t.Fatalf("%d admitted in one window of %s, limit %d", worst, window, events)
	} else {
		t.Logf("%d requests, %d admitted (%d during the outage), worst window %d of %d; failover %s, store back %s after the kill, %d failed syncs, unhealthy for %d status polls; the new master holds %d for the slots of the outage, where %d were admitted",
			len(answers), len(admitted), duringOutage, worst, events, promotedAt.Sub(killed).Round(time.Millisecond),
			recovered.Sub(killed).Round(time.Millisecond), failed.Load(), unhealthy.Load(), storedOutage, inOutageSlots)
	}

	// The window at readAt lies wholly after the recovery: the new master
	// holds exactly what was admitted in it (a request surely in it was sent
	// after its start; one that may be was answered after it, or one slot
	// before it, as an admit is pushed in its slot or the next).
	oldest := readAt.UnixNano()/int64(slot) - 20
	start := time.Unix(0, oldest*int64(slot))
	if !start.After(recovered) {
		t.Fatalf("the last window starts at %s, before the recovery at %s", start, recovered)
	}
	var surely, maybe int64
	for _, a := range admitted {
		if !a.sent.Before(start) {
			surely++
		}
		if !a.got.Before(start.Add(-slot)) {
			maybe++
		}
	}
	if got := sum(final, oldest); got < surely || got > maybe {
		t.Fatalf("the new master counts %d in the last window, want what was admitted in it: %d to %d", got, surely, maybe)
	}
}

// An LLM budget on a Sentinel-managed Redis while the master is killed
// under steady traffic: while the store is away reserves fail fast (503
// with Retry-After, nothing forwarded unbudgeted), they work again on the
// promoted replica, and its counter of what was sent after the kill equals
// the usage of the admitted requests exactly. What was charged just before
// the kill may be lost if the replica had not received it yet
// (replication is asynchronous); the test reports it.
func TestLLMBudgetAcrossSentinelFailover(t *testing.T) {
	const prefix = "sbudget"
	s := redistest.StartSentinel(t, 3)
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, llmCaddyfile(port, up.URL, "fleetguard {\n redis_sentinel "+s.URL()+"\n prefix "+prefix+"\n }", `budget per_team {
			scope team
			limit 100000000
			window 1h
			unit tokens
		}`))

	resolved := func() map[string]float64 {
		m := map[string]float64{}
		for _, ko := range [][2]string{{"settle", "applied"}, {"settle", "applied_before"}, {"settle", "failed"}, {"reserve", "released"}, {"reserve", "cancelled"}, {"reserve", "failed"}} {
			m[ko[0]+" "+ko[1]] = testutil.ToFloat64(metrics.llmResolved.WithLabelValues(ko[0], ko[1]))
		}
		return m
	}
	resolvedBefore := resolved()
	var team atomic.Value
	team.Store("before")
	tr := startTraffic(4, 10*time.Millisecond, func(c *http.Client) answer {
		label := team.Load().(string)
		req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(chatBody))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Team", label)
		return send(c, req, label)
	})
	admittedAs := func(label string, since time.Time) func(answer) bool {
		return func(a answer) bool { return a.label == label && a.status == http.StatusOK && !a.sent.Before(since) }
	}
	eventually(t, 10*time.Second, "admitted requests", func() bool { return tr.count(admittedAs("before", time.Time{})) >= 20 })

	from := s.Master.Addr()
	killed := time.Now()
	s.Master.Stop()
	team.Store("after") // sent after the kill: reserved on the new master or not at all
	promoted, err := s.AwaitFailover(from, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	promotedAt := time.Now()
	eventually(t, 10*time.Second, "requests admitted after the failover", func() bool { return tr.count(admittedAs("after", promotedAt)) >= 20 })
	answers := tr.finish()

	counted := map[string]struct{ admitted, unavailable int }{}
	var answeredInOutage int
	var slowest503 time.Duration
	for _, a := range answers {
		c := counted[a.label]
		switch {
		case a.err != nil:
			t.Fatalf("a request sent %s after the kill: %v", a.sent.Sub(killed), a.err)
		case a.status == http.StatusOK:
			c.admitted++
		case a.status == http.StatusServiceUnavailable:
			c.unavailable++
			if a.retry == "" || decodeError(t, a.body).Error.Code != "budget_store_unavailable" {
				t.Fatalf("a 503 with Retry-After %q and body %s", a.retry, a.body)
			}
			if a.got.Before(promotedAt) {
				answeredInOutage++
			}
			slowest503 = max(slowest503, a.got.Sub(a.sent))
		default:
			t.Fatalf("a request sent %s after the kill: %d %s, want 200 or 503", a.sent.Sub(killed), a.status, a.body)
		}
		counted[a.label] = c
	}
	if answeredInOutage == 0 {
		t.Fatalf("%+v: no 503 answered during the outage; reserves must fail fast while the store is away", counted)
	}

	rc := redis.NewClient(&redis.Options{Addr: promoted.Addr()})
	defer rc.Close()
	teamCounter := func(label string) int64 {
		return sumCounters(t, rc, prefix+":bg:{b}:per_team:team-"+keyhash.Of(label).String()+":*")
	}
	// Reserves whose reply the kill cut off are released in the background.
	want := int64(counted["after"].admitted) * 100
	eventuallyValue(t, 10*time.Second, fmt.Sprintf("the new master counting %d for the requests sent after the kill: the usage of the %d admitted (%d answered 503)",
		want, counted["after"].admitted, counted["after"].unavailable), func() int64 { return teamCounter("after") },
		func(n int64) bool { return n == want })
	before, charged := teamCounter("before"), int64(counted["before"].admitted)*100
	var resolutions []string
	for k, v := range resolved() {
		if n := v - resolvedBefore[k]; n > 0 {
			resolutions = append(resolutions, fmt.Sprintf("%s %v", k, n))
		}
	}
	sort.Strings(resolutions)
	t.Logf("failover in %s; after the kill: %d admitted, %d answered 503 (%d before the promotion, slowest in %s); before the kill: %d admitted, %d answered 503, %d charged, %d on the promoted replica (%+d: %s); background resolutions: %v",
		promotedAt.Sub(killed).Round(time.Millisecond), counted["after"].admitted, counted["after"].unavailable, answeredInOutage,
		slowest503.Round(time.Millisecond), counted["before"].admitted, counted["before"].unavailable, charged, before, before-charged, replicationNote(before-charged), resolutions)
	// Each request admitted before the kill counts 100 on the new master, or
	// 0 if its reserve never reached the replica, or 205 if its reserve did
	// and its settle did not; a 503 whose reserve had run is released.
	if before > int64(counted["before"].admitted+counted["before"].unavailable)*205 {
		t.Fatalf("the new master counts %d for the %d requests sent before the kill: more than they could have reserved", before, counted["before"].admitted)
	}
}

func replicationNote(diff int64) string {
	switch {
	case diff == 0:
		return "nothing lost"
	case diff < 0:
		return "charges the replica had not received are lost"
	}
	return "settles the replica had not received left reservations standing"
}
