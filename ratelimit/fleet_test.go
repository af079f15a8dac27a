package ratelimit

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/internal/wait"
)

func fleetEngine(t testing.TB, s SlotStore, prefix string) *Engine {
	t.Helper()
	return newEngine(t, Options{Store: s, Prefix: prefix, SyncInterval: 100 * time.Millisecond})
}

func passNow(t testing.TB, e *Engine) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := e.pass(ctx, time.Now().UnixNano(), false); err != nil {
		t.Fatalf("reconcile: %v", err)
	}
}

// Two instances that sync between requests admit exactly the limit of every
// key, on every store; on a Cluster the keys of one pass live on several
// nodes.
func TestTwoInstancesHoldOneLimitForManyKeys(t *testing.T) {
	const keys, events = 25, 10
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			newStore := sc.setup(t)
			a, b := fleetEngine(t, newStore(t), "two"), fleetEngine(t, newStore(t), "two")
			l := mustLimit(t, events, time.Hour, 0)
			admitted := make([]int, keys)
			now := time.Now().UnixNano()
			for round := 0; round < 3*events; round++ {
				now += int64(100 * time.Millisecond) // a sync interval between requests
				served, other := a, b
				if round%2 == 1 {
					served, other = b, a
				}
				for k := 0; k < keys; k++ {
					z := served.Zone("z", l)
					if allow(served, z, l, "key"+strconv.Itoa(k), now).Allowed {
						admitted[k]++
					}
				}
				// The instance that served pushes first; the other reads after.
				for _, e := range []*Engine{served, other} {
					if err := e.pass(context.Background(), now, false); err != nil {
						t.Fatal(err)
					}
				}
			}
			for k, n := range admitted {
				if n != events {
					t.Fatalf("key %d: %d admitted across two instances, want exactly %d", k, n, events)
				}
			}
		})
	}
}

// A key new to an instance admits only a small share of its limit until its
// first read, and the read is queued at once.
func TestFirstContactAdmitsASmallShare(t *testing.T) {
	store := NewMemoryStore()
	a := fleetEngine(t, store, "first")
	l := mustLimit(t, 100, time.Hour, 0)
	z := a.Zone("z", l)
	now := time.Now().UnixNano()
	n := 0
	for i := 0; i < 50; i++ {
		if allow(a, z, l, "k", now).Allowed {
			n++
		}
	}
	if n != 10 {
		t.Fatalf("before the first read %d admitted, want 10%% of the limit (10)", n)
	}
	if plans, _ := a.claimQueued(now); len(plans) != 1 {
		t.Fatalf("%d keys queued for an early read, want the new key", len(plans))
	}
	_ = a.pass(context.Background(), now, false)
	if v := allow(a, z, l, "k", now); !v.Allowed {
		t.Fatalf("after the read the key has its whole limit again: %+v", v)
	}
}

// When the fleet's headroom is small against its demand, an instance admits
// only its share of the headroom until the next read, and asks for an early
// sync; with the mechanisms off it spends all it sees.
func TestHeadroomShareNearTheLimit(t *testing.T) {
	run := func(t *testing.T, fixed bool) (admitted int, queued int) {
		store := NewMemoryStore()
		opts := Options{Store: store, Prefix: "share", SyncInterval: 100 * time.Millisecond, FixedInterval: fixed}
		a, b := newEngine(t, opts), newEngine(t, opts)
		l := mustLimit(t, 100, time.Hour, 0)
		za, zb := a.Zone("z", l), b.Zone("z", l)
		now := time.Now().UnixNano()
		// Each instance serves the key 5 times per 100 ms interval, and syncs
		// every interval, up to 90 admits: the fleet's demand is 10 per
		// interval; a, which reads before b pushes, sees a headroom of 15,
		// which two intervals of demand would spend.
		for round := 0; round < 9; round++ {
			for i := 0; i < 5; i++ {
				now += int64(10 * time.Millisecond)
				allow(a, za, l, "k", now)
				now += int64(10 * time.Millisecond)
				allow(b, zb, l, "k", now)
			}
			_ = a.pass(context.Background(), now, false)
			_ = b.pass(context.Background(), now, false)
		}
		_ = a.pass(context.Background(), now, false)
		a.claimQueued(now) // forget the early syncs asked for so far
		// a alone is hammered before its next read.
		for i := 0; i < 40; i++ {
			if allow(a, za, l, "k", now).Allowed {
				admitted++
			}
		}
		plans, _ := a.claimQueued(now)
		return admitted, len(plans)
	}
	all, _ := run(t, true)
	if all < 10 {
		t.Fatalf("with a fixed interval the instance spends the whole headroom it sees: %d, want at least 10", all)
	}
	if shared, queued := run(t, false); shared < 1 || shared > all/2+1 || queued != 1 {
		t.Fatalf("near the limit an instance with half the demand admitted %d where the whole headroom was %d (queued %d), want about half and an early sync", shared, all, queued)
	}
}

