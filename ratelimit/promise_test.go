package ratelimit

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// TestABurstPastItsPromiseIsPushedNotRefused: a cold key admitted past its
// floor promise (its bound, 0, and the headroom) within one heartbeat is
// admitted on its floor share as before, and pushed an early pass later, so
// that once its instance is killed, the others, who leave aside only what
// its promise said, still see every admit.
func TestABurstPastItsPromiseIsPushedNotRefused(t *testing.T) {
	const events = 100 // 2 instances: floor shares of 40, a headroom of 1
	f, a, b, now := twoOnTheirFloors(t, events)
	const burst = 15 // past the headroom, under the share
	for range burst {
		if !allow(a.e, a.z, f.l, "k", now).Allowed {
			t.Fatal("a burst under the floor share was refused: past the promise, an admit is pushed, not refused")
		}
	}
	now += int64(5 * time.Millisecond)
	if err := a.e.pass(context.Background(), now, true); err != nil {
		t.Fatal(err)
	}
	if got := f.stored(a.z, keyhash.Of("k")); got != burst {
		t.Fatalf("an early pass after the burst, the store counts %d of the key: want the %d admitted past the promise", got, burst)
	}
	a.live = false                                                       // killed: no flush, no leave
	admitted, _ := f.admitAll(b, "k", 300, 10*time.Millisecond, 10, now) // 3 s, well within the window
	t.Logf("b admitted %d after a admitted %d and was killed, limit %d", admitted, burst, events)
	if admitted+burst > events {
		t.Fatalf("the fleet admitted %d, limit %d", admitted+burst, events)
	}
	if headroom := int(promiseHeadroom(a.z, events)); admitted < events-burst-headroom-2 {
		t.Fatalf("b admitted %d: want the limit less a's admits and its promise's headroom (%d), not less its floor share (%d)", admitted, events-burst-headroom, events-burst-40)
	}
}

// TestAGoneMembersPromiseIsReadOnce: the store sends a gone member's promise
// to each instance once; later heartbeats name it as held, get none, and the
// instance keeps leaving aside by it.
func TestAGoneMembersPromiseIsReadOnce(t *testing.T) {
	_, a, b, now := twoOnTheirFloors(t, 100)
	a.live = false // killed
	now += int64(3 * time.Second)
	for beat := range 3 {
		now += int64(500 * time.Millisecond)
		b.e.heartbeat(context.Background(), now/int64(time.Millisecond))
		gone := b.z.fleet.gone.Load()
		if gone == nil || len(*gone) != 1 || !(*gone)[0].promise.valid() {
			t.Fatalf("heartbeat %d after a's death: b holds %+v, want a's promise", beat, gone)
		}
		if held := b.e.knownPromises(); len(held) != 1 || held[0].Member != a.e.member {
			t.Fatalf("heartbeat %d: b names %v as held, want a's", beat, held)
		}
	}
}

// TestAKilledInstancesPromiseEndsWithItsAdmits: what a killed instance's
// promise bounds was admitted by the heartbeat that sent it, so once those
// admits have left the window the others leave aside only the promise's
// headroom, though the instance's record (and its claim) lasts a heartbeat
// lifetime longer.
func TestAKilledInstancesPromiseEndsWithItsAdmits(t *testing.T) {
	const events = 100 // 2 instances: floor shares of 40
	f, a, b, now := twoOnTheirFloors(t, events)
	ctx := context.Background()
	const onA = 20
	now = f.admitBeating(a, "k", onA, 100*time.Millisecond, now)
	a.e.heartbeat(ctx, now/int64(time.Millisecond))
	seen := now
	a.live = false // killed: no flush, no leave
	// Past the slot of a's last heartbeat (and an interval) leaving the window.
	now = a.z.slots.LeavesAt(a.z.slots.Of(seen+b.e.interval.Load())) + int64(time.Millisecond)
	f.tick(now, true)
	admitted, now := f.admitAll(b, "k", 100, 5*time.Millisecond, 0, now)
	f.tick(now, true)
	if gone := b.z.fleet.gone.Load(); gone == nil || len(*gone) != 1 {
		t.Fatalf("a's record is gone by the end (%v): the test proves nothing", gone)
	}
	headroom := int(promiseHeadroom(a.z, events))
	t.Logf("b admitted %d once a's %d admits had left the window; a's promise's headroom is %d", admitted, onA, headroom)
	if admitted > events {
		t.Fatalf("b admitted %d, limit %d", admitted, events)
	}
	if admitted < events-headroom-2 {
		t.Fatalf("b admitted %d after a's admits had left the window: want the limit less the headroom of a's promise (%d), not less its bound too (%d)", admitted, events-headroom, events-onA-headroom)
	}
}

