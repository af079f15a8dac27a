package ratelimit

import (
	"context"
	"math"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// call is what one store call does for one key, captured under the key's
// shard lock and carried out without it.
type call struct {
	zone   *Zone
	hash   keyhash.Hash
	hot    bool   // a hot call (see Lease.Hot), which measures the demand
	demand uint32 // requests since the previous hot call
	since  int64  // the previous hot call, Unix ns
}

// claim takes the key's unpushed admits and demand into a call. A key on
// its floor goes to leases: the call pushes its floor admits and marks this
// instance's life, and what the floor still allowed is held as a grant, so
// that it may go on admitting while the call is under way. A key on leases asks for its
// next grant. A push alone (flush: a stop, or a grant that ended) pushes
// and gives the grant back. The caller holds the key's shard lock.
func (e *Engine) claim(z *Zone, s *shard, h keyhash.Hash, en *entry, ring []uint32, now int64, flush bool) (call, Lease) {
	en.advance(ring, z.slots.Of(now))
	used, _ := en.scan(ring)
	events := z.events.Load()
	c := call{zone: z, hash: h, since: en.calledAt}
	l := Lease{
		Key: z.storeKey(h), Now: now / 1e6, Oldest: z.slots.Oldest(now), TTL: time.Duration(2 * z.window()),
		Member: e.member, Life: e.life.Load(), Floor: floorSize(events, e.slots()),
		Events: events, MaxInstances: e.slots(), Settle: time.Duration(e.settle()), Gap: time.Duration(z.gap()),
		Push: en.takeUnpushed(ring),
	}
	l.View, l.Lives = e.lives(now)
	if en.lease != 0 {
		if ls := s.lease(en); now >= ls.blockUntil || flush {
			ls.block = 0
		}
	}
	if !flush {
		if en.flags&flagLease == 0 {
			held := max(e.floorOf(z, s, h, now)-used, 0)
			z.toLease(s, h, en)
			s.lease(en).block = held
		}
		ls := s.lease(en)
		ahead, life := e.ahead(z, en, ls)
		l.Hot, l.Held = true, ls.block
		l.Want = max(int64(en.waiting)+ahead-ls.block, 0)
		// The grant (and what is held, counted again) may be used for its
		// life; the store counts it a window more.
		ls.ahead, ls.blockUntil = uint32(min(ahead, math.MaxUint32)), now+life
		l.Until = (ls.blockUntil + z.window()) / 1e6
		en.calledAt = now
		s.markHot(h, now+e.hotFor(z))
		c.hot, c.demand, en.demand, en.waiting = true, en.demand, 0, 0
	}
	en.flags &^= flagQueued
	return c, l
}

// ahead is how much of a key's demand a grant on leases holds ahead of its
// requests, and for how long it may be used (ns), within this instance's
// share of the room. Far from the limit (neither the window's pushed admits
// nor the instances that hold grants or live, each at this instance's
// demand, fill half of it), a grant's life of demand: few calls. Near it,
// an interval's, for a few intervals: what an instance killed held is lost
// to the fleet for a window, so most requests there wait for their call
// instead. A key not rated yet holds nothing ahead: its first call tells it
// the room.
func (e *Engine) ahead(z *Zone, en *entry, ls *leaseState) (n, life int64) {
	interval := e.interval.Load()
	n, life = 0, min(leaseIntervals*interval, z.grantLife())
	if en.flags&flagRated == 0 {
		return n, life
	}
	perNs := float64(ls.rate) / float64(interval)
	n = int64(ls.rate)
	fleet := max(perNs*float64(z.window()*max(int64(ls.holders), e.live.Load(), 1)), float64(ls.pushed))
	if fleet < float64(z.events.Load())/2 {
		n, life = int64(math.Ceil(perNs*float64(z.grantLife()))), z.grantLife()
	}
	return max(min(n, e.share(ls)), 0), life
}

// share is this instance's share of the room the fleet had at the key's
// last call: half of it, split among the instances that held grants or
// lived, so that what the others take of the rest leaves it.
func (e *Engine) share(ls *leaseState) int64 {
	return max(ls.room, 0) / (2 * max(int64(ls.holders), e.live.Load(), 1))
}

// leaseIntervals is how long a grant near the limit may be used, in
// intervals: a few calls.
const leaseIntervals = 4

// merge folds a call's reply into the key: its grant, the room and its
// holders, and, for a hot call, its demand rate.
func (e *Engine) merge(c *call, r *LeaseReply, now int64) {
	z := c.zone
	s := z.shardOf(c.hash)
	s.mu.Lock()
	defer s.mu.Unlock()
	en, _ := z.lookup(s, c.hash)
	if en == nil {
		return
	}
	// A flushed floor key takes a lease state too: what the store said
	// sizes its next grant.
	ls := s.leaseOf(en)
	if dt := now - c.since; c.hot && dt > 0 {
		own := float64(c.demand) * float64(e.interval.Load()) / float64(dt)
		keep := math.Exp(-float64(dt) / float64(demandHorizon*e.interval.Load()))
		if en.flags&flagRated == 0 {
			keep = 0
		}
		ls.rate = float32(keep*float64(ls.rate) + (1-keep)*own)
		en.flags |= flagRated
	}
	ls.room, ls.holders = r.Room, uint16(min(max(r.Holders, 1), math.MaxUint16))
	ls.pushed = uint32(min(max(r.Pushed, 0), math.MaxUint32))
	// With no room, ask again once some grows: the oldest pushed admits
	// leave the window, another's grant lapses, or (others give back what
	// they held) a few intervals on.
	ls.askAt = now + leaseIntervals*e.interval.Load()
	if r.Oldest > 0 {
		ls.askAt = min(ls.askAt, z.slots.LeavesAt(r.Oldest))
	}
	if r.Lapses > 0 {
		ls.askAt = min(ls.askAt, r.Lapses*1e6)
	}
	if en.flags&flagLease != 0 {
		ls.block = max(ls.block+r.Granted, 0)
	}
}

// sync runs the calls of a pass in one round trip and merges their replies.
// The caller holds passMu.
func (e *Engine) sync(ctx context.Context, now int64, calls []call, leases []Lease) error {
	if len(calls) == 0 {
		return nil
	}
	replies := make([]LeaseReply, len(leases))
	start := time.Now()
	err := e.store.Lease(ctx, leases, replies)
	if e.onPass != nil {
		e.onPass(time.Since(start), err)
	}
	for i := range calls {
		if replies[i].Err == nil {
			e.merge(&calls[i], &replies[i], now)
		}
	}
	if err != nil {
		e.storeFailed(err)
		return err
	}
	e.storeOK()
	return nil
}
