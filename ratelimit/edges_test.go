package ratelimit

import (
	"context"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/window"
)

// edgeCase is a fleet at one of its edges, on a simulated clock: instances
// that restart, join, or take most of a key's traffic, and limits smaller
// than the fleet. Every instance runs its heartbeats, passes and early
// passes as the reconciler does (heartbeats every heartbeatEvery, a full
// pass every interval at its own phase, an early pass whenever keys are
// queued), and the test judges each key by the worst sliding window of its
// admits' exact timestamps.
type edgeCase struct {
	name      string
	instances int
	events    int64
	rates     []float64 // each key's offered requests per second
	seconds   int
	// pick chooses the instance of a request among the live ones.
	pick func(rng *rand.Rand, live []*edgeInstance) *edgeInstance
	// churn restarts the instances from churnFrom on every churnEvery,
	// gracefully (Close) or not (kill -9).
	churnFrom  int
	churnEvery time.Duration
	kill       bool
	// churnAfter is when the churn starts: after the founders took their
	// floor shares (2 s), the ones that stop held them.
	churnAfter time.Duration
	// joinAt adds joinN instances at that time.
	joinAt time.Duration
	joinN  int
}

type edgeInstance struct {
	e     *Engine
	z     *Zone
	phase int64 // the offset of its full passes in the interval
	hbAt  int64
}

type edgeResult struct {
	worst  []int // per key
	denied []int
	asked  []int
	// early counts apart the denials within a window (and a heartbeat
	// lifetime) of the first restart: the instances that stop then held
	// floor shares since the fleet started, so a restart costs most there.
	early []int
}

const edgeInterval = 100 * time.Millisecond

func (c edgeCase) run(t *testing.T, store SlotStore, seed uint64) edgeResult {
	t.Helper()
	l := mustLimit(t, c.events, 10*time.Second, 0)
	rng := rand.New(rand.NewPCG(seed, 11))
	ctx := context.Background()
	// A fixed start: the run is the same every time (slots are numbered
	// from the Unix epoch, so the start's place in a slot matters).
	start := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC).UnixNano()
	newInstance := func(now int64) *edgeInstance {
		e := newEngine(t, Options{Store: store, Prefix: t.Name(), SyncInterval: edgeInterval})
		in := &edgeInstance{e: e, z: e.Zone("z", l), phase: rng.Int64N(int64(edgeInterval))}
		// Caddy starts the engine (its first heartbeat) before it serves.
		in.e.heartbeat(ctx, now/int64(time.Millisecond))
		in.hbAt = now
		return in
	}
	var live []*edgeInstance
	for range c.instances {
		live = append(live, newInstance(start))
	}
	const step = 5 * time.Millisecond
	res := edgeResult{worst: make([]int, len(c.rates)), denied: make([]int, len(c.rates)), asked: make([]int, len(c.rates)), early: make([]int, len(c.rates))}
	settled := int64(c.churnAfter + c.churnEvery + 10*time.Second + 2*time.Second)
	if c.kill && probationShare(c.events, 2) > 0 {
		// Killed instances that held probation shares (limits large
		// enough to have them) are left aside at their share until a
		// window after they died: the killed ones of the churn's first
		// window, before enough claims shrank the shares to none, until
		// a window and a heartbeat lifetime later.
		settled += int64(10*time.Second + 2*time.Second)
	}
	admits := make([][]int64, len(c.rates))
	steps := int64(c.seconds) * int64(time.Second/step)
	for i := range steps {
		now := start + i*int64(step)
		if c.churnEvery > 0 && i*int64(step) >= int64(c.churnAfter) && i > 0 && (i*int64(step))%int64(c.churnEvery) == 0 {
			for j := c.churnFrom; j < len(live); j++ {
				if !c.kill {
					live[j].e.stopped.Store(true) // as Close, on the simulated clock
					live[j].e.depart(ctx, now, live[j].e.flush(ctx, now))
				}
				live[j] = newInstance(now)
			}
		}
		if c.joinN > 0 && i*int64(step) == int64(c.joinAt) {
			for range c.joinN {
				live = append(live, newInstance(now))
			}
		}
		for k, rate := range c.rates {
			// Evenly spaced arrivals: a key at 90% of its limit has 90% of
			// it in every window, so any denial of it is false.
			if int64(float64(i+1)*step.Seconds()*rate) == int64(float64(i)*step.Seconds()*rate) {
				continue
			}
			in := c.pick(rng, live)
			res.asked[k]++
			if allow(in.e, in.z, l, "k"+strconv.Itoa(k), now).Allowed {
				admits[k] = append(admits[k], now)
			} else if c.churnEvery > 0 && now-start < settled {
				res.early[k]++
			} else {
				res.denied[k]++
			}
		}
		for _, in := range live {
			if now-in.hbAt >= in.e.heartbeatEvery()*int64(time.Millisecond) {
				in.e.heartbeat(ctx, now/int64(time.Millisecond))
				in.hbAt = now
			}
			if (now-start+in.phase)%int64(edgeInterval) < int64(step) {
				_ = in.e.pass(ctx, now, false)
			} else {
				_ = in.e.pass(ctx, now, true)
			}
		}
	}
	for k, ts := range admits {
		slices.Sort(ts)
		res.worst[k] = window.MostInAny(ts, 10*time.Second)
	}
	return res
}