// While the store is unreachable (nothing reached it for 2 s: one failed
// pass is not an outage) an instance enforces the window on its own admits
// exactly, and does not forget them when the store returns empty.
func TestStoreOutageKeepsTheWindowOnOwnAdmits(t *testing.T) {
	srv := redistest.Start(t)
	a := fleetEngine(t, NewRedisStore(srv.Client(t)), "outage")
	l := mustLimit(t, 10, time.Hour, 0)
	z := a.Zone("z", l)
	for i := 0; i < 4; i++ {
		if !allow(a, z, l, "k", time.Now().UnixNano()).Allowed {
			t.Fatalf("request %d denied", i+1)
		}
		passNow(t, a)
	}
	srv.Stop()
	if err := a.pass(context.Background(), time.Now().UnixNano(), false); err == nil {
		t.Fatal("a pass against a stopped Redis must report the error")
	}
	if !a.Healthy() {
		t.Fatal("one failed pass right after a good one gave up on the fleet")
	}
	// Nothing reaches the store for staleAfter (2 s): the engine limits on
	// its own admits.
	wait.Until(t, 5*time.Second, "the engine to give up on the store", func() bool {
		a.heartbeat(context.Background(), time.Now().UnixMilli())
		return !a.Healthy()
	})
	n := 0
	for i := 0; i < 20; i++ {
		if allow(a, z, l, "k", time.Now().UnixNano()).Allowed {
			n++
		}
		_ = a.pass(context.Background(), time.Now().UnixNano(), false)
	}
	if n != 6 {
		t.Fatalf("during the outage %d admitted, want the 6 left of the window", n)
	}
	if err := srv.Restart(); err != nil { // empty dataset, as after a crash
		t.Fatal(err)
	}
	// go-redis re-dials a pool whose dials failed about once a second.
	wait.Until(t, 5*time.Second, "the engine's recovery when Redis is back", func() bool {
		return a.pass(context.Background(), time.Now().UnixNano(), false) == nil
	})
	if v := allow(a, z, l, "k", time.Now().UnixNano()); v.Allowed {
		t.Fatalf("after the store came back empty the instance still knows its 10 admits: %+v", v)
	}
}

// A store that stalls longer than the client's timeout may run the step late;
// it never runs it twice, and the lost step is never re-sent.
func TestStalledStoreNeverCountsTwice(t *testing.T) {
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	c := srv.Client(t)
	a := fleetEngine(t, NewRedisStore(c), "stall")
	l := mustLimit(t, 1000, time.Hour, 0)
	z := a.Zone("z", l)
	passNow(t, a) // loads the script
	for i := 0; i < 5; i++ {
		allow(a, z, l, "k", time.Now().UnixNano())
	}
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer admin.Close()
	stalled := make(chan error, 1)
	go func() { stalled <- admin.Do(context.Background(), "DEBUG", "SLEEP", "1").Err() }()
	srv.WaitStalled(t)
	if err := a.pass(context.Background(), time.Now().UnixNano(), false); err == nil {
		t.Fatal("a pass during a stall longer than the client timeout must fail")
	}
	if err := <-stalled; err != nil {
		t.Fatal(err)
	}
	stored := func() int64 {
		vals, err := admin.HGetAll(context.Background(), z.storeKey(keyhash.Of("k"))).Result()
		if err != nil {
			t.Fatal(err)
		}
		var n int64
		for f, v := range vals {
			if f != "d" {
				c, _ := strconv.ParseInt(v, 10, 64)
				n += c
			}
		}
		return n
	}
	first := stored()
	if first != 0 && first != 5 {
		t.Fatalf("after the stall the store holds %d admits, want 5 (ran late) or 0", first)
	}
	allow(a, z, l, "k", time.Now().UnixNano())
	passNow(t, a)
	if got := stored(); got != first+1 {
		t.Fatalf("after the next pass the store holds %d, want %d: the lost step must not be re-sent", got, first+1)
	}
	if _, ring := stateOf(z, "k"); count(ring) != 6 {
		t.Fatalf("the instance counts %d of its own 6 admits", count(ring))
	}
}

