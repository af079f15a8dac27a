package ratelimit

import (
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// A key whose limit is smaller than the fleet can share out (no floor share:
// floorFraction × events / claims is under minFloor) is admitted on
// reservations, and so are the last admits of any synced key's window that
// the instances' shares, rounded down, leave: a step asks the store to count some admits ahead of time, as
// far as the window leaves room, and the instance makes them without telling
// anyone. Every admit is counted in the store before it is made, so the
// window holds exactly, whatever the fleet's size; the price is that a
// request on an instance that holds no reservation of the key is denied
// (Retry-After: one sync interval) while the instance asks for one. A
// reservation counts in the slot it was made in; one used in a later slot is
// moved to that slot by the next step, so that it counts for a window from
// when it was used. Reservations lapse unused shortly before their slot
// leaves the window, so that none is used too late to be moved.

// reservation is what an instance holds of a key's reserved admits.
type reservation struct {
	n     int64 // reserved admits not made yet
	slot  int64 // the slot they are counted in
	moved int64 // admits made from them in later slots, to move out of slot
}

// reserves reports whether z's keys with limit events are admitted on
// reservations: the fleet is known and the limit too small for floor shares.
func reserves(z *Zone, events int64) bool {
	claims := z.fleet.widest()
	return claims > 0 && share(events, claims) == 0
}

// reservedOf is what this instance may still use of h's reserved admits
// when lapse is the oldest slot a reservation may be in. The caller holds
// s's lock.
func (s *shard) reservedOf(h keyhash.Hash, lapse int64) int64 {
	if len(s.reservations) == 0 {
		return 0
	}
	r, ok := s.reservations[h]
	if ok && r.slot < lapse {
		r.n = 0
		s.reservations[h] = r
	}
	return r.n
}

// lapseSlot is the oldest slot a reservation may be counted in at now to be
// used: its slot must stay in the window for two more intervals, time for a
// step to move it.
func (e *Engine) lapseSlot(z *Zone, now int64) int64 {
	return z.slots.Oldest(now) + (2*e.interval.Load()+z.slots.Len-1)/z.slots.Len
}

// askReservation asks the store for a reservation of a key whose share
// here is spent while the fleet's headroom is not. The caller holds the
// key's shard lock.
func (e *Engine) askReservation(z *Zone, h keyhash.Hash, en *entry) {
	en.flags |= flagReserved
	e.enqueue(z, h, en)
}

// judgeReserved decides a request for a key admitted on reservations. A
// request that takes the last reservation, or finds none, queues the key for
// more. The caller holds the key's shard lock, s.
func (e *Engine) judgeReserved(c *Check, s *shard, en *entry, ring []uint32, now int64, v *Verdict) (tat, oldest int64) {
	l := c.Limit
	en.lastSeen = now
	en.demand++
	used, oldest := en.scan(ring)
	held := s.reservedOf(c.Key, e.lapseSlot(c.Zone, now))
	g := gcraCheck(en.tat, now, l)
	*v = Verdict{}
	if held <= 1 {
		e.enqueue(c.Zone, c.Key, en)
	}
	switch {
	case held == 0 && used >= l.Events:
		v.Fleet = true
		v.RetryAfter = time.Duration(en.untilFree(ring, l.slots, now, used-l.Events+1))
	case held == 0:
		v.Fleet = true
		v.RetryAfter = time.Duration(e.interval.Load())
	case !g.allowed:
		v.RetryAfter = time.Duration(g.retryAfter)
	default:
		v.Allowed = true
		// What it holds is all it can promise: the rest of the window's
		// room is anyone's.
		v.Remaining = max(min(g.remaining, held-1), 0)
	}
	return g.newTAT, oldest
}

// takeReserved makes an admit of h on a reservation at slot head; it
// returns the reservation's slot, from which the admit moves to head. The
// caller holds s's lock.
func (s *shard) takeReserved(h keyhash.Hash, head int64) int64 {
	r := s.reservations[h]
	r.n--
	if r.slot != head {
		r.moved++
	}
	s.reservations[h] = r
	return r.slot
}

// claimMoved takes what must move out of h's reservation slot, as a count
// to add there (0: nothing), and forgets a reservation that is spent. The
// caller holds s's lock.
func (s *shard) claimMoved(h keyhash.Hash) SlotCount {
	r, ok := s.reservations[h]
	if !ok {
		return SlotCount{}
	}
	out := SlotCount{Slot: r.slot, Count: -r.moved}
	if r.moved = 0; r.n == 0 {
		delete(s.reservations, h)
	} else {
		s.reservations[h] = r
	}
	return out
}

// addReserved records n admits reserved for h in slot. The caller holds s's
// lock.
func (s *shard) addReserved(h keyhash.Hash, n, slot int64) {
	if s.reservations == nil {
		s.reservations = make(map[keyhash.Hash]reservation)
	}
	// A reservation is asked for only when none is left, by the step that
	// claims the last one's moves: nothing of an older one is left to keep.
	s.reservations[h] = reservation{n: n, slot: slot}
}

// reserveWant is how many admits a step asks to reserve for a key: its
// demand here over two intervals, at least one, at most two (reservations
// are the last admits of a window; one held unused is one another instance
// could have used), at most the limit.
func reserveWant(en *entry, events int64) int64 {
	return min(max(int64(2*en.ownRate+0.5), 1), 2, events)
}

// dropReservations forgets every reservation held here, when the store has
// lost them.
func (e *Engine) dropReservations() {
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) { clear(s.reservations) })
	}
}

// returnReservations gives back what this instance holds unused, at its
// last pass before it leaves: the store counts a reservation as admitted
// until its slot leaves the window, so one held by an instance that stopped
// would keep the fleet from the admit for up to a window. (A killed instance
// cannot: its reservations cost the fleet their window, never an excess.)
func (e *Engine) returnReservations() {
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) {
			for h, r := range s.reservations {
				// Out of its slot with the admits made from it elsewhere:
				// the next step's claimMoved takes them off the slot.
				r.moved += r.n
				r.n = 0
				s.reservations[h] = r
			}
		})
	}
}

// checkReserved forgets h's reservation if the store no longer counts it:
// its slot holds fewer admits than are reserved there (a store that
// restarted empty). The caller holds s's lock.
func (s *shard) checkReserved(h keyhash.Hash, slots []SlotCount) {
	r, ok := s.reservations[h]
	if !ok || r.n == 0 {
		return
	}
	for _, sc := range slots {
		if sc.Slot == r.slot && sc.Count >= r.n {
			return
		}
	}
	r.n = 0
	s.reservations[h] = r
}