func pickAny(rng *rand.Rand, live []*edgeInstance) *edgeInstance {
	return live[rng.IntN(len(live))]
}

// pickSkewed sends 90% of the traffic to the first instance.
func pickSkewed(rng *rand.Rand, live []*edgeInstance) *edgeInstance {
	if rng.Float64() < 0.9 {
		return live[0]
	}
	return live[1+rng.IntN(len(live)-1)]
}

// TestTheFleetHoldsAtItsEdges: through restarts (graceful and kill -9) every
// 1.5 s, joins, and 90% of a key's traffic on one instance of 8, no key's
// worst window passes its limit by more than 2%, and no key offered under
// 95% of its limit is denied, the window after the first restart included:
// an instance that stops gracefully pushes what it admitted on floor (or
// probation) shares and says so, and a killed one's promise bounds what the
// others leave aside for it (see promise.go).
func TestTheFleetHoldsAtItsEdges(t *testing.T) {
	// Keys 0 and 1 at 4x and 1.5x the limit, 2 and 3 at 90% and 50%.
	rates := []float64{40, 15, 9, 5}
	// At a limit of 1000: 1.5x, 90%, 50% and 5% (one request a step at most).
	rates1000 := []float64{150, 90, 50, 5}
	cases := []edgeCase{
		{name: "churn graceful", instances: 4, events: 100, rates: rates, seconds: 40, pick: pickAny, churnFrom: 2, churnEvery: 1500 * time.Millisecond},
		{name: "churn kill", instances: 4, events: 100, rates: rates, seconds: 40, pick: pickAny, churnFrom: 2, churnEvery: 1500 * time.Millisecond, kill: true},
		{name: "churn kill after founding", instances: 4, events: 100, rates: rates, seconds: 40, pick: pickAny, churnFrom: 2, churnEvery: 1500 * time.Millisecond, kill: true, churnAfter: 4500 * time.Millisecond},
		{name: "churn graceful after founding", instances: 4, events: 100, rates: rates, seconds: 40, pick: pickAny, churnFrom: 2, churnEvery: 1500 * time.Millisecond, churnAfter: 4500 * time.Millisecond},
		{name: "join 2 to 4", instances: 2, events: 100, rates: rates, seconds: 40, pick: pickAny, joinAt: 15 * time.Second, joinN: 2},
		// A limit of 1000: new instances hold probation shares.
		{name: "churn kill 1000", instances: 4, events: 1000, rates: rates1000, seconds: 40, pick: pickAny, churnFrom: 2, churnEvery: 1500 * time.Millisecond, kill: true, churnAfter: 4500 * time.Millisecond},
		{name: "churn graceful 1000", instances: 4, events: 1000, rates: rates1000, seconds: 40, pick: pickAny, churnFrom: 2, churnEvery: 1500 * time.Millisecond, churnAfter: 4500 * time.Millisecond},
		{name: "join 2 to 4, 1000", instances: 2, events: 1000, rates: rates1000, seconds: 40, pick: pickAny, joinAt: 15 * time.Second, joinN: 2},
		{name: "skew 8 instances", instances: 8, events: 100, rates: rates, seconds: 40, pick: pickSkewed},
	}
	srv := redistest.Start(t)
	for _, c := range cases {
		for seed := range uint64(4) {
			// Seeds 0-2 on the embedded store, seed 3 on Redis.
			store, on := SlotStore(NewMemoryStore()), "memory"
			if seed == 3 {
				store, on = NewRedisStore(srv.Client(t)), "redis"
			}
			t.Run(c.name+"/"+on+"/seed"+strconv.FormatUint(seed, 10), func(t *testing.T) {
				c.check(t, c.run(t, store, seed))
			})
		}
	}
}

