package ratelimit

import (
	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/window"
)

// entry is the state of one key of one zone on this instance, apart from its
// ring, which lives beside it in the zone's arena, and its lease state (see
// leaseState), which only a key that went to leases has. Both are guarded by
// the lock of the key's shard. Most keys stay on their floor, so the entry
// holds what a floor key needs, in as few bytes as its ranges allow: every
// tracked key costs them.
//
// The ring holds this instance's own admits of the key, per time slot of the
// window: on its floor the key admits while the ring's sum is under F, and
// with the store down while it is under events. The admits from slot from on
// (but fromPushed of slot from's) are those the store has not seen, floor
// admits or lease admits alike. A call takes them and pushes them once: a
// failed push is never re-sent, so nothing is counted twice.
type entry struct {
	hash     keyhash.Hash // the key's, which the shard's index compares
	tat      int64        // GCRA theoretical arrival time, Unix ns
	head     int64        // the slot of ring's newest count
	calledAt int64        // the last call (or the entry's creation), Unix ns
	// seen is the last request for the key in Unix seconds, rounded up:
	// eviction needs no finer time, and rounding up never evicts early.
	seen       uint32
	fromPushed uint32 // admits of slot from pushed already
	demand     uint32 // requests seen (admitted or not) since the last call
	lease      int32  // 1 + the index of the key's lease state in its shard; 0: none
	waiting    uint16 // requests denied for want of a grant since the last call
	// back is head - from, at most the ring's length: a from that old is
	// out of the window, and no older one reads otherwise.
	back  uint8
	flags uint8
}

const (
	flagQueued uint8 = 1 << iota // waiting in the engine's queue of calls
	flagLease                    // past its floor: admitted on leases
	flagRated                    // rate holds a measurement
)

// back counts up to a ring's length.
const _ = uint8(MaxPrecision + 1)

// demandHorizon is the time constant of a key's demand rate, in sync
// intervals: long enough to smooth calls a few milliseconds apart, short
// enough to follow a shift of load between instances.
const demandHorizon = 2

func (e *entry) init(h keyhash.Hash, now int64, s window.Slots) {
	*e = entry{hash: h, head: s.Of(now), calledAt: now}
	e.see(now)
}

// see records a request at now.
func (e *entry) see(now int64) { e.seen = uint32((now + 1e9 - 1) / 1e9) }

// lastSeen is the last request for the key, Unix ns, rounded up to the
// second.
func (e *entry) lastSeen() int64 { return int64(e.seen) * 1e9 }

// from is the first slot with admits not pushed (or one before the window).
func (e *entry) from() int64 { return e.head - int64(e.back) }

// advance moves the ring's head to slot, clearing the slots that left the
// window.
func (e *entry) advance(ring []uint32, slot int64) {
	if slot <= e.head {
		return
	}
	n := int64(len(ring))
	if slot-e.head >= n {
		clear(ring)
		e.back = uint8(n)
	} else {
		e.back = uint8(min(int64(e.back)+slot-e.head, n))
		for s := e.head + 1; s <= slot; s++ {
			ring[slotIndex(s, n)] = 0
		}
	}
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

// takeUnpushed returns the ring's admits the store has not seen, slot by
// slot, and marks them pushed.
func (e *entry) takeUnpushed(ring []uint32) []SlotCount {
	n := int64(len(ring))
	var out []SlotCount
	from := e.from()
	for slot := max(from, e.head-n+1); slot <= e.head; slot++ {
		c := int64(ring[slotIndex(slot, n)])
		if slot == from {
			c -= int64(e.fromPushed)
		}
		if c > 0 {
			out = append(out, SlotCount{Slot: slot, Count: c})
		}
	}
	e.back, e.fromPushed = 0, ring[slotIndex(e.head, n)]
	return out
}

// unpushed reports whether the ring holds admits the store has not seen.
func (e *entry) unpushed(ring []uint32) bool {
	return e.back > 0 || ring[slotIndex(e.head, int64(len(ring)))] > e.fromPushed
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
