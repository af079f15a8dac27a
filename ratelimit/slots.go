package ratelimit

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// slotView is the lives of the slots as a heartbeat at (Unix ns) learned
// them.
type slotView struct {
	at    int64
	lives []int64
}

// lives is what a lease call at now holds floors back by: the lives of the
// slots as of the last heartbeat, while it is recent enough (see viewFor);
// else none is known and every floor is held back.
func (e *Engine) lives(now int64) (bool, []int64) {
	v := e.view.Load()
	if v == nil || now-v.at >= e.viewFor() {
		return false, nil
	}
	return true, v.lives
}

// beat is this instance's heartbeat at now (Unix ns), live for ttl (0: it
// releases its slot).
func (e *Engine) beat(now int64, ttl time.Duration, flushed bool) Beat {
	var keep, hotKeep int64
	for _, z := range *e.zones.Load() {
		keep, hotKeep = max(keep, z.window()), max(hotKeep, z.offFloor())
	}
	return Beat{Member: e.member, Slot: int(e.slot.Load()), Now: now / 1e6, TTL: ttl, Flushed: flushed,
		Keep: time.Duration(keep), Settle: time.Duration(e.settle()), MaxInstances: e.MaxInstances(), HotKeep: time.Duration(hotKeep)}
}

// heartbeat renews (or takes) this instance's slot, names the keys it
// called hot since its last heartbeat that reached the store, and learns
// the slots' lives and the fleet's hot keys. A solo engine has no fleet. A
// failed heartbeat keeps what was learned last and marks the store down, as
// a failed pass does.
func (e *Engine) heartbeat(ctx context.Context, now int64) {
	if e.solo || len(*e.zones.Load()) == 0 {
		return
	}
	e.beatMu.Lock()
	defer e.beatMu.Unlock()
	e.lastBeat.Store(now)
	b := e.beat(now, time.Duration(e.staleAfter()), false)
	b.Hot = e.announce(e.announced)
	start := time.Now()
	t, err := e.store.Beat(ctx, e.slotsKey, e.hotKey, b)
	if e.onPass != nil {
		// With every key on its floor the heartbeat is the only call: the
		// store's metrics are told of it as of a pass.
		e.onPass(time.Since(start), err)
	}
	if err != nil {
		e.storeFailed(err)
		return
	}
	e.storeOK()
	e.announced = now
	e.slot.Store(int64(t.Slot))
	e.life.Store(t.Life)
	e.heldUntil.Store(now + e.staleAfter())
	e.view.Store(&slotView{at: now, lives: t.Lives})
	e.live.Store(int64(t.Live))
	e.learnSlots(t.Slots)
	for _, z := range *e.zones.Load() {
		z.learnHot(t.Hot, e, now)
	}
}

// learnSlots takes the fleet's max instances from a heartbeat. An instance
// configured otherwise holds no slot (its floors would not add up with the
// fleet's): it leases every key until none is held under the fleet's
// number, and says so once.
func (e *Engine) learnSlots(n int) {
	e.fleetSlots.Store(int64(n))
	if n != e.MaxInstances() && e.lastMismatch.Swap(int64(n)) != int64(n) {
		e.log.Warn("fleet max_instances differs from this instance's; every key on leases until no instance holds a slot under the fleet's",
			zap.Int("configured", e.MaxInstances()), zap.Int("fleet", n))
	}
}

// release gives the instance slot back at now: free for the next holder at
// once when flushed (every floor admit pushed), else a window on.
// It names the keys called hot since the last heartbeat, as one would.
func (e *Engine) release(ctx context.Context, now int64, flushed bool) {
	if e.solo || e.slot.Load() < 0 {
		return
	}
	e.beatMu.Lock()
	defer e.beatMu.Unlock()
	b := e.beat(now, 0, flushed)
	b.Hot = e.announce(e.announced)
	_, _ = e.store.Beat(ctx, e.slotsKey, e.hotKey, b)
}

// announce names the keys called hot after since (Unix ns), with until
// when each is hot: every instance hears them at its next heartbeat, and
// one that takes a slot hears them before it admits anything.
func (e *Engine) announce(since int64) []HotKey {
	var hot []HotKey
	for _, z := range *e.zones.Load() {
		hotFor := e.hotFor(z)
		z.eachShard(func(s *shard) {
			for h, idx := range s.active {
				if en, _ := z.arena.at(idx); en.calledAt > since {
					hot = append(hot, HotKey{Key: z.storeKey(h), Until: (en.calledAt + hotFor) / 1e6})
				}
			}
		})
	}
	return hot
}

// learnHot takes the fleet's hot keys of z at now: each stays off this
// instance's floor until its hot time and offFloor have passed. With a slot,
// a key not on leases here (on the floor, or not seen yet) is queued, so
// that the next pass pushes its floor admits and marks this life, and the
// fleet need not hold this floor back.
func (z *Zone) learnHot(hot []HotKey, e *Engine, now int64) {
	slot := e.slot.Load() >= 0
	for _, k := range hot {
		h, ok := z.keyOf(k.Key)
		if !ok {
			continue
		}
		s := z.shardOf(h)
		s.mu.Lock()
		s.markHot(h, k.Until*1e6)
		if slot {
			if en, _ := z.track(s, h, now); en != nil && en.flags&flagLease == 0 {
				e.enqueue(z, h, en)
			}
		}
		s.mu.Unlock()
	}
	z.heard.Store(true)
	after := z.offFloor()
	z.eachShard(func(s *shard) {
		for h, until := range s.hot {
			if until+after <= now {
				delete(s.hot, h)
			}
		}
	})
}

// markHot keeps h hot until then (Unix ns) at least. The caller holds the
// shard's lock.
func (s *shard) markHot(h keyhash.Hash, until int64) {
	if s.hot == nil {
		s.hot = make(map[keyhash.Hash]int64)
	}
	s.hot[h] = max(s.hot[h], until)
}
