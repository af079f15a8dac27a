package ratelimit

import (
	"context"
	"math"
	"math/rand/v2"
	"time"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/safego"
)

// evictEvery spaces out eviction sweeps, which take each shard's lock.
const evictEvery = time.Second

// leaseIntervals is how many sync intervals of its demand a key asks a
// grant for (and how long a grant is used).
const leaseIntervals = 4

// call is what one store call does for one key, captured under the key's
// shard lock and carried out without it.
type call struct {
	zone   *Zone
	hash   keyhash.Hash
	demand uint32 // requests since the previous call
	// marked: the call marks the slot pushed.
	marked bool
}

// Start runs the reconciler in the background until Close. Calling it again
// does nothing. A store that can be pinged is asked first (for at most
// probeTimeout), so that an engine does not take a store it never reached as
// healthy; the heartbeat then takes an instance slot.
func (e *Engine) Start() {
	if e.started.CompareAndSwap(false, true) {
		if p, ok := e.store.(interface{ Ping(context.Context) error }); ok {
			ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
			if err := p.Ping(ctx); err != nil {
				e.storeFailed(err)
			} else {
				e.heartbeat(ctx, time.Now().UnixNano())
			}
			cancel()
		}
		go e.run()
	}
}

const probeTimeout = 300 * time.Millisecond

// Close stops the reconciler, pushes every admit the store has not seen,
// gives the grants back and unmarks the slot's keys, then releases the
// slot, giving the store at most timeout. It is safe to call more than
// once.
func (e *Engine) Close(timeout time.Duration) {
	if !e.stopped.CompareAndSwap(false, true) {
		return
	}
	close(e.stop)
	if e.started.Load() {
		<-e.done
	}
	leaveTime := min(probeTimeout, timeout/4)
	ctx, cancel := context.WithTimeout(context.Background(), timeout-leaveTime)
	flushed := e.flush(ctx, time.Now().UnixNano())
	cancel()
	ctx, cancel = context.WithTimeout(context.Background(), leaveTime)
	defer cancel()
	e.release(ctx, time.Now().UnixNano(), flushed)
}

// flushKeys bounds the keys on leases a stop pushes (about 20µs a call), and
// flushFloorKeys those on the floor: a stop that would push more floor keys
// pushes none of them and leaves its slot held back a window, as a dead
// one's (a rolling restart of instances with 10,000 keys each pushed 2,500
// keys a stop: 1.4 Redis commands a request).
const (
	flushKeys      = 50_000
	flushFloorKeys = 1_000
)

// flush gives back every grant and pushes every admit of the keys on
// leases, and of the keys on the floor if they are few, and reports
// whether every floor admit was pushed (the slot may then go to the next
// holder at once).
func (e *Engine) flush(ctx context.Context, now int64) bool {
	if e.solo {
		return true
	}
	e.passMu.Lock()
	defer e.passMu.Unlock()
	var calls []call
	var leases []Lease
	var floorKeys []keyhash.Hash
	var floorZones []*Zone
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) {
			for h, idx := range s.entries {
				en, ring := z.arena.at(idx)
				en.advance(ring, z.slots.Of(now))
				switch used, _ := en.scan(ring); {
				case en.flags&flagLease != 0 && len(calls) < flushKeys:
					c, l := e.claim(z, s, h, en, ring, now, true)
					calls, leases = append(calls, c), append(leases, l)
				case en.flags&flagLease == 0 && used > 0:
					floorKeys, floorZones = append(floorKeys, h), append(floorZones, z)
				}
			}
		})
	}
	all := len(floorKeys) <= flushFloorKeys && len(calls) < flushKeys
	if all {
		for i, h := range floorKeys {
			z := floorZones[i]
			s := z.shardOf(h)
			s.mu.Lock()
			if en, ring := z.lookup(s, h); en != nil {
				c, l := e.claim(z, s, h, en, ring, now, true)
				calls, leases = append(calls, c), append(leases, l)
			}
			s.mu.Unlock()
		}
	}
	return e.sync(ctx, now, calls, leases) == nil && all
}

