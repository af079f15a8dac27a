package ratelimit

import (
	"context"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
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
	a.live = false // killed: no flush, no leave
	admitted := 0
	for i := range 300 { // 3 s, well within the window
		now += int64(10 * time.Millisecond)
		if allow(b.e, b.z, f.l, "k", now).Allowed {
			admitted++
		}
		f.tick(now, i%10 == 0)
	}
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
	admitted := 0
	for range 100 {
		now += int64(5 * time.Millisecond)
		if allow(b.e, b.z, f.l, "k", now).Allowed {
			admitted++
		}
		f.tick(now, false)
	}
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