// pushFloor has in's key start syncing at now: an early pass pushes what in
// admitted of it on its floor share and registers it.
func (f *floorFleet) pushFloor(in *floorInstance, key string, now int64) {
	f.t.Helper()
	h := keyhash.Of(key)
	s := in.z.shardOf(h)
	s.mu.Lock()
	en, _ := in.z.lookup(s, h)
	in.e.enqueue(in.z, h, en)
	s.mu.Unlock()
	if err := in.e.pass(context.Background(), now, true); err != nil {
		f.t.Fatal(err)
	}
}

// TestAKeyThatSyncedLeavesItsPromise: a key that starts syncing pushes what
// its instance admitted of it on its floor share, and that instance's next
// promises name it as pushed, so once the instance is killed the others
// leave aside the headroom for it, not again what the store already counts
// (bench/churn, kill: both killed founders had pushed the key at 90% of its
// limit, and the others left their bounds of it, 4 and 5, aside on top).
func TestAKeyThatSyncedLeavesItsPromise(t *testing.T) {
	const events = 100 // 2 instances: floor shares of 40
	f, a, b, now := twoOnTheirFloors(t, events)
	ctx := context.Background()
	const onA = 20
	now = f.admitBeating(a, "k", onA, 100*time.Millisecond, now)
	now += int64(time.Millisecond)
	f.pushFloor(a, "k", now)
	h := keyhash.Of("k")
	if got := f.stored(a.z, h); got != onA {
		t.Fatalf("after a's early pass the store counts %d of the key, want its %d floor admits", got, onA)
	}
	now += int64(500 * time.Millisecond)
	a.e.heartbeat(ctx, now/int64(time.Millisecond))
	a.live = false // killed: no flush, no leave
	// Past a's record's end, well within the window of its admits.
	now += int64(3 * time.Second)
	f.tick(now, true)
	if gone := b.z.fleet.gone.Load(); gone == nil || len(*gone) != 1 {
		t.Fatalf("b holds %v as gone, want a: the test proves nothing", gone)
	}
	admitted, _ := f.admitAll(b, "k", 200, 5*time.Millisecond, 0, now)
	headroom := int(promiseHeadroom(a.z, events))
	t.Logf("b admitted %d beside a's %d pushed; a's promise's headroom is %d", admitted, onA, headroom)
	if admitted > events-onA {
		t.Fatalf("b admitted %d beside a's %d, limit %d", admitted, onA, events)
	}
	if admitted < events-onA-headroom-2 {
		t.Fatalf("b admitted %d beside a's %d pushed: want the limit less those and the headroom (%d), not less them twice (%d)", admitted, onA, events-onA-headroom, events-2*onA-headroom)
	}
}