// Every early pass is reported to OnEarlySync (the early-syncs metric).
func TestEarlyPassesAreReported(t *testing.T) {
	var early int
	e := newEngine(t, Options{Store: NewMemoryStore(), Prefix: "early", SyncInterval: 100 * time.Millisecond,
		OnEarlySync: func() { early++ }})
	l := mustLimit(t, 100, time.Hour, 0)
	z := e.Zone("z", l)
	now := time.Now().UnixNano()
	allow(e, z, l, "k", now) // first contact queues a read
	if err := e.pass(context.Background(), now, true); err != nil {
		t.Fatal(err)
	}
	if early != 1 {
		t.Fatalf("OnEarlySync called %d times for one early pass, want 1", early)
	}
}

// A key that starts syncing pushes what this instance admitted of it on its
// floor share. If the store stalls past the client's timeout, it may run that
// push late or not at all; the push is sent again under its id, which the
// store applies once, so the key's admits count once either way (before,
// the next push sent the same admits again under no id: 31 admits counted
// 61 times when the stalled one ran late).
func TestAStalledFloorPushNeverCountsTwice(t *testing.T) {
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	c := srv.Client(t)
	store := NewRedisStore(c)
	if err := store.load(context.Background()); err != nil { // a stalled step runs late, not NOSCRIPT
		t.Fatal(err)
	}
	f := &floorFleet{t: t, store: store, l: mustLimit(t, 100, 10*time.Second, 0)}
	now := time.Now().UnixNano()
	a, _ := f.start(now), f.start(now)
	now = f.floorsTaken(now + int64(2*time.Second))
	const onFloor = 30 // three quarters of a floor share of 40: the key is queued to sync
	for range onFloor {
		if !allow(a.e, a.z, f.l, "k", now).Allowed {
			t.Fatal("denied under the floor share")
		}
	}
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer admin.Close()
	stalled := make(chan error, 1)
	go func() { stalled <- admin.Do(context.Background(), "DEBUG", "SLEEP", "1").Err() }()
	srv.WaitStalled(t)
	err := a.e.pass(context.Background(), now, true) // past the client's read timeout
	if err == nil {
		t.Fatal("an early pass during a stall longer than its timeout must fail")
	}
	if err := <-stalled; err != nil {
		t.Fatal(err)
	}
	stored := func() int64 { return storedCount(t, admin, a.z.storeKey(keyhash.Of("k"))) }
	first := stored()
	t.Logf("the stalled push: %d in the store after the stall", first)
	if first != 0 && first != onFloor {
		t.Fatalf("after the stall the store holds %d admits, want %d (ran late) or 0", first, onFloor)
	}
	now += int64(100 * time.Millisecond)
	if !allow(a.e, a.z, f.l, "k", now).Allowed {
		t.Fatal("denied after the stall")
	}
	for range 2 {
		if err := a.e.pass(context.Background(), now, true); err != nil {
			t.Fatal(err)
		}
		if err := a.e.pass(context.Background(), now, false); err != nil {
			t.Fatal(err)
		}
	}
	if got := stored(); got != onFloor+1 {
		t.Fatalf("after the next passes the store holds %d, want %d: each admit once (the stalled push had %s)", got, onFloor+1,
			map[bool]string{true: "run late", false: "not run"}[first == onFloor])
	}
}

// storedCount is what the store holds of a key in its slots (not its demand
// "d", nor the "-" fields of registrations and floor pushes).
func storedCount(t *testing.T, rc redis.UniversalClient, key string) int64 {
	t.Helper()
	vals, err := rc.HGetAll(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for field, v := range vals {
		if _, err := strconv.ParseUint(field, 10, 64); err == nil {
			c, _ := strconv.ParseInt(v, 10, 64)
			n += c
		}
	}
	return n
}