// release gives the instance slot back at now: at once for the next holder
// when flushed, but for the keys on leases whose marks may still count,
// which it hands over; else a window on.
func (e *Engine) release(ctx context.Context, now int64, flushed bool) {
	if e.solo || e.slot.Load() < 0 {
		return
	}
	b := e.beat(now, 0, flushed)
	for _, z := range *e.zones.Load() {
		window := z.slots.N * z.slots.Len
		z.eachShard(func(s *shard) {
			for h, idx := range s.active {
				// A mark counts a window past its end: grants relied on it.
				if en, _ := z.arena.at(idx); en.markUntil+window > now {
					b.Handed = append(b.Handed, z.storeKey(h))
					b.HandedUntil = max(b.HandedUntil, (en.markUntil+window)/1e6)
				}
			}
		})
	}
	if len(b.Handed) > flushKeys {
		b.Flushed, b.Handed = false, nil
	}
	_, _ = e.store.Beat(ctx, e.slotsKey, e.hotKey, b)
}

func (e *Engine) run() {
	defer close(e.done)
	tick := time.NewTimer(e.nextTick())
	defer tick.Stop()
	var lastEvict, lastPass time.Time
	for {
		select {
		case <-e.stop:
			return
		case <-tick.C:
			if time.Since(lastEvict) >= evictEvery {
				e.safely("evict", func() { e.evict(time.Now().UnixNano()) })
				lastEvict = time.Now()
			}
			e.timedPass(false)
			lastPass = time.Now()
			tick.Reset(e.nextTick())
		case <-e.kick:
			// Coalesce: keys queued while we wait ride along.
			if wait := e.earlySpacing() - time.Since(lastPass); wait > 0 {
				select {
				case <-e.stop:
					return
				case <-time.After(wait):
				}
			}
			e.timedPass(true)
			lastPass = time.Now()
		}
	}
}

// nextTick is the interval with ±10% jitter, which keeps a fleet started
// together from calling in lockstep.
func (e *Engine) nextTick() time.Duration {
	interval := e.interval.Load()
	return time.Duration(interval + rand.Int64N(interval/5+1) - interval/10)
}

// earlySpacing is the least time between two passes for queued keys, which
// bounds the store load of a burst of them.
func (e *Engine) earlySpacing() time.Duration {
	return max(time.Duration(e.interval.Load())/20, time.Millisecond)
}

// safely runs one unit of the reconciler's work, so that a panic in it
// costs that unit, not the reconciler (and with it the process).
func (e *Engine) safely(where string, work func()) {
	defer safego.Recover("reconciler "+where, e.onPanic)
	work()
}

func (e *Engine) timedPass(early bool) {
	defer safego.Recover("reconciler pass", e.onPanic)
	// A pass bounded by one interval: a dead or black-holed store is known
	// down by the time the next pass is due.
	ctx, cancel := context.WithTimeout(context.Background(), passTimeout(time.Duration(e.interval.Load())))
	defer cancel()
	if now := time.Now().UnixNano(); !early && now-e.lastBeat.Load() >= e.beatEvery() {
		e.heartbeat(ctx, now)
	}
	_ = e.pass(ctx, time.Now().UnixNano(), early)
}

// beat is this instance's heartbeat at now (Unix ns), live for ttl (0:
// it releases its slot).
func (e *Engine) beat(now int64, ttl time.Duration, flushed bool) Beat {
	var keep int64
	for _, z := range *e.zones.Load() {
		keep = max(keep, z.slots.N*z.slots.Len)
	}
	return Beat{
		Member: e.member, Slot: int(e.slot.Load()), Now: now / 1e6, TTL: ttl, Flushed: flushed,
		Keep:         time.Duration(keep + e.markTTL()),
		View:         time.Duration(e.viewFor()),
		MaxInstances: e.MaxInstances(),
		HotFor:       time.Duration(3 * e.beatEvery()),
	}
}

// markTTL is how long a slot's mark of a key lasts unless renewed (ns):
// the others' grants end with it, so it outlasts a few of their calls (a
// quarter of the longest window, two leases' lives at least).
func (e *Engine) markTTL() int64 {
	var w int64
	for _, z := range *e.zones.Load() {
		w = max(w, z.slots.N*z.slots.Len)
	}
	return max(2*e.leaseLife(), w/4)
}

