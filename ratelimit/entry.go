package ratelimit

import "github.com/fleetguard/fleetguard/window"

// entry is the state of one key of one zone on this instance, apart from its
// slot counts (the ring), which live beside it in the zone's arena. Both are
// guarded by the lock of the key's shard.
//
// The ring holds, per slot of the window, the best count this instance knows:
// the fleet's count as of the last read, or this instance's own admits if
// they are more (a push that failed). The instance's own admits go into the
// ring at once, so one instance never admits more than the limit in any
// window, whether the store is reachable or not.
//
// pendCur and pendPrev hold the admits no reconcile pass has pushed yet (those
// of slot head and of the slots before it). A pass claims them (zeroes them)
// and pushes them once: a failed push is never re-sent, so nothing is counted
// twice, and the ring still holds them, so this instance does not forget them.
type entry struct {
	tat      int64 // GCRA theoretical arrival time, Unix ns
	lastSeen int64 // last request for the key, Unix ns
	readAt   int64 // last successful read of the fleet's counts, Unix ns; 0 before the first
	leftAt   int64 // when the key deregistered (flagLeaving), Unix ns
	head     int64 // the slot of ring's newest count
	// mergeMaxUntil is the slot until which a read merges each slot by
	// maximum: a push of the key failed, and the store may lack admits the
	// ring holds. Otherwise a read takes the store's counts (they can fall:
	// a reservation used in a later slot moves out of its own).
	mergeMaxUntil int64

	pendCur  uint32 // unclaimed admits in slot head
	pendPrev uint32 // unclaimed admits in slot head-1 (older ones are moved up to it)
	demand   uint32 // requests seen (admitted or not) since the last claim

	sinceRead   uint32 // admits since the counts were last read
	fleetDemand uint32 // the store's demand counter at the last read (low 32 bits)
	// The demand of this instance and of the whole fleet for the key, in
	// requests per sync interval, averaged over demandHorizon intervals: their
	// ratio is this instance's share, and the fleet's tells how much it may
	// admit before the next reads.
	ownRate, fleetRate float32
	// syncing is how many other instances were registered as syncing the
	// key at the last read: each of the rest may hold its floor share
	// unreported (see Engine.floor).
	syncing uint16
	flags   uint8
}

const (
	flagQueued uint8 = 1 << iota // waiting in the engine's early-sync queue
	flagRated                    // ownRate and fleetRate hold a measurement
	// flagFloor: the key admits within this instance's floor share without
	// the store; its ring holds this instance's admits since it entered
	// floor mode, none of them pushed.
	flagFloor
	// flagSynced: this instance is registered with the store as syncing the
	// key; its admits are pushed and the fleet's counts read, as in the
	// near-limit mechanisms.
	flagSynced
	// flagLeaving: a synced key that deregistered at leftAt; it stays
	// synced until the others have read so.
	flagLeaving
	// flagReserved: the key is admitted on reservations (see reserve.go);
	// its admits are in the store before they are made.
	flagReserved
	// flagLost: the store restarted empty since the key's last read; the
	// next read's counts come on top of the ring's, not in place of them.
	flagLost
)

// demandHorizon is the time constant of the demand rates, in sync intervals:
// long enough to smooth early syncs a few milliseconds apart, short enough to
// follow a shift of load between instances.
const demandHorizon = 2

// fresh reports whether the fleet's counts were read within staleAfter.
func (e *entry) fresh(now, staleAfter int64) bool {
	return e.readAt > 0 && now-e.readAt < staleAfter
}

func (e *entry) init(now int64, s window.Slots) {
	*e = entry{lastSeen: now, head: s.Of(now)}
}

// advance moves the ring's head to slot, clearing the slots that left the
// window, and moves unclaimed admits of earlier slots to slot head-1: pushed
// later than they happened, they count a little longer, never shorter.
func (e *entry) advance(ring []uint32, slot int64) {
	if slot <= e.head {
		return
	}
	n := int64(len(ring))
	if slot-e.head >= n {
		clear(ring)
	} else {
		for s := e.head + 1; s <= slot; s++ {
			ring[slotIndex(s, n)] = 0
		}
	}
	e.pendPrev += e.pendCur
	e.pendCur = 0
	e.head = slot
}

// scan sums the ring (the key's count in the window at head) and finds its
// oldest slot that holds a count (head when none does). It runs on every
// request: the sum is a loop of loads and adds over the ring's two halves
// (oldest first: ring[i:] then ring[:i]), and the search for the oldest
// count mostly stops at its first slot, which steady traffic fills.
func (e *entry) scan(ring []uint32) (used, oldest int64) {
	n := int64(len(ring))
	i := slotIndex(e.head+1, n) // the oldest slot's place
	older, newer := ring[i:], ring[:i]
	sum := sumCounts(older) + sumCounts(newer)
	oldest = e.head - n + 1
	for _, c := range older {
		if c != 0 {
			return int64(sum), oldest
		}
		oldest++
	}
	for _, c := range newer {
		if c != 0 {
			return int64(sum), oldest
		}
		oldest++
	}
	return int64(sum), e.head
}

// sumCounts is the sum of counts, in a plain loop: unrolling it gains too
// little on rings of 20 to pay for the code.
func sumCounts(counts []uint32) uint64 {
	var sum uint64
	for _, c := range counts {
		sum += uint64(c)
	}
	return sum
}

// pending reports whether the entry holds admits to push, or waits for an
// early sync. A key on its floor share pushes nothing until it starts
// syncing: its admits are covered by the share the others leave it.
func (e *entry) pending() bool {
	return e.pendCur|e.pendPrev != 0 && e.flags&flagFloor == 0 || e.flags&flagQueued != 0
}

// toFloor puts a synced key back on its floor share: its ring then counts
// only this instance's admits from now on (those before are the fleet's,
// pushed), starting with the unpushed ones. The caller has deregistered the
// key, or its registration has lapsed.
func (e *entry) toFloor(ring []uint32) {
	clear(ring)
	n := int64(len(ring))
	ring[slotIndex(e.head, n)] = e.pendCur
	ring[slotIndex(e.head-1, n)] = e.pendPrev
	e.pendCur, e.pendPrev, e.sinceRead = 0, 0, 0
	e.flags = e.flags&^(flagSynced|flagLeaving) | flagFloor
}

// window lists this instance's admits in the ring, slot by slot, for a key
// that starts syncing after admitting on its floor share.
func (e *entry) window(ring []uint32) []SlotCount {
	n := int64(len(ring))
	var out []SlotCount
	for slot := e.head - n + 1; slot <= e.head; slot++ {
		if c := ring[slotIndex(slot, n)]; c != 0 {
			out = append(out, SlotCount{Slot: slot, Count: int64(c)})
		}
	}
	return out
}

// untilFree returns how long until the count at head has dropped by need, as
// its oldest slots leave the window.
func (e *entry) untilFree(ring []uint32, s window.Slots, now, need int64) int64 {
	n := int64(len(ring))
	i := slotIndex(e.head+1, n) // the oldest slot's place
	var freed int64
	for slot := e.head - n + 1; slot <= e.head; slot++ {
		freed += int64(ring[i])
		if freed >= need {
			return max(s.LeavesAt(slot)-now, 0)
		}
		if i++; i == n {
			i = 0
		}
	}
	return max(s.LeavesAt(e.head)-now, 0)
}

// slotIndex is where slot lives in a ring of n counts.
func slotIndex(slot, n int64) int64 {
	if i := slot % n; i >= 0 {
		return i
	}
	return slot%n + n
}