// TestANamedKeyStaysOffItsFloor: a key a promise names as pushed admits
// nothing unseen while the instance's last promise may name it: it goes
// back on its floor share only a heartbeat lifetime after it is last named.
func TestANamedKeyStaysOffItsFloor(t *testing.T) {
	f, a, _, now := twoOnTheirFloors(t, 100)
	now = f.admitBeating(a, "k", 20, 100*time.Millisecond, now)
	now += int64(time.Millisecond)
	f.pushFloor(a, "k", now)
	pushed := now
	h := keyhash.Of("k")
	named, until := pushed+pushedFor(a.z), pushed+pushedFor(a.z)+int64(a.e.memberTTL())
	onFloor := func() bool { fl, ok := a.flags("k"); return ok && fl&flagFloor != 0 }
	back := int64(0)
	for i := 1; now < until+int64(10*time.Second); i++ {
		now += int64(100 * time.Millisecond)
		if i%20 == 0 { // one request in 2 s: the key leaves, as far as it may
			allow(a.e, a.z, f.l, "k", now)
		}
		f.tick(now, i%5 == 0)
		p := a.e.promised.Load()
		if i%5 == 0 && slices.Contains(p.pushed, a.z.pushedID(h)) != (now < named) {
			t.Fatalf("%v after its push, a's promise names the key: %v, want %v (named for %v)", time.Duration(now-pushed), now < named == false, now < named, time.Duration(pushedFor(a.z)))
		}
		if onFloor() {
			if now < until {
				t.Fatalf("the key went back on a's floor share %v after its push, before %v: a promise naming it may be a's last", time.Duration(now-pushed), time.Duration(until-pushed))
			}
			if back == 0 {
				back = now
			}
		}
	}
	if back == 0 {
		t.Fatal("the key never went back on a's floor share: the test proves nothing")
	}
	t.Logf("the key went back on its floor share %v after its push", time.Duration(back-pushed))
}

// TestAHotKeysRoomLeavesNothingForThoseThatHeardIt: the room a hot key's
// announcer tells new instances leaves nothing aside for a gone instance
// that heard the key hot (it pushed what it had admitted of it), as the
// request path does (bench/churn, kill: a dozen gone restarts' headrooms
// left a key at 90% of its limit no room, and each new instance's first
// request of it was denied).
func TestAHotKeysRoomLeavesNothingForThoseThatHeardIt(t *testing.T) {
	srv := redistest.Start(t)
	f := &floorFleet{t: t, store: NewRedisStore(srv.Client(t)), l: mustLimit(t, 1000, 10*time.Second, 0)}
	now := time.Now().UnixNano()
	a, _, c := f.start(now), f.start(now), f.start(now)
	f.tick(now, true)
	now = f.floorsTaken(a.e.warmUntil.Load())
	h := keyhash.Of("k")
	// a admits the key past three quarters of its floor share (of 266),
	// then 30 a second: it syncs, and its heartbeats announce it hot; every
	// instance hears it.
	for range 220 {
		now += int64(time.Millisecond)
		allow(a.e, a.z, f.l, "k", now)
	}
	for i := 1; i <= 500; i++ {
		now += int64(10 * time.Millisecond)
		if i%3 == 0 {
			allow(a.e, a.z, f.l, "k", now)
		}
		f.tick(now, i%50 == 0)
		if i == 250 {
			c.live = false // killed, having heard the key hot
		}
	}
	gone := a.z.fleet.gone.Load()
	if gone == nil || len(*gone) != 1 {
		t.Fatalf("a holds %v as gone, want c", gone)
	}
	s := a.z.shardOf(h)
	s.mu.Lock()
	m, hot := s.hotAt(h, now)
	s.mu.Unlock()
	if !hot || (*gone)[0].seen <= m.at+a.e.interval.Load() {
		t.Fatalf("the key is hot: %v (since %d); c heartbeated last at %d: the test needs c to have heard it", hot, m.at, (*gone)[0].seen)
	}
	room := func() int64 {
		for _, k := range a.e.announce(now) {
			if k.Key == a.z.storeKey(h) {
				return k.Room
			}
		}
		t.Fatal("a does not announce the key")
		return 0
	}
	withC := room()
	a.z.fleet.gone.Store(&[]goneRecord{})
	withoutC := room()
	a.z.fleet.gone.Store(gone)
	if withC != withoutC {
		t.Fatalf("a announces a room of %d with c gone, %d without: c heard the key hot and pushed its admits, so nothing is left aside for it", withC, withoutC)
	}
}