// heartbeat renews (or takes) this instance's slot, names the keys that
// went to leases here, and learns the slot table and the fleet's hot keys.
// A solo engine has no fleet. A failed heartbeat keeps what was learned
// last and marks the store down, as a failed pass does.
func (e *Engine) heartbeat(ctx context.Context, now int64) {
	if e.solo || len(*e.zones.Load()) == 0 {
		return
	}
	e.beatMu.Lock()
	defer e.beatMu.Unlock()
	e.lastBeat.Store(now)
	b := e.beat(now, time.Duration(e.staleAfter()), false)
	var active bool
	b.Hot, active = e.announce(now)
	b.Leasing = e.leased.Swap(false) || active
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
	e.slot.Store(int64(t.Slot))
	e.floorAt.Store(t.FloorAt * 1e6)
	if t.Holding&^e.holding.Load() != 0 {
		e.grownAt.Store(now)
	}
	e.holding.Store(t.Holding)
	e.viewLeasing.Store(b.Leasing)
	e.viewAt.Store(now)
	e.inherit(t.Handed, t.HandedUntil*1e6)
	e.live.Store(int64(t.Live))
	e.learnHot(t.Hot, now+int64(b.HotFor))
}

// announce names the keys on leases that were asked for since the last
// heartbeat: the others push their floor admits of them. active says some
// key is on leases here.
func (e *Engine) announce(now int64) (hot []string, active bool) {
	since := now - e.beatEvery()
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) {
			active = active || len(s.active) > 0
			for h, idx := range s.active {
				if en, _ := z.arena.at(idx); en.lastSeen >= since {
					hot = append(hot, z.storeKey(h))
				}
			}
		})
	}
	return hot, active
}

// inherit keeps the keys a slot's last holder handed over off this
// instance's floor until then (Unix ns), those of zones not made yet too
// (see Engine.Zone).
func (e *Engine) inherit(keys []string, until int64) {
	if len(keys) == 0 {
		return
	}
	e.zonesMu.Lock()
	defer e.zonesMu.Unlock()
	if e.inherited == nil {
		e.inherited = make(map[string]int64)
	}
	for _, k := range keys {
		e.inherited[k] = until
	}
	for _, z := range *e.zones.Load() {
		z.inherit(e.inherited)
	}
}

// inherit takes the keys of z among those handed over (store key -> until
// when, Unix ns). The caller holds the engine's zonesMu.
func (z *Zone) inherit(keys map[string]int64) {
	for k, until := range keys {
		if h, ok := z.keyOf(k); ok {
			s := z.shardOf(h)
			s.mu.Lock()
			if s.noFloor == nil {
				s.noFloor = make(map[keyhash.Hash]int64)
			}
			s.noFloor[h] = max(s.noFloor[h], until)
			s.mu.Unlock()
		}
	}
}

// learnHot takes the fleet's hot keys, hot until then (Unix ns). A key this
// instance holds on its floor is queued: the next pass pushes its floor
// admits and marks the slot pushed, so the others need not hold its floor
// back.
func (e *Engine) learnHot(hot []string, until int64) {
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) { clear(s.hot) })
	}
	for _, k := range hot {
		for _, z := range *e.zones.Load() {
			h, ok := z.keyOf(k)
			if !ok {
				continue
			}
			s := z.shardOf(h)
			s.mu.Lock()
			if s.hot == nil {
				s.hot = make(map[keyhash.Hash]int64)
			}
			s.hot[h] = until
			if en, _ := z.lookup(s, h); en != nil && en.flags&flagLease == 0 {
				e.enqueue(z, h, en)
			}
			s.mu.Unlock()
			break
		}
	}
}

// passTimeout bounds one reconcile pass: one interval, at least 200ms, at
// most 1s.
func passTimeout(interval time.Duration) time.Duration {
	return min(max(interval, 200*time.Millisecond), time.Second)
}

// Healthy reports whether the store is taken as reachable.
func (e *Engine) Healthy() bool { return e.healthy.Load() }

