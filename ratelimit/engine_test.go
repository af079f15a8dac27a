package ratelimit

import (
	"context"
	"math/rand/v2"
	"sort"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/window"
)

func hashOf(s string) keyhash.Hash { return keyhash.Of(s) }

func mustLimit(t testing.TB, events int64, w time.Duration, burst int64) *Limit {
	t.Helper()
	return mustLimitP(t, events, w, burst, 0)
}

func mustLimitP(t testing.TB, events int64, w time.Duration, burst int64, precision int) *Limit {
	t.Helper()
	l, err := NewLimit(events, w, burst, precision)
	if err != nil {
		t.Fatal(err)
	}
	return &l
}

// memoryEngine is a single instance on the embedded store.
func memoryEngine(t testing.TB) *Engine {
	t.Helper()
	return newEngine(t, Options{Prefix: "t", SyncInterval: 100 * time.Millisecond, Solo: true})
}

func newEngine(t testing.TB, o Options) *Engine {
	t.Helper()
	e, err := NewEngine(o)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// allow is a one-zone request.
func allow(e *Engine, z *Zone, l *Limit, key string, now int64) Verdict {
	var out [1]Verdict
	checks := [1]Check{{Zone: z, Limit: l, Key: keyhash.Of(key)}}
	e.Allow(now, checks[:], out[:])
	return out[0]
}

// count is the sum of the ring: the key's count in the window at head.
func count(ring []uint32) int64 {
	var n int64
	for _, c := range ring {
		n += int64(c)
	}
	return n
}

// stateOf reads a key's entry and ring (a copy) for a test.
func stateOf(z *Zone, key string) (entry, []uint32) {
	h := keyhash.Of(key)
	s := z.shardOf(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	en, ring := z.lookup(s, h)
	if en == nil {
		return entry{}, nil
	}
	return *en, append([]uint32(nil), ring...)
}

// leaseStateOf reads a key's lease state (a copy; zero when it has none)
// for a test.
func leaseStateOf(z *Zone, key string) leaseState {
	h := keyhash.Of(key)
	s := z.shardOf(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	if en, _ := z.lookup(s, h); en != nil && en.lease != 0 {
		return *s.lease(en)
	}
	return leaseState{}
}

func TestNewLimitRejectsBadInput(t *testing.T) {
	tests := []struct {
		name      string
		events    int64
		window    time.Duration
		burst     int64
		precision int
	}{
		{"zero events", 0, time.Second, 0, 0},
		{"negative events", -1, time.Second, 0, 0},
		{"events beyond a slot count", 1 << 33, time.Hour, 0, 0},
		{"zero window", 5, 0, 0, 0},
		{"negative burst", 5, time.Second, -1, 0},
		{"rate finer than a nanosecond", 10, 5 * time.Nanosecond, 0, 0},
		{"negative precision", 5, time.Second, 0, -1},
		{"precision over the maximum", 5, time.Second, 0, MaxPrecision + 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := NewLimit(tt.events, tt.window, tt.burst, tt.precision); err == nil {
				t.Fatal("want an error")
			}
		})
	}
	l, err := NewLimit(5, time.Second, 0, 0)
	if err != nil || l.Burst != 5 || l.Precision != DefaultPrecision {
		t.Fatalf("burst 0 means events, precision 0 the default: got %+v, %v", l, err)
	}
}

func TestGCRABurstAndExactRetryAfter(t *testing.T) {
	e := memoryEngine(t)
	// 10 per second with a burst of 3: emission interval 100ms.
	l := mustLimit(t, 10, time.Second, 3)
	z := e.Zone("z", l)
	now := time.Now().UnixNano()
	for i := 0; i < 3; i++ {
		v := allow(e, z, l, "k", now)
		if !v.Allowed || v.Remaining != int64(2-i) {
			t.Fatalf("request %d of the burst: %+v, want admitted with %d remaining", i+1, v, 2-i)
		}
	}
	v := allow(e, z, l, "k", now)
	if v.Allowed || v.Fleet || v.RetryAfter != 100*time.Millisecond {
		t.Fatalf("4th request at the same instant: %+v, want denied by the local cap, retry exactly 100ms", v)
	}
	if v := allow(e, z, l, "k", now+int64(100*time.Millisecond)-1); v.Allowed {
		t.Fatal("one nanosecond before the retry time is still denied")
	}
	if v := allow(e, z, l, "k", now+int64(100*time.Millisecond)); !v.Allowed {
		t.Fatal("at the retry time the request is admitted")
	}
}

// The window's Retry-After is exact to one slot: the request fits when the
// slot holding the oldest admits has left.
func TestWindowRetryAfterIsExactToTheSlot(t *testing.T) {
	e := memoryEngine(t)
	l := mustLimitP(t, 5, 10*time.Second, 100, 10) // 1s slots
	z := e.Zone("z", l)
	q := l.slots.Len
	start := 1000*int64(10*time.Second) + 300*int64(time.Millisecond) // 0.3s into slot 10000
	for i := 0; i < 5; i++ {
		if v := allow(e, z, l, "k", start); !v.Allowed {
			t.Fatalf("request %d denied", i+1)
		}
	}
	v := allow(e, z, l, "k", start)
	leaves := l.slots.LeavesAt(l.slots.Of(start))
	if v.Allowed || !v.Fleet || v.RetryAfter != time.Duration(leaves-start) {
		t.Fatalf("6th request: %+v, want a window denial retrying in %v", v, time.Duration(leaves-start))
	}
	if got := time.Duration(leaves - start); got != 10*time.Second+700*time.Millisecond {
		t.Fatalf("the oldest slot counts whole: retry %v, want 10.7s (at most one slot, %v, late)", got, time.Duration(q))
	}
	if v := allow(e, z, l, "k", leaves-1); v.Allowed {
		t.Fatal("just before the slot leaves, still denied")
	}
	if v := allow(e, z, l, "k", leaves); !v.Allowed {
		t.Fatal("once the slot has left, admitted")
	}
	if v := allow(e, z, l, "other", start); !v.Allowed {
		t.Fatal("another key has its own limit")
	}
}

func TestMultiZoneDenialConsumesNothing(t *testing.T) {
	e := memoryEngine(t)
	lw := mustLimit(t, 10, time.Minute, 0)
	ln := mustLimit(t, 1, time.Minute, 0)
	wide, narrow := e.Zone("wide", lw), e.Zone("narrow", ln)
	now := time.Now().UnixNano()
	checks := []Check{
		{Zone: wide, Limit: lw, Key: keyhash.Of("k")},
		{Zone: narrow, Limit: ln, Key: keyhash.Of("k")},
	}
	out := make([]Verdict, 2)
	if d := e.Allow(now, checks, out); d != -1 {
		t.Fatalf("first request denied by zone %d", d)
	}
	for i := 0; i < 5; i++ {
		if d := e.Allow(now, checks, out); d != 1 {
			t.Fatalf("request must be denied by the narrow zone, got %d", d)
		}
	}
	if _, ring := stateOf(wide, "k"); count(ring) != 1 {
		t.Fatalf("wide zone counted %d admits, want 1", count(ring))
	}
	if v := allow(e, wide, lw, "k", now); !v.Allowed || v.Remaining != 8 {
		t.Fatalf("wide zone alone: %+v, want admitted with 8 remaining", v)
	}
}

func TestAnotherWindowIsAnotherZone(t *testing.T) {
	e := memoryEngine(t)
	short := mustLimit(t, 2, time.Minute, 0)
	long := mustLimit(t, 2, time.Hour, 0)
	zs, zl := e.Zone("z", short), e.Zone("z", long)
	if zs == zl || e.Zone("z", short) != zs {
		t.Fatal("a zone is its name, window and precision")
	}
	if zs.storeKey(hashOf("k")) == zl.storeKey(hashOf("k")) {
		t.Fatal("zones of one name with other windows must not share store keys")
	}
}

// TestIdleKeysAreEvictedButNotQueuedOnes: a key idle for its idle TTL is
// dropped, unless it waits for a store call.
func TestIdleKeysAreEvictedButNotQueuedOnes(t *testing.T) {
	e := memoryEngine(t)
	l := mustLimit(t, 100, time.Second, 0)
	z := e.Zone("z", l)
	now := time.Now().UnixNano()
	allow(e, z, l, "idle", now)
	allow(e, z, l, "queued", now)
	h := keyhash.Of("queued")
	s := z.shardOf(h)
	s.mu.Lock()
	en, _ := z.lookup(s, h)
	e.enqueue(z, h, en)
	s.mu.Unlock()
	e.evict(now + int64(11*time.Minute))
	if z.Keys() != 1 {
		t.Fatalf("%d keys left after eviction, want the queued one", z.Keys())
	}
}

// request is one request of a synthetic run.
type request struct {
	at  int64
	key string
}

// patterns are request timings that defeat a two-epoch counter: bursts at
// epoch edges, an even stream, random gaps, a burst then a trickle.
func patterns(rng *rand.Rand, w time.Duration, start int64) map[string][]int64 {
	W := int64(w)
	out := map[string][]int64{}
	var edge, even, random, trickle []int64
	for k := int64(0); k < 6; k++ {
		// A burst at the end of each window and one at the start of the next.
		for i := int64(0); i < 20; i++ {
			edge = append(edge, start+(k+1)*W-W/50+i, start+(k+1)*W+i)
		}
	}
	for t := start; t < start+6*W; t += W / 23 {
		even = append(even, t)
	}
	t := start
	for i := 0; i < 400; i++ {
		t += rng.Int64N(W / 8)
		random = append(random, t)
	}
	for i := int64(0); i < 10; i++ {
		trickle = append(trickle, start+i)
	}
	for t := start + W/10; t < start+6*W; t += W * 45 / 200 {
		trickle = append(trickle, t, t+1)
	}
	out["edge bursts"], out["even"], out["random"], out["burst then trickle"] = edge, even, random, trickle
	return out
}

// One instance never admits more than events in any window, whatever the
// request pattern and whenever the reconciler runs; the README's example (5
// per 10 s on the memory store) is the first case.
func TestNoWindowEverHoldsMoreThanTheLimit(t *testing.T) {
	type setup struct {
		name      string
		events    int64
		w         time.Duration
		precision int
		opts      Options
	}
	setups := []setup{
		{"readme 5 per 10s, memory", 5, 10 * time.Second, 0, Options{Solo: true}},
		{"10 per 20s, fleet mode on one store", 10, 20 * time.Second, 0, Options{}},
		{"10 per 20s, fixed interval", 10, 20 * time.Second, 0, Options{FixedInterval: true}},
		{"7 per 3s, 3 slots", 7, 3 * time.Second, 3, Options{Solo: true}},
	}
	rng := rand.New(rand.NewPCG(7, 9))
	for _, s := range setups {
		for name, times := range patterns(rng, s.w, 1_700_000_000*int64(time.Second)) {
			t.Run(s.name+"/"+name, func(t *testing.T) {
				o := s.opts
				o.Store, o.Prefix, o.SyncInterval = newScriptStore(t), "p", 100*time.Millisecond
				e := newEngine(t, o)
				l := mustLimitP(t, s.events, s.w, 0, s.precision)
				z := e.Zone("z", l)
				var admits []int64
				nextPass := times[0]
				for _, at := range times {
					for nextPass <= at {
						e.heartbeat(context.Background(), nextPass)
						_ = e.pass(context.Background(), nextPass, false)
						_ = e.pass(context.Background(), nextPass, true)
						nextPass += int64(100*time.Millisecond) + rng.Int64N(int64(time.Second))
					}
					v := allow(e, z, l, "k", at)
					if !v.Allowed && v.Leasing {
						// As the fleetlimit handler does: the request
						// waits for the pass that asks for its grant.
						_ = e.pass(context.Background(), at, true)
						v = allow(e, z, l, "k", at)
					}
					if v.Allowed {
						admits = append(admits, at)
					}
				}
				sort.Slice(admits, func(i, j int) bool { return admits[i] < admits[j] })
				if got := window.MostInAny(admits, s.w); got > int(s.events) {
					t.Fatalf("worst window holds %d admits, limit %d", got, s.events)
				}
				if len(admits) == 0 {
					t.Fatal("nothing admitted: the test proves nothing")
				}
			})
		}
	}
}

// With a precision of 20 a client sending evenly at 95% of the limit is
// never denied.
func TestEvenlyAt95PercentIsNeverDenied(t *testing.T) {
	e := memoryEngine(t)
	l := mustLimit(t, 1000, 10*time.Second, 0)
	z := e.Zone("z", l)
	gap := int64(10*time.Second) / 950
	start := 1_700_000_000 * int64(time.Second)
	for i := int64(0); i < 950*6; i++ {
		if v := allow(e, z, l, "k", start+i*gap); !v.Allowed {
			t.Fatalf("request %d at 95%% of the limit denied: %+v", i, v)
		}
	}
}

// A pass is bounded by one interval, so a dead store is known down before the
// next pass is due; a floor spares short intervals, a ceiling long ones.
func TestPassTimeoutIsOneInterval(t *testing.T) {
	for _, tc := range []struct{ interval, want time.Duration }{
		{50 * time.Millisecond, 200 * time.Millisecond},
		{250 * time.Millisecond, 250 * time.Millisecond},
		{700 * time.Millisecond, 700 * time.Millisecond},
		{5 * time.Second, time.Second},
	} {
		if got := passTimeout(tc.interval); got != tc.want {
			t.Errorf("passTimeout(%s) = %s, want %s", tc.interval, got, tc.want)
		}
	}
}
