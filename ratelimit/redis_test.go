package ratelimit

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/window"
)

func redisClient(t testing.TB, srv *redistest.Server) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr(), DialTimeout: 200 * time.Millisecond, MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func redisEngine(t testing.TB, srv *redistest.Server, prefix string) *Engine {
	t.Helper()
	return engineOn(t, redisClient(t, srv), prefix)
}

func engineOn(t testing.TB, c redis.UniversalClient, prefix string) *Engine {
	t.Helper()
	e, err := NewEngine(Options{Store: NewRedisStore(c), Prefix: prefix, SyncInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func reconcile(t testing.TB, e *Engine) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := e.Reconcile(ctx); err != nil {
		t.Fatalf("reconcile: %v", err)
	}
}

func counterValue(t testing.TB, c redis.UniversalClient, e *Engine, zone, key string, epoch int64) int64 {
	t.Helper()
	p := plan{zone: &Zone{name: zone}, entry: &entry{hash: keyhash.Of(key)}}
	v, err := c.Get(context.Background(), e.counterKey(&p, epoch)).Int64()
	if err == redis.Nil {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestTwoInstancesEnforceOneCombinedLimit(t *testing.T) {
	srv := redistest.Start(t)
	testCombinedLimit(t, func() redis.UniversalClient { return redisClient(t, srv) })
}

// TestTwoInstancesOnRedisCluster runs the same on a 3-node cluster: pushes
// are one MULTI/EXEC per slot and reads pipelined GETs, never a cross-slot
// command.
func TestTwoInstancesOnRedisCluster(t *testing.T) {
	c := redistest.StartCluster(t)
	testCombinedLimit(t, func() redis.UniversalClient {
		cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
		t.Cleanup(func() { _ = cc.Close() })
		return cc
	})
}

func testCombinedLimit(t *testing.T, newClient func() redis.UniversalClient) {
	a := engineOn(t, newClient(), "combined")
	b := engineOn(t, newClient(), "combined")
	l := mustLimit(t, 10, time.Hour, 0)
	za, zb := a.Zone("api"), b.Zone("api")
	admitted := 0
	// An instance that has never seen a key has no estimate for it and admits
	// its first request on its own view (the documented first-contact lag).
	// Here both have seen the key before the traffic starts.
	za.lookup(keyhash.Of("user"), time.Now().UnixNano(), l.Window)
	zb.lookup(keyhash.Of("user"), time.Now().UnixNano(), l.Window)
	// Alternate between the instances. After each request the instance that
	// served it pushes, then the other reads: a fleet whose sync is faster than
	// its traffic, so the combined limit holds exactly (a slower sync overshoots
	// by at most one interval of the other instance's traffic).
	for i := 0; i < 30; i++ {
		e, z, other := a, za, b
		if i%2 == 1 {
			e, z, other = b, zb, a
		}
		if v := allow(e, z, l, "user", time.Now().UnixNano()); v.Allowed {
			admitted++
		}
		reconcile(t, e)
		reconcile(t, other)
	}
	if admitted != 10 {
		t.Fatalf("admitted %d across two instances, want exactly the combined limit 10", admitted)
	}
	c := newClient()
	ep := window.Epoch(time.Now().UnixNano(), l.Window)
	if got := counterValue(t, c, a, "api", "user", ep); got != 10 {
		t.Fatalf("shared counter = %d, want 10", got)
	}
}

func TestCarryoverLandsInItsOwnEpoch(t *testing.T) {
	srv := redistest.Start(t)
	e := redisEngine(t, srv, "carry")
	z := e.Zone("z")
	l := mustLimit(t, 100, time.Hour, 0)
	now := time.Now().UnixNano()
	earlier := now - int64(time.Hour)
	for i := 0; i < 3; i++ {
		allow(e, z, l, "k", earlier)
	}
	allow(e, z, l, "k", now) // rolls the key: 3 owed to the previous epoch
	reconcile(t, e)
	c := redisClient(t, srv)
	cur := window.Epoch(now, l.Window)
	if got := counterValue(t, c, e, "z", "k", cur-1); got != 3 {
		t.Fatalf("previous epoch counter = %d, want the 3 carried-over admits", got)
	}
	if got := counterValue(t, c, e, "z", "k", cur); got != 1 {
		t.Fatalf("current epoch counter = %d, want 1", got)
	}
	en := z.lookup(keyhash.Of("k"), now, l.Window)
	if en.carry != 0 || en.inflight != 0 {
		t.Fatalf("carryover not cleared after the push: carry %d inflight %d", en.carry, en.inflight)
	}
}

func TestEstimateRefreshesWithoutLocalDeltas(t *testing.T) {
	srv := redistest.Start(t)
	e := redisEngine(t, srv, "refresh")
	z := e.Zone("z")
	l := mustLimit(t, 5, time.Hour, 0)
	now := time.Now().UnixNano()
	en := z.lookup(keyhash.Of("k"), now, l.Window)
	en.mu.Lock()
	en.remote, en.estimateAt = 99, now // a stale-high view of the fleet
	en.mu.Unlock()
	if v := allow(e, z, l, "k", now); v.Allowed {
		t.Fatal("the high estimate denies")
	}
	reconcile(t, e) // the key was gated, so it is read although it pushed nothing
	if en.remote != 0 {
		t.Fatalf("estimate = %d after a pass, want the store's 0", en.remote)
	}
	if v := allow(e, z, l, "k", time.Now().UnixNano()); !v.Allowed {
		t.Fatal("the key recovers once the estimate is refreshed")
	}
}

func TestRepeatedReconcileNeverPushesTwice(t *testing.T) {
	srv := redistest.Start(t)
	e := redisEngine(t, srv, "twice")
	z := e.Zone("z")
	l := mustLimit(t, 100, time.Hour, 0)
	now := time.Now().UnixNano()
	allow(e, z, l, "k", now)
	allow(e, z, l, "k", now)
	for i := 0; i < 3; i++ {
		reconcile(t, e)
	}
	if got := counterValue(t, redisClient(t, srv), e, "z", "k", window.Epoch(now, l.Window)); got != 2 {
		t.Fatalf("shared counter = %d after three passes, want 2", got)
	}
}

func TestRedisOutageDegradesAndRecovers(t *testing.T) {
	srv := redistest.Start(t)
	a := redisEngine(t, srv, "outage")
	b := redisEngine(t, srv, "outage")
	l := mustLimit(t, 4, time.Hour, 0)
	za, zb := a.Zone("z"), b.Zone("z")
	now := time.Now().UnixNano()
	for i := 0; i < 4; i++ {
		allow(a, za, l, "k", now)
	}
	reconcile(t, a)
	reconcile(t, b) // b has never seen the key: nothing to read yet
	// b's first contact with the key admits on its own view, then its pass
	// reads a's admits and the fleet limit holds.
	allow(b, zb, l, "k", now)
	reconcile(t, b)
	if v := allow(b, zb, l, "k", now); v.Allowed {
		t.Fatal("with Redis up, b sees a's admits and denies")
	}

	srv.Stop()
	if err := b.Reconcile(context.Background()); err == nil {
		t.Fatal("a pass against a stopped Redis must report the error")
	}
	if b.Healthy() {
		t.Fatal("the engine must know the store is down")
	}
	// Requests are still decided, locally, with no error. Once the estimate is
	// older than max(4 x interval, 2s) the fleet view is ignored.
	later := time.Now().Add(2100 * time.Millisecond).UnixNano()
	if v := allow(b, zb, l, "fresh-key", later); !v.Allowed {
		t.Fatal("a new key is admitted on the per-instance limit during an outage")
	}
	if v := allow(b, zb, l, "k", later); !v.Allowed {
		t.Fatalf("with the fleet estimate stale, b limits on its own admits only: %+v", v)
	}

	srv.Restart() // empty dataset, as after a crash
	allow(a, za, l, "k", time.Now().UnixNano())
	reconcile(t, a)
	reconcile(t, b)
	if !b.Healthy() {
		t.Fatal("the engine recovers by itself when Redis is back")
	}
	en := zb.lookup(keyhash.Of("k"), now, l.Window)
	en.mu.Lock()
	fresh := en.estimateAt > later-int64(2100*time.Millisecond)
	en.mu.Unlock()
	if !fresh {
		t.Fatal("the estimate is refreshed after recovery")
	}
}

func TestReconcileAgainstRedisIsAtomicPerBatch(t *testing.T) {
	srv := redistest.Start(t)
	e := redisEngine(t, srv, "batch")
	z := e.Zone("z")
	l := mustLimit(t, 1000, time.Hour, 0)
	now := time.Now().UnixNano()
	for i := 0; i < 50; i++ {
		allow(e, z, l, "k"+strconv.Itoa(i%5), now)
	}
	reconcile(t, e)
	c := redisClient(t, srv)
	ep := window.Epoch(now, l.Window)
	var total int64
	for i := 0; i < 5; i++ {
		total += counterValue(t, c, e, "z", "k"+strconv.Itoa(i), ep)
		ttl, err := c.PTTL(context.Background(), e.counterKey(&plan{zone: z, entry: &entry{hash: keyhash.Of("k" + strconv.Itoa(i))}}, ep)).Result()
		if err != nil || ttl <= time.Hour || ttl > 2*time.Hour {
			t.Fatalf("counter TTL = %v (%v), want about two windows", ttl, err)
		}
	}
	if total != 50 {
		t.Fatalf("pushed %d admits, want 50", total)
	}
}