// LastSync is when a call last reached the store; the zero Time before the
// first.
func (e *Engine) LastSync() time.Time {
	if ns := e.lastSync.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// SyncErrors counts, since the engine was built, the passes and heartbeats
// that failed to reach the store, and a failed probe at Start.
func (e *Engine) SyncErrors() uint64 { return e.syncErrors.Load() }

func (e *Engine) evict(now int64) {
	e.passMu.Lock()
	defer e.passMu.Unlock()
	for _, z := range *e.zones.Load() {
		z.evict(now, int64(e.idleTTL))
	}
	if s, ok := e.store.(interface{ Sweep() }); ok {
		s.Sweep()
	}
}

// Reconcile runs one full pass now.
func (e *Engine) Reconcile(ctx context.Context) error {
	return e.pass(ctx, time.Now().UnixNano(), false)
}

// pass calls the store for the queued keys and, unless early, for the keys
// on leases whose hot mark is half spent: claim under the shard lock, one
// call per key in one round trip, merge the replies under the lock again.
func (e *Engine) pass(ctx context.Context, now int64, early bool) error {
	if e.solo {
		// The embedded store needs no call; a pass with keys reached it.
		for _, z := range *e.zones.Load() {
			if z.Keys() > 0 {
				e.storeOK()
				break
			}
		}
		return nil
	}
	if !e.healthy.Load() {
		// With the store down the queue waits: a heartbeat finds it back,
		// and the admits not pushed are pushed then.
		return nil
	}
	e.passMu.Lock()
	defer e.passMu.Unlock()
	defer e.passEnded()
	if early && e.onEarly != nil {
		e.onEarly()
	}
	// The marks first: a key is claimed once a pass (two calls of one
	// member for one key in one round trip would lose the first grant).
	var calls []call
	var leases []Lease
	if !early {
		calls, leases = e.claimMarks(now, calls, leases)
	}
	calls, leases = e.claimQueued(now, calls, leases)
	return e.sync(ctx, now, calls, leases)
}

// passEnded wakes the requests waiting for a pass (see AwaitPass).
func (e *Engine) passEnded() {
	next := make(chan struct{})
	close(*e.passed.Swap(&next))
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

// claimQueued claims the keys queued for a call.
func (e *Engine) claimQueued(now int64, calls []call, leases []Lease) ([]call, []Lease) {
	e.queueMu.Lock()
	q := e.queue
	e.queue = nil
	e.queueMu.Unlock()
	for _, k := range q {
		s := k.zone.shardOf(k.hash)
		s.mu.Lock()
		if en, ring := k.zone.lookup(s, k.hash); en != nil && en.flags&flagQueued != 0 {
			c, l := e.claim(k.zone, s, k.hash, en, ring, now, false)
			calls, leases = append(calls, c), append(leases, l)
		}
		s.mu.Unlock()
	}
	return calls, leases
}

// claimMarks claims the keys on leases that are hot and whose mark is half
// spent: renewed, so that the slot's floor of a key busy elsewhere stays
// pushed.
func (e *Engine) claimMarks(now int64, calls []call, leases []Lease) ([]call, []Lease) {
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) {
			for h, idx := range s.active {
				en, ring := z.arena.at(idx)
				if en.flags&flagQueued == 0 && s.isHot(h, now) && en.markUntil-now < e.markTTL()/2 {
					c, l := e.claim(z, s, h, en, ring, now, false)
					calls, leases = append(calls, c), append(leases, l)
				}
			}
		})
	}
	return calls, leases
}

