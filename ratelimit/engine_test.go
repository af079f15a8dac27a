package ratelimit

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

func mustLimit(t testing.TB, events int64, w time.Duration, burst int64) *Limit {
	t.Helper()
	l, err := NewLimit(events, w, burst)
	if err != nil {
		t.Fatal(err)
	}
	return &l
}

func memoryEngine(t testing.TB) *Engine {
	t.Helper()
	e, err := NewEngine(Options{Store: NewMemoryStore(), Prefix: "t", SyncInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// allow is a one-zone request.
func allow(e *Engine, z *Zone, l *Limit, key string, now int64) Verdict {
	var out [1]Verdict
	checks := [1]Check{{Zone: z, Limit: l, Key: keyhash.Of(key)}}
	if _, err := e.Allow(now, checks[:], out[:]); err != nil {
		panic(err)
	}
	return out[0]
}

func TestNewLimitRejectsBadInput(t *testing.T) {
	tests := []struct {
		name   string
		events int64
		window time.Duration
		burst  int64
	}{
		{"zero events", 0, time.Second, 0},
		{"negative events", -1, time.Second, 0},
		{"zero window", 5, 0, 0},
		{"negative burst", 5, time.Second, -1},
		{"rate finer than a nanosecond", 10, 5 * time.Nanosecond, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := NewLimit(tt.events, tt.window, tt.burst); err == nil {
				t.Fatal("want an error")
			}
		})
	}
	l, err := NewLimit(5, time.Second, 0)
	if err != nil || l.Burst != 5 {
		t.Fatalf("burst 0 means events: got %+v, %v", l, err)
	}
}

func TestGCRABurstAndExactRetryAfter(t *testing.T) {
	e := memoryEngine(t)
	z := e.Zone("z")
	// 10 per second with a burst of 3: emission interval 100ms.
	l := mustLimit(t, 10, time.Second, 3)
	now := time.Now().UnixNano()
	for i := 0; i < 3; i++ {
		v := allow(e, z, l, "k", now)
		if !v.Allowed {
			t.Fatalf("request %d of the burst denied", i+1)
		}
		if v.Remaining != int64(2-i) {
			t.Fatalf("request %d: remaining %d, want %d", i+1, v.Remaining, 2-i)
		}
	}
	v := allow(e, z, l, "k", now)
	if v.Allowed || v.Fleet {
		t.Fatalf("4th request at the same instant must be denied by the local cap: %+v", v)
	}
	if v.RetryAfter != 100*time.Millisecond {
		t.Fatalf("retry after %v, want exactly 100ms", v.RetryAfter)
	}
	if v := allow(e, z, l, "k", now+int64(100*time.Millisecond)-1); v.Allowed {
		t.Fatal("one nanosecond before the retry time is still denied")
	}
	if v := allow(e, z, l, "k", now+int64(100*time.Millisecond)); !v.Allowed {
		t.Fatal("at the retry time the request is admitted")
	}
}

func TestFleetCapCountsLocalAdmits(t *testing.T) {
	e := memoryEngine(t)
	z := e.Zone("z")
	l := mustLimit(t, 5, time.Minute, 100) // burst larger than events: the fleet cap decides
	now := time.Now().UnixNano()
	for i := 0; i < 5; i++ {
		if v := allow(e, z, l, "k", now); !v.Allowed {
			t.Fatalf("request %d denied", i+1)
		}
	}
	v := allow(e, z, l, "k", now)
	if v.Allowed || !v.Fleet || v.RetryAfter <= 0 {
		t.Fatalf("6th request must be denied by the fleet cap with a retry time: %+v", v)
	}
	if v := allow(e, z, l, "other", now); !v.Allowed {
		t.Fatal("another key has its own limit")
	}
}

func TestMultiZoneDenialConsumesNothing(t *testing.T) {
	e := memoryEngine(t)
	wide, narrow := e.Zone("wide"), e.Zone("narrow")
	lw := mustLimit(t, 10, time.Minute, 0)
	ln := mustLimit(t, 1, time.Minute, 0)
	now := time.Now().UnixNano()
	checks := []Check{
		{Zone: wide, Limit: lw, Key: keyhash.Of("k")},
		{Zone: narrow, Limit: ln, Key: keyhash.Of("k")},
	}
	out := make([]Verdict, 2)
	if d, _ := e.Allow(now, checks, out); d != -1 {
		t.Fatalf("first request denied by zone %d", d)
	}
	for i := 0; i < 5; i++ {
		if d, _ := e.Allow(now, checks, out); d != 1 {
			t.Fatalf("request must be denied by the narrow zone, got %d", d)
		}
	}
	// The wide zone saw one admitted request, not six.
	en := wide.lookup(keyhash.Of("k"), now, lw.Window)
	if en.local != 1 {
		t.Fatalf("wide zone recorded %d admits, want 1", en.local)
	}
	if v := allow(e, wide, lw, "k", now); !v.Allowed || v.Remaining != 8 {
		t.Fatalf("wide zone alone: %+v, want admitted with 8 remaining", v)
	}
}

func TestWindowChangeResetsKey(t *testing.T) {
	e := memoryEngine(t)
	z := e.Zone("z")
	now := time.Now().UnixNano()
	short := mustLimit(t, 2, time.Minute, 0)
	allow(e, z, short, "k", now)
	allow(e, z, short, "k", now)
	if v := allow(e, z, short, "k", now); v.Allowed {
		t.Fatal("limit of 2 reached")
	}
	long := mustLimit(t, 2, time.Hour, 0)
	if v := allow(e, z, long, "k", now); !v.Allowed {
		t.Fatal("a new window is a new accounting unit: the key starts over")
	}
}

func TestMaxKeysFallsBackToLocalCap(t *testing.T) {
	e := memoryEngine(t)
	z := e.Zone("z")
	z.SetMaxKeys(2)
	l := mustLimit(t, 3, time.Minute, 0)
	now := time.Now().UnixNano()
	for i := 0; i < 3; i++ {
		allow(e, z, l, "k"+strconv.Itoa(i), now)
	}
	if z.Keys() != 2 {
		t.Fatalf("fleet-tracked keys = %d, want the cap 2", z.Keys())
	}
	over := z.lookup(keyhash.Of("k2"), now, l.Window)
	if over.fleet {
		t.Fatal("a key past max_keys must not be fleet-tracked")
	}
	// Its local cap still holds.
	allow(e, z, l, "k2", now)
	allow(e, z, l, "k2", now)
	if v := allow(e, z, l, "k2", now); v.Allowed {
		t.Fatal("the local cap still limits a key past max_keys")
	}
	plans := e.claim(now)
	for _, p := range plans {
		if p.entry == over {
			t.Fatal("a key past max_keys is never pushed")
		}
	}
}

func TestIdleKeysAreNotRereadAndAreEvicted(t *testing.T) {
	e := memoryEngine(t)
	z := e.Zone("z")
	l := mustLimit(t, 100, time.Second, 0)
	now := time.Now().UnixNano()
	allow(e, z, l, "busy", now)
	allow(e, z, l, "idle", now)
	first := e.claim(now)
	if len(first) != 2 {
		t.Fatalf("first pass plans %d keys, want 2", len(first))
	}
	e.settleInflight(first)
	// Past the estimate's lifetime, only the key requested since is read.
	then := now + e.staleAfter()
	allow(e, z, l, "busy", then)
	plans := e.claim(then)
	if len(plans) != 1 || plans[0].entry.hash != keyhash.Of("busy") {
		t.Fatalf("a later pass must plan only the key requested recently: %d plans", len(plans))
	}
	e.settleInflight(plans)
	// Past the idle TTL both keys go (nothing pending).
	later := now + int64(11*time.Minute)
	e.evict(later)
	if z.Keys() != 0 {
		t.Fatalf("idle keys left after eviction: %d", z.Keys())
	}
}

func TestEvictionKeepsPendingAdmits(t *testing.T) {
	e := memoryEngine(t)
	z := e.Zone("z")
	l := mustLimit(t, 100, time.Second, 0)
	now := time.Now().UnixNano()
	allow(e, z, l, "k", now)
	e.evict(now + int64(time.Hour))
	if z.Keys() != 1 {
		t.Fatal("a key with unpushed admits must never be evicted")
	}
}

func TestRollKeepsUnclaimedAdmitsAsCarryover(t *testing.T) {
	w := time.Minute
	start := int64(10 * w)
	en := newEntry(keyhash.Of("k"), true, start, w)
	en.local = 5
	en.touch(start+int64(w), w)
	if en.carry != 5 || en.carryEpoch != 10 || en.local != 0 || en.epoch != 11 {
		t.Fatalf("after one roll: %+v", en)
	}
	// A second roll before any reconcile keeps only the newer epoch.
	en.local = 4
	en.touch(start+2*int64(w), w)
	if en.carry != 4 || en.carryEpoch != 11 {
		t.Fatalf("after two rolls: carry %d owed to %d, want 4 owed to 11", en.carry, en.carryEpoch)
	}
}

func TestMemoryStoreReconcile(t *testing.T) {
	e := memoryEngine(t)
	z := e.Zone("z")
	l := mustLimit(t, 5, time.Hour, 0)
	now := time.Now().UnixNano()
	for i := 0; i < 3; i++ {
		allow(e, z, l, "k", now)
	}
	if err := e.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	en := z.lookup(keyhash.Of("k"), now, l.Window)
	if en.local != 0 || en.inflight != 0 || en.remote != 3 {
		t.Fatalf("after a pass: local %d inflight %d remote %d, want 0 0 3", en.local, en.inflight, en.remote)
	}
	allow(e, z, l, "k", now)
	allow(e, z, l, "k", now)
	if v := allow(e, z, l, "k", now); v.Allowed {
		t.Fatal("3 reconciled + 2 local = the limit of 5")
	}
}

func TestFleetRetryAfter(t *testing.T) {
	w := 10 * time.Second
	base := int64(1000 * w) // an epoch boundary
	tests := []struct {
		name             string
		elapsed          time.Duration
		prev, used, over int64
		want             time.Duration
	}{
		// 10 in the previous epoch, none in this one, at the boundary: one
		// event of the previous epoch decays every second.
		{"previous decays", 0, 10, 10, 1, time.Second},
		{"previous decays for two", 0, 10, 10, 2, 2 * time.Second},
		// All 5 in the current epoch, 2s in: nothing decays until the
		// boundary (8s), then the 5 decay one per 2s.
		{"current waits for the boundary", 2 * time.Second, 0, 5, 1, 10 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			en := &entry{window: w, remotePrev: tt.prev}
			got := time.Duration(en.fleetRetryAfter(base+int64(tt.elapsed), tt.used, tt.over))
			if got != tt.want {
				t.Fatalf("retry after %v, want %v", got, tt.want)
			}
		})
	}
}
