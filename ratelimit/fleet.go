package ratelimit

import "github.com/fleetguard/fleetguard/internal/keyhash"

// The fleet model's quantities: a slot's floor F, and the times its rules
// rest on, from the sync interval and a zone's window (all in ns).

// floorSize is F, a slot's floor of a key of events.
func floorSize(events int64, slots int) int64 {
	return int64(FloorFraction * float64(events) / float64(slots))
}

// floor is this instance's floor of a key of events at now: 0 without a
// slot, past its record's end (a heartbeat that has not reached the store
// for a while: another may take the slot), and with floors off.
func (e *Engine) floor(events, now int64) int64 {
	if !e.floors.Load() || e.slot.Load() < 0 || now >= e.heldUntil.Load() {
		return 0
	}
	return floorSize(events, e.slots())
}

// floorOf is the key's floor here at now: 0 while the key is hot, as the
// fleet may have granted its floor to others (see Zone.offFloor), and in a
// zone that has not heard the hot keys yet. The caller holds the key's
// shard lock, s.
func (e *Engine) floorOf(z *Zone, s *shard, h keyhash.Hash, now int64) int64 {
	if !z.heard.Load() || len(s.hot) > 0 && s.hot[h]+z.offFloor() > now {
		return 0
	}
	return e.floor(z.events.Load(), now)
}

// beatEvery spaces the heartbeats: two intervals.
func (e *Engine) beatEvery() int64 { return 2 * e.interval.Load() }

// staleAfter is how long the store may fail before limits go per instance,
// and how long a slot record lives past its heartbeat.
func (e *Engine) staleAfter() int64 {
	return max(4*e.interval.Load(), 2e9)
}

// viewFor is how long a heartbeat's lives of the slots stand for lease
// calls: two heartbeats. A staler view holds every floor back.
func (e *Engine) viewFor() int64 { return 2 * e.beatEvery() }

// settle is how long after a key's hot period began every life that takes a
// slot has heard of it: a hot call is announced at the caller's next
// heartbeat (within three), and the callers' views of who holds a slot are
// up to viewFor old. Until then every floor not marked is held back, free
// slots' too.
func (e *Engine) settle() int64 { return e.viewFor() + 3*e.beatEvery() }

// hotFor is how long after a call a key is hot: a period's gap and its
// settle, so that while hot calls come a gap apart, every life that took a
// slot since the period settled has heard it is hot until after the call.
func (e *Engine) hotFor(z *Zone) int64 { return z.gap() + e.settle() }

// window is the zone's window.
func (z *Zone) window() int64 { return z.slots.N * z.slots.Len }

// gap is the longest pause between hot calls of one hot period: past it the
// next call begins a new period (young until it settles), and the marks of
// the last are dropped. A grant's life: a key in demand on
// leases calls at least that often.
func (z *Zone) gap() int64 { return z.grantLife() }

// grantLife is how long a grant may be used; its admits count a window
// more, and so does its record in the store.
func (z *Zone) grantLife() int64 { return z.window() / 2 }

// offFloor is how long past the end of a key's hot time it stays off the
// floor of a life that heard it: grants made in the period held nothing
// back for that life's floor, and their admits count until a grant's life
// and a window after the last.
func (z *Zone) offFloor() int64 { return z.window() + z.grantLife() }
