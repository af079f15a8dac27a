package ratelimit

import "time"

// judge decides one check at now and fills v; it changes only the key's
// clock (slots that left, last seen, demand) and its place in the queue.
// fleet is false alone or with the store down: the key is limited on this
// instance's count. It returns the GCRA state to record and the oldest slot
// that counts. The caller holds the key's shard lock, s.
func (e *Engine) judge(c *Check, s *shard, en *entry, ring []uint32, untracked *untrackedState, now int64, fleet bool, v *Verdict) (tat, oldest int64) {
	l := c.Limit
	if en == nil {
		return judgeUntracked(l, untracked, now, v), 0
	}
	en.advance(ring, l.slots.Of(now))
	en.see(now)
	en.demand++
	used, oldest := en.scan(ring)
	g := gcraCheck(en.tat, now, l)
	*v = Verdict{}
	left := l.Events - used - 1
	switch {
	case used >= l.Events:
		// This instance alone has admitted the limit.
		v.Fleet = true
		v.RetryAfter = time.Duration(en.untilFree(ring, l.slots, now, used-l.Events+1))
	case !fleet:
	case en.flags&flagLease == 0:
		left = e.judgeFloor(c, s, en, used, now, v)
	default:
		left = e.judgeLease(c, s, en, used, now, v)
	}
	v.settle(g, left)
	return g.newTAT, oldest
}

// judgeFloor admits a key on this slot's floor while its own admits in the
// window stay under F. From three quarters of F on, or with no floor (none
// usable, or the key is hot), it is queued to go to leases. It returns what
// is left.
func (e *Engine) judgeFloor(c *Check, s *shard, en *entry, used, now int64, v *Verdict) int64 {
	f := e.floorOf(c.Zone, s, c.Key, now)
	if (used+1)*4 >= 3*f {
		e.enqueue(c.Zone, c.Key, en)
	}
	if used >= f {
		v.Fleet, v.Leasing = true, true
		v.RetryAfter = time.Duration(e.interval.Load())
		en.waiting++
	}
	return f - used - 1
}

// judgeLease admits a key on leases while its grant lasts, and queues the
// next call when it runs short. A key with no grant left goes back to its
// floor once it is no longer hot (floorOf is 0 until then). It returns what
// is left: the grant, and this instance's share of the room the fleet had
// at the last call (the rest may go to the others).
func (e *Engine) judgeLease(c *Check, s *shard, en *entry, used, now int64, v *Verdict) int64 {
	ls := s.lease(en)
	if now >= ls.blockUntil {
		ls.block = 0
	}
	if ls.block == 0 && used < e.floorOf(c.Zone, s, c.Key, now) {
		c.Zone.toFloor(s, c.Key, en)
		return e.judgeFloor(c, s, en, used, now, v)
	}
	interval := e.interval.Load()
	var queue bool
	if ls.block == 0 {
		// With no room at the last call, ask again once some may have
		// grown.
		queue = ls.room > 0 || en.flags&flagRated == 0 || now >= ls.askAt
	} else {
		// Half of what it held ahead spent, or about to end.
		queue = ls.block*2 <= int64(ls.ahead) || ls.blockUntil-now < 2*interval
	}
	if queue {
		e.enqueue(c.Zone, c.Key, en)
	}
	if ls.block == 0 {
		v.Fleet, v.Leasing = true, queue
		v.RetryAfter = time.Duration(interval)
		if queue {
			en.waiting++
		}
	}
	return ls.block - 1 + e.share(ls)
}

// settle completes a verdict the fleet did not refuse by the key's GCRA
// check, with what the fleet may still admit of the key (left).
func (v *Verdict) settle(g gcra, left int64) {
	switch {
	case v.Fleet:
	case !g.allowed:
		v.RetryAfter = time.Duration(g.retryAfter)
	default:
		v.Allowed = true
		v.Remaining = max(min(g.remaining, left), 0)
	}
}

// judgeUntracked decides a request of a key the zone does not track: by the
// local cap alone, as nothing counts the key's window. It returns the GCRA
// state to record.
func judgeUntracked(l *Limit, st *untrackedState, now int64, v *Verdict) (tat int64) {
	g := gcraCheck(st.tat, now, l)
	*v = Verdict{Allowed: g.allowed, RetryAfter: time.Duration(g.retryAfter)}
	if g.allowed {
		v.Remaining = g.remaining
		v.Reset = time.Duration(gcraRefill(g.newTAT, now, g.remaining, l))
	}
	return g.newTAT
}

// record counts an admitted request in the key's ring (and, on leases,
// takes it from the grant), or for an untracked key in its local cap alone.
// The caller holds the key's shard lock, s.
func record(s *shard, en *entry, ring []uint32, untracked *untrackedState, l *Limit, tat, oldest, now int64, v *Verdict) {
	if en == nil {
		untracked.tat = tat
		return
	}
	ring[slotIndex(en.head, int64(len(ring)))]++
	if en.flags&flagLease != 0 {
		ls := s.lease(en)
		ls.block = max(ls.block-1, 0)
	}
	en.tat = tat
	// The oldest counted request (this one, if it is the only one) leaves the
	// window when its slot does.
	v.Reset = time.Duration(max(l.slots.LeavesAt(oldest)-now, 0))
}