// claim takes the key's unpushed admits and demand into a call. A key on
// its floor goes to leases: its floor admits are pushed, the slot marked,
// and what the floor still allowed is held as a grant, so that it may go
// on admitting while the call is under way. A key on leases renews its
// mark (unless its demand here fell under half its floor and it is not
// hot) and asks for its next block. flush (a stop) gives the grant back.
// The caller holds the key's shard lock.
func (e *Engine) claim(z *Zone, s *shard, h keyhash.Hash, en *entry, ring []uint32, now int64, flush bool) (call, Lease) {
	en.advance(ring, z.slots.Of(now))
	used, _ := en.scan(ring)
	events := z.events.Load()
	f := e.floorOf(events, now)
	slot := e.slot.Load()
	window := z.slots.N * z.slots.Len
	c := call{zone: z, hash: h, demand: en.demand}
	e.leased.Store(true)
	l := Lease{
		Key: z.storeKey(h), Now: now / 1e6, Oldest: z.slots.Oldest(now), TTL: time.Duration(2 * window),
		Member: e.member, Slot: int(slot), Floor: floorSize(events, e.MaxInstances()), Events: events,
		Until: (now + 2*window) / 1e6, Push: en.takeUnpushed(ring),
	}
	var view int64
	l.Holding, view = e.holdingAt(now)
	if !e.blockLive(en, now) {
		en.block = 0
	}
	if flush {
		// A stop gives the grant back; the slot's marks lapse by
		// themselves (grants rely on them), and the slot is not handed
		// out again before they have.
		en.block = 0
	} else {
		if en.flags&flagLease == 0 {
			z.toLease(s, h, en)
			en.block = max(f-used, 0)
		}
		// The mark is renewed while the key is busy here or hot; one
		// left to lapse lets the key go back to its floor (see
		// judgeLease).
		if slot >= 0 && (f == 0 || used*2 >= f || s.isHot(h, now)) {
			// (Set here too: the call may land even if its reply is lost.)
			c.marked = true
			l.Mark, l.MarkUntil = true, (now+e.markTTL())/1e6
			en.markUntil = max(en.markUntil, now+e.markTTL())
		}
		l.Held = en.block
		want := e.target(en, now)
		if en.flags&flagRated != 0 {
			// Far from the limit a block covers a quarter window of this
			// instance's demand, as far as a quarter of the room allows,
			// so that calls follow risk; near it, half the room at most,
			// down to one.
			long := int64(float64(en.rate) * float64(window) / float64(e.interval.Load()) / 4)
			want = min(max(want, min(long, en.room/4)), max(en.room/2, 1))
		}
		l.Want = max(want-en.block, 0)
		// The grant (and what is held, counted again) may be used for a
		// window, as far as the holding set it was made for stands, and
		// no longer than the marks it relied on (see merge).
		en.blockUntil, en.blockView = now+window, view
	}
	en.demand = 0
	en.flags &^= flagQueued
	return c, l
}

// target is the block a key on leases asks for: its demand over a lease's
// life, and one more.
func (e *Engine) target(en *entry, now int64) int64 {
	if en.flags&flagRated == 0 {
		return targetOf(float32(float64(en.demand) * float64(e.interval.Load()) / float64(max(now-en.calledAt, e.interval.Load()))))
	}
	return targetOf(en.rate)
}

// targetOf is the block for a demand of rate requests an interval.
func targetOf(rate float32) int64 {
	return int64(math.Ceil(float64(rate)*leaseIntervals)) + 1
}

// merge folds a call's reply into the key: its grant, the room, its mark
// and its demand rate.
func (e *Engine) merge(c *call, r *LeaseReply, now int64) {
	z := c.zone
	s := z.shardOf(c.hash)
	s.mu.Lock()
	defer s.mu.Unlock()
	en, _ := z.lookup(s, c.hash)
	if en == nil {
		return
	}
	if dt := now - en.calledAt; dt > 0 {
		own := float64(c.demand) * float64(e.interval.Load()) / float64(dt)
		keep := math.Exp(-float64(dt) / float64(demandHorizon*e.interval.Load()))
		if en.flags&flagRated == 0 {
			keep = 0
		}
		en.rate = float32(keep*float64(en.rate) + (1-keep)*own)
		en.flags |= flagRated
	}
	en.calledAt = now
	en.room = r.Room
	if en.flags&flagLease != 0 {
		en.block = max(en.block+r.Granted, 0)
		if r.MarksUntil > 0 {
			en.blockUntil = min(en.blockUntil, r.MarksUntil*1e6)
		}
		if c.marked {
			en.markUntil = max(en.markUntil, now+e.markTTL())
		}
	}
}

// storeFailed counts a failed call to the store, and gives up on the fleet
// once nothing has reached the store for staleAfter: a single slow or
// failed call (a busy machine's read past its timeout, a failover) is not
// an outage.
func (e *Engine) storeFailed(err error) {
	e.syncErrors.Add(1)
	if time.Now().UnixNano()-e.lastSync.Load() < e.staleAfter() {
		return
	}
	if e.healthy.Swap(false) {
		e.log.Warn("fleet counter store unreachable; limiting per instance until it returns",
			zap.Error(err))
	}
}

func (e *Engine) storeOK() {
	e.lastSync.Store(time.Now().UnixNano())
	if !e.healthy.Swap(true) {
		e.log.Info("fleet counter store reachable again; fleet-wide limits restored")
	}
}