// check judges one run of c.
func (c edgeCase) check(t *testing.T, res edgeResult) {
	t.Helper()
	limit := float64(c.events) / 10 // per second
	for k, rate := range c.rates {
		t.Logf("key %d at %.0f%% of the limit: worst window %d of %d, denied %d of %d (and %d in the window after the first restart)", k, 100*rate/limit, res.worst[k], c.events, res.denied[k], res.asked[k], res.early[k])
		most := c.events + c.events/50
		if c.events < int64(c.instances) {
			most = c.events
		}
		if int64(res.worst[k]) > most {
			t.Errorf("key %d: worst window %d, limit %d", k, res.worst[k], c.events)
		}
		if rate < 0.95*limit && res.denied[k] > 0 {
			t.Errorf("key %d at %.0f%% of its limit: %d of %d denied", k, 100*rate/limit, res.denied[k], res.asked[k])
		}
		if rate < 0.95*limit && res.early[k] > 0 {
			t.Errorf("key %d at %.0f%% of its limit: %d denied in the window after the first restart", k, 100*rate/limit, res.early[k])
		}
	}
}

// TestLimitsSmallerThanTheFleetHoldExactly: a limit too small to share out
// as floor shares (3 or 1 per window on 4 and 8 instances) is admitted on
// reservations, so no window ever holds more than the limit. What it costs
// is logged: a request on an instance that holds no reservation is denied
// while that instance asks for one.
func TestLimitsSmallerThanTheFleetHoldExactly(t *testing.T) {
	cases := []edgeCase{
		{name: "limit 3 on 4", instances: 4, events: 3, rates: []float64{4, 0.27}, seconds: 60, pick: pickAny},
		{name: "limit 3 on 8", instances: 8, events: 3, rates: []float64{4, 0.27}, seconds: 60, pick: pickAny},
		{name: "limit 1 on 4", instances: 4, events: 1, rates: []float64{4, 0.09}, seconds: 60, pick: pickAny},
		{name: "limit 1 on 8 with churn", instances: 8, events: 1, rates: []float64{4, 0.09}, seconds: 60, pick: pickAny, churnFrom: 6, churnEvery: 1500 * time.Millisecond, kill: true},
	}
	for _, c := range cases {
		for seed := range uint64(3) {
			t.Run(c.name+"/seed"+strconv.FormatUint(seed, 10), func(t *testing.T) {
				res := c.run(t, NewMemoryStore(), seed)
				for k, rate := range c.rates {
					t.Logf("key %d at %.0f%% of the limit: worst window %d of %d, denied %d of %d", k, 100*rate/(float64(c.events)/10), res.worst[k], c.events, res.denied[k], res.asked[k])
					if int64(res.worst[k]) > c.events {
						t.Errorf("key %d: worst window %d, limit %d", k, res.worst[k], c.events)
					}
				}
			})
		}
	}
}

