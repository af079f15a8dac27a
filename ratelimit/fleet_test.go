package ratelimit

import (
	"context"
	"strconv"
	"strings"
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

// queue asks for a call for key, as the request path does.
func queue(e *Engine, z *Zone, key string) {
	h := keyhash.Of(key)
	s := z.shardOf(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	if en, _ := z.lookup(s, h); en != nil {
		e.enqueue(z, h, en)
	}
}

// allowSoon is a request that, denied for want of a grant, is asked again
// after the pass that fetches one.
func allowSoon(t testing.TB, e *Engine, z *Zone, l *Limit, key string) Verdict {
	t.Helper()
	v := allow(e, z, l, key, time.Now().UnixNano())
	if !v.Allowed && v.Fleet {
		passNow(t, e)
		v = allow(e, z, l, key, time.Now().UnixNano())
	}
	return v
}

// Two instances that call the store between requests admit exactly the
// limit of every key, on every store; on a Cluster the keys of one pass live
// on several nodes. A limit of 10 has no floor: every admit is leased.
func TestTwoInstancesHoldOneLimitForManyKeys(t *testing.T) {
	const keys, events = 25, 10
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			newStore := sc.setup(t)
			a, b := fleetEngine(t, newStore(t), "two"), fleetEngine(t, newStore(t), "two")
			l := mustLimit(t, events, time.Hour, 0)
			admitted := make([]int, keys)
			now := time.Now().UnixNano()
			for _, e := range []*Engine{a, b} {
				e.Zone("z", l)
				e.heartbeat(context.Background(), now)
			}
			for round := 0; round < 4*events; round++ {
				now += int64(100 * time.Millisecond)
				served := a
				if round%2 == 1 {
					served = b
				}
				for k := 0; k < keys; k++ {
					if allow(served, served.Zone("z", l), l, "key"+strconv.Itoa(k), now).Allowed {
						admitted[k]++
					}
				}
				for _, e := range []*Engine{a, b} {
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

// Keys far below their limit are admitted on each slot's floor with no store
// call: two instances, many keys, and the store holds nothing but the slot
// table.
func TestKeysUnderTheirFloorNeverTouchTheStore(t *testing.T) {
	srv := redistest.Start(t)
	l := mustLimit(t, 1000, 10*time.Second, 0) // F = 31 of 16 slots
	var engines []*Engine
	for range 2 {
		e := fleetEngine(t, NewRedisStore(srv.Client(t)), "cold")
		e.Zone("z", l)
		e.heartbeat(context.Background(), time.Now().UnixNano())
		engines = append(engines, e)
	}
	for i := range 2000 {
		e := engines[i%2]
		if v := allow(e, e.Zone("z", l), l, "key"+strconv.Itoa(i%500), time.Now().UnixNano()); !v.Allowed {
			t.Fatalf("request %d denied: %+v", i, v)
		}
	}
	for _, e := range engines {
		passNow(t, e)
	}
	keys, err := srv.Client(t).Keys(context.Background(), "cold:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if !strings.Contains(k, "{fleet}") {
			t.Fatalf("a key under its floor reached the store: %s (all: %v)", k, keys)
		}
	}
}

// A key busy on one instance goes to leases there and is named hot; another
// instance that holds it on its floor pushes its floor admits and marks its
// slot at its next pass, so the fleet no longer holds that floor back.
func TestAHotKeyReleasesTheOthersFloors(t *testing.T) {
	store := newScriptStore(t)
	l := mustLimit(t, 160, 10*time.Second, 0) // F = 5
	a, b := fleetEngine(t, store, "hot"), fleetEngine(t, store, "hot")
	za, zb := a.Zone("z", l), b.Zone("z", l)
	ctx, ms := context.Background(), int64(time.Millisecond)
	now := time.Now().UnixNano()
	a.heartbeat(ctx, now)
	b.heartbeat(ctx, now)
	allow(b, zb, l, "k", now+ms) // b holds one admit on its floor
	for range 4 {
		allow(a, za, l, "k", now+ms) // a reaches three quarters of its floor
	}
	if err := a.pass(ctx, now+ms, true); err != nil {
		t.Fatal(err)
	}
	if en, _ := stateOf(za, "k"); en.flags&flagLease == 0 {
		t.Fatal("a's key did not go to leases past three quarters of its floor")
	}
	// The room a third party sees once the key's hot period has settled.
	_, lives := b.lives(now + ms) // b heartbeat last: it knows both slots
	room := func() int64 {
		t.Helper()
		r := leaseAll(t, store, []Lease{{Key: za.storeKey(keyhash.Of("k")), Now: (now + 2*a.settle()) / 1e6, Oldest: za.slots.Oldest(now), TTL: time.Minute,
			Member: 999, Floor: 5, Events: 160, MaxInstances: 16, Settle: time.Duration(a.settle()), Gap: time.Duration(za.gap()),
			Hot: true, View: true, Lives: lives}})[0]
		return r.Room
	}
	before := room()
	a.heartbeat(ctx, now+2*ms) // names k hot
	b.heartbeat(ctx, now+3*ms) // learns it
	if v := allow(b, zb, l, "k", now+3*ms); v.Allowed || !v.Leasing {
		t.Fatalf("b admitted the hot key on its floor: %+v", v)
	}
	if err := b.pass(ctx, now+3*ms, true); err != nil {
		t.Fatal(err)
	}
	enB, _ := stateOf(zb, "k")
	lsB := leaseStateOf(zb, "k")
	if enB.flags&flagLease == 0 || lsB.block < 1 {
		t.Fatalf("b did not push its floor admits of the hot key, mark its slot and get a grant: %+v %+v", enB, lsB)
	}
	// b's floor (5) is no longer held back; its one admit is counted, and
	// its grant.
	if after := room(); after != before+5-1-lsB.block {
		t.Fatalf("room %d after b pushed, %d before: want b's floor released and its admit and grant counted", after, before)
	}
}

// While the store is unreachable (nothing reached it for 2 s: one failed
// call is not an outage) an instance enforces the window on its own admits
// exactly, and does not forget them when the store returns empty.
func TestStoreOutageKeepsTheWindowOnOwnAdmits(t *testing.T) {
	srv := redistest.Start(t)
	a := fleetEngine(t, NewRedisStore(srv.Client(t)), "outage")
	l := mustLimit(t, 10, time.Hour, 0)
	z := a.Zone("z", l)
	a.heartbeat(context.Background(), time.Now().UnixNano())
	for i := 0; i < 4; i++ {
		if !allowSoon(t, a, z, l, "k").Allowed {
			t.Fatalf("request %d denied", i+1)
		}
	}
	srv.Stop()
	queue(a, z, "k")
	if err := a.pass(context.Background(), time.Now().UnixNano(), false); err == nil {
		t.Fatal("a pass against a stopped Redis must report the error")
	}
	if !a.Healthy() {
		t.Fatal("one failed pass right after a good one gave up on the fleet")
	}
	wait.Until(t, 5*time.Second, "the engine to give up on the store", func() bool {
		a.heartbeat(context.Background(), time.Now().UnixNano())
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
	wait.Until(t, 5*time.Second, "the engine's recovery when Redis is back", func() bool {
		a.heartbeat(context.Background(), time.Now().UnixNano())
		return a.Healthy()
	})
	if v := allowSoon(t, a, z, l, "k"); v.Allowed {
		t.Fatalf("after the store came back empty the instance still knows its 10 admits: %+v", v)
	}
}

// storedAdmits sums a key's pushed admits in Redis (its time slot fields).
func storedAdmits(t *testing.T, rc redis.UniversalClient, key string) int64 {
	t.Helper()
	vals, err := rc.HGetAll(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for f, v := range vals {
		if f[0] >= '0' && f[0] <= '9' {
			c, _ := strconv.ParseInt(v, 10, 64)
			n += c
		}
	}
	return n
}

// A store that stalls longer than the client's timeout may run a call late;
// it never runs it twice, and the lost call is never re-sent.
func TestStalledStoreNeverCountsTwice(t *testing.T) {
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	a := fleetEngine(t, NewRedisStore(srv.Client(t)), "stall")
	l := mustLimit(t, 1000, time.Hour, 0) // F = 31
	z := a.Zone("z", l)
	a.heartbeat(context.Background(), time.Now().UnixNano())
	for range 5 {
		allow(a, z, l, "k", time.Now().UnixNano())
	}
	queue(a, z, "k")
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer admin.Close()
	_ = admin.ScriptLoad(context.Background(), leaseLua).Err()
	stalled := make(chan error, 1)
	go func() { stalled <- admin.Do(context.Background(), "DEBUG", "SLEEP", "1").Err() }()
	srv.WaitStalled(t)
	if err := a.pass(context.Background(), time.Now().UnixNano(), false); err == nil {
		t.Fatal("a pass during a stall longer than the client timeout must fail")
	}
	if err := <-stalled; err != nil {
		t.Fatal(err)
	}
	key := z.storeKey(keyhash.Of("k"))
	first := storedAdmits(t, admin, key)
	if first != 0 && first != 5 {
		t.Fatalf("after the stall the store holds %d admits, want 5 (ran late) or 0", first)
	}
	if v := allowSoon(t, a, z, l, "k"); !v.Allowed {
		t.Fatalf("the 6th request: %+v", v)
	}
	queue(a, z, "k")
	passNow(t, a)
	if got := storedAdmits(t, admin, key); got != first+1 {
		t.Fatalf("after the next pass the store holds %d, want %d: the lost call must not be re-sent", got, first+1)
	}
	if _, ring := stateOf(z, "k"); count(ring) != 6 {
		t.Fatalf("the instance counts %d of its own 6 admits", count(ring))
	}
}

// Every early pass is reported to OnEarlySync (the early-syncs metric).
func TestEarlyPassesAreReported(t *testing.T) {
	var early int
	e := newEngine(t, Options{Store: newScriptStore(t), Prefix: "early", SyncInterval: 100 * time.Millisecond,
		OnEarlySync: func() { early++ }})
	l := mustLimit(t, 100, time.Hour, 0)
	z := e.Zone("z", l)
	now := time.Now().UnixNano()
	allow(e, z, l, "k", now) // no floor yet: the key asks for a grant
	if err := e.pass(context.Background(), now, true); err != nil {
		t.Fatal(err)
	}
	if early != 1 {
		t.Fatalf("OnEarlySync called %d times for one early pass, want 1", early)
	}
}

// A store that answers slowly (replies later than a pass may wait, as on a
// loaded machine) is not a store that is down: the heartbeats still land,
// within the client's read timeout, so the instances keep their slots and
// their floors, and keys far below their limit are never denied.
func TestASlowStoreKeepsTheFloors(t *testing.T) {
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	client := func() *redis.Client { // the plugin's client settings
		c := redis.NewClient(&redis.Options{Addr: srv.Addr(), DialTimeout: 500 * time.Millisecond, ReadTimeout: 500 * time.Millisecond,
			WriteTimeout: 500 * time.Millisecond, MaxRetries: -1, DialerRetries: 1, ContextTimeoutEnabled: true})
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	l := mustLimit(t, 1000, 10*time.Second, 0) // F = 31 of 16 slots
	engines := make([]*Engine, 2)
	for i := range engines {
		engines[i] = fleetEngine(t, NewRedisStore(client()), "slow")
		engines[i].Zone("z", l)
		engines[i].Start()
		t.Cleanup(func() { engines[i].Close(time.Second) })
	}
	wait.Until(t, 5*time.Second, "both instances to hold a slot", func() bool {
		return engines[0].slot.Load() >= 0 && engines[1].slot.Load() >= 0
	})
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr(), ReadTimeout: 5 * time.Second})
	defer admin.Close()
	stop := time.Now().Add(3 * time.Second)
	stalls := make(chan error, 1)
	go func() {
		// Stalls of 300 ms, 20 ms apart: a call waits up to a stall (and
		// longer than a pass may: 200 ms). Back to back stalls would starve
		// the other clients of a stall's gap altogether.
		for time.Now().Before(stop) {
			if err := admin.Do(context.Background(), "DEBUG", "SLEEP", "0.3").Err(); err != nil {
				stalls <- err
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		stalls <- nil
	}()
	for i := 0; time.Now().Before(stop.Add(500 * time.Millisecond)); i++ {
		e := engines[i%2]
		if v := allow(e, e.Zone("z", l), l, "key"+strconv.Itoa(i%100), time.Now().UnixNano()); !v.Allowed {
			now := time.Now().UnixNano()
			t.Fatalf("request %d of a key far below its limit denied while the store was slow: %+v (slot %d, held for %v more, floors %v, healthy %v, errors %d, last beat %v ago)", i, v,
				e.slot.Load(), time.Duration(e.heldUntil.Load()-now), e.floors.Load(), e.Healthy(), e.SyncErrors(), time.Duration(now-e.lastBeat.Load()))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := <-stalls; err != nil {
		t.Fatal(err)
	}
	for i, e := range engines {
		if f := e.floor(1000, time.Now().UnixNano()); f == 0 || !e.Healthy() {
			t.Fatalf("instance %d after 3 s of a slow store: floor %d, healthy %v", i, f, e.Healthy())
		}
	}
}