// TestEveryZoneKnowsTheFleetBeforeItsFirstRequest: an instance starts as
// Caddy starts it (the engine first, then its zones as the handlers
// provision), and its first request for a key of its second zone comes
// before the reconciler's first heartbeat. That zone must already know the
// fleet: one that did not admitted a tenth of every key's limit unseen, on
// top of what the fleet counted (bench/churn: a limit of 3 reached 5 and 6,
// one of 100 reached 117, with instances restarting).
func TestEveryZoneKnowsTheFleetBeforeItsFirstRequest(t *testing.T) {
	srv := redistest.Start(t)
	store := NewRedisStore(srv.Client(t))
	l := mustLimit(t, 1, 10*time.Second, 0)
	start := func() *Engine {
		e := newEngine(t, Options{Store: store, Prefix: "zones", SyncInterval: 100 * time.Millisecond})
		e.Start()
		t.Cleanup(func() { e.Close(time.Second) })
		return e
	}
	a := start()
	a.Zone("first", l)
	a.Zone("tiny", l)
	b := start()
	b.Zone("first", l)
	tiny := b.Zone("tiny", l)
	if got := tiny.fleet.claims.Load(); got != 2 {
		t.Fatalf("b's second zone counts %d claims before its first heartbeat pass, want 2 (a and b)", got)
	}
	// A limit of 1 on 2 instances has no floor share: b admits the key only
	// on a reservation the store counts first, so its first request waits
	// for one.
	if v := allow(b, tiny, l, "k", time.Now().UnixNano()); v.Allowed {
		t.Fatal("b admitted a limit-1 key unseen on its first request; the store counted nothing")
	}
	if err := b.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if v := allow(b, tiny, l, "k", time.Now().UnixNano()); !v.Allowed {
		t.Fatalf("b's request after its reservation pass was denied: %+v", v)
	}
	if err := b.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if v := allow(a, a.Zone("tiny", l), l, "k", time.Now().UnixNano()); v.Allowed {
			t.Fatal("a admitted the key a second time in its window")
		}
		if err := a.Reconcile(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAStoppedInstanceGivesBackItsReservations: an instance that stops as
// Caddy stops it returns the reservations it holds unused, so the fleet
// may admit them at once rather than a window later.
func TestAStoppedInstanceGivesBackItsReservations(t *testing.T) {
	srv := redistest.Start(t)
	store := NewRedisStore(srv.Client(t))
	l := mustLimit(t, 1, time.Minute, 0)
	start := func() (*Engine, *Zone) {
		e := newEngine(t, Options{Store: store, Prefix: "giveback", SyncInterval: 100 * time.Millisecond})
		e.Start()
		t.Cleanup(func() { e.Close(time.Second) })
		return e, e.Zone("tiny", l)
	}
	// admitOn asks e for the key until a reservation lets it in.
	admitOn := func(e *Engine, z *Zone) bool {
		for range 5 {
			if allow(e, z, l, "k", time.Now().UnixNano()).Allowed {
				return true
			}
			if err := e.Reconcile(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		return false
	}
	a, za := start()
	b, zb := start()
	if v := allow(a, za, l, "k", time.Now().UnixNano()); v.Allowed {
		t.Fatal("a admitted a limit-1 key of a fleet of 2 without a reservation")
	}
	if err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	a.Close(time.Second) // holding the reservation, unused
	if !admitOn(b, zb) {
		t.Fatal("the reservation a held when it stopped still counts: b cannot admit the key in the window")
	}
}

// TestAGracefulStopLeavesNothingAside: an instance that stops (Caddy's
// graceful stop) pushes what it admitted on its floor shares and says so in
// its record, so the others hold nothing back for it; a killed instance's
// floor admits are unknown, and what its last floor promise allowed (its
// admits as of its last heartbeat, and the headroom) stays aside until they
// have left the window, not its whole floor share.
func TestAGracefulStopLeavesNothingAside(t *testing.T) {
	for _, kill := range []bool{false, true} {
		name := map[bool]string{false: "graceful", true: "kill"}[kill]
		t.Run(name, func(t *testing.T) {
			const events = 100 // 2 instances: floor shares of 40
			f, a, b, now := twoOnTheirFloors(t, events)
			ctx := context.Background()
			const onA = 10
			now = f.admitBeating(a, name, onA, 500*time.Millisecond, now)
			a.e.heartbeat(ctx, now/int64(time.Millisecond))
			a.live = false
			if !kill {
				a.e.stopped.Store(true) // as Close does, on the test's clock
				a.e.depart(ctx, now, a.e.flush(ctx, now))
			}
			admitted, _ := f.admitAll(b, name, 300, 10*time.Millisecond, 10, now) // 3 s, well within the window
			t.Logf("%s: b admitted %d after a admitted %d, limit %d", name, admitted, onA, events)
			if admitted+onA > events {
				t.Fatalf("the fleet admitted %d, limit %d", admitted+onA, events)
			}
			if !kill && admitted < events-onA-2 {
				t.Fatalf("after a stopped gracefully, b admitted %d: want the limit less a's admits (%d), not less a's whole floor share (%d)", admitted, events-onA, events-40)
			}
			if headroom := int(promiseHeadroom(a.z, events)); kill && admitted < events-onA-headroom-2 {
				t.Fatalf("after a was killed, b admitted %d: want the limit less a's admits and the headroom of its promise (%d), not less a's whole floor share (%d)", admitted, events-onA-headroom, events-40)
			}
		})
	}
}

// TestASyncedKeyHoldsAtMostAHundredthUnpushed: a kill -9 loses what its
// instance has not pushed, and the others admit it again, so a synced key
// never holds more than unpushedMost of its admits unpushed past an early
// pass, however far it is from its limit.
func TestASyncedKeyHoldsAtMostAHundredthUnpushed(t *testing.T) {
	for _, events := range []int64{100, 1000} {
		t.Run(strconv.FormatInt(events, 10), func(t *testing.T) {
			f, a, _, now := twoOnTheirFloors(t, events)
			ctx := context.Background()
			h := keyhash.Of("k")
			synced := func() bool { fl, ok := a.flags("k"); return ok && fl&flagSynced != 0 }
			admitted := int64(0)
			for i := 0; !synced(); i++ {
				if i == 1000 {
					t.Fatal("the key never synced")
				}
				now += int64(time.Millisecond)
				if allow(a.e, a.z, f.l, "k", now).Allowed {
					admitted++
				}
				if err := a.e.pass(ctx, now, true); err != nil {
					t.Fatal(err)
				}
			}
			most := unpushedMost(events)
			for range 3 * most {
				now += int64(time.Millisecond)
				if !allow(a.e, a.z, f.l, "k", now).Allowed {
					t.Fatalf("a synced key at %d of %d was denied", admitted, events)
				}
				admitted++
				now += int64(time.Millisecond)
				if err := a.e.pass(ctx, now, true); err != nil {
					t.Fatal(err)
				}
				if stored := f.stored(a.z, h); admitted-stored >= most {
					t.Fatalf("after an early pass the store counts %d of the key's %d admits: %d unpushed, want fewer than %d (a hundredth of %d)", stored, admitted, admitted-stored, most, events)
				}
			}
		})
	}
}

// TestAStopWithTooManyFloorKeysSaysItDidNotFlush: a stop pushes at most
// flushFloorKeys keys held on floor shares (more would not fit Caddy's
// shutdown); past that its record must not say it pushed them all.
func TestAStopWithTooManyFloorKeysSaysItDidNotFlush(t *testing.T) {
	for _, keys := range []int{100, flushFloorKeys + 1} {
		f := &floorFleet{t: t, store: NewMemoryStore(), l: mustLimit(t, 1000, 10*time.Second, 0)}
		a := f.start(time.Now().UnixNano())
		a.z.SetMaxKeys(int64(keys))
		now := f.floorsTaken(a.e.warmUntil.Load())
		for i := range keys {
			if !allow(a.e, a.z, f.l, "k"+strconv.Itoa(i), now).Allowed {
				t.Fatal("denied under the floor share")
			}
		}
		a.e.stopped.Store(true)
		if got, want := a.e.flush(context.Background(), now), keys <= flushFloorKeys; got != want {
			t.Errorf("%d keys on floor shares: flushed %v, want %v", keys, got, want)
		}
	}
}

// A reservation used in a later slot than its own moves there: the store's
// count of its slot falls by one and the later slot's grows by one. Another
// instance that read the first slot before takes the store's counts as they
// are; merged by maximum, it kept the old count too and counted the admit
// twice until the slot left the window (under kill churn the key at 90% of
// its limit was read at 100-102 while the fleet had admitted 83-88).
func TestAMovedReservationCountsOnceEverywhere(t *testing.T) {
	srv := redistest.Start(t)
	rc := srv.Client(t)
	f := &floorFleet{t: t, store: NewRedisStore(rc), l: mustLimit(t, 3, 10*time.Second, 0)}
	ctx := context.Background()
	now := time.Now().UnixNano()
	a, b := f.start(now), f.start(now) // a limit of 3 on 2: no floor share, reservations
	now = f.floorsTaken(now + int64(2*time.Second))
	pass := func(in *floorInstance, at int64) {
		t.Helper()
		if err := in.e.pass(ctx, at, false); err != nil {
			t.Fatal(err)
		}
	}
	// b counts what the store holds of the key after each of its reads.
	readByB := func(at int64, when string) {
		t.Helper()
		allow(b.e, b.z, f.l, "k", at)
		pass(b, at)
		want := storedCount(t, rc, b.z.storeKey(keyhash.Of("k")))
		if _, ring := stateOf(b.z, "k"); count(ring) != want {
			t.Fatalf("%s: b counts %d of the key, the store %d", when, count(ring), want)
		}
	}
	if allow(a.e, a.z, f.l, "k", now).Allowed {
		t.Fatal("a admitted a key of reservations without one")
	}
	pass(a, now) // a is granted a reservation in now's slot
	readByB(now, "after a's reservation")
	later := now + int64(time.Second) // two slots on
	if !allow(a.e, a.z, f.l, "k", later).Allowed {
		t.Fatal("a did not admit on its reservation")
	}
	pass(a, later) // the admit moves to its slot
	readByB(later, "after a used its reservation a second later")
}
