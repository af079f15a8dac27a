package ratelimit

import (
	"context"
	"math/rand/v2"
	"time"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/safego"
)

// evictEvery spaces out eviction sweeps, which take each shard's lock.
const evictEvery = time.Second

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

// Close stops the reconciler, pushes every admit the store has not seen
// and gives the grants back, then releases the slot, giving the store at
// most timeout. It is safe to call more than once.
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
// holder).
func (e *Engine) flush(ctx context.Context, now int64) bool {
	if e.solo {
		return true
	}
	e.passMu.Lock()
	defer e.passMu.Unlock()
	floorKeys := 0
	e.eachEntry(now, func(_ *Zone, _ *shard, _ keyhash.Hash, en *entry, ring []uint32) {
		if used, _ := en.scan(ring); en.flags&flagLease == 0 && used > 0 {
			floorKeys++
		}
	})
	var calls []call
	var leases []Lease
	e.eachEntry(now, func(z *Zone, s *shard, h keyhash.Hash, en *entry, ring []uint32) {
		if used, _ := en.scan(ring); len(calls) < flushKeys && (en.flags&flagLease != 0 || used > 0 && floorKeys <= flushFloorKeys) {
			c, l := e.claim(z, s, h, en, ring, now, true)
			calls, leases = append(calls, c), append(leases, l)
		}
	})
	return e.sync(ctx, now, calls, leases) == nil && floorKeys <= flushFloorKeys && len(calls) < flushKeys
}

// eachEntry calls fn with every tracked key, its ring advanced to now, under
// its shard's lock.
func (e *Engine) eachEntry(now int64, fn func(z *Zone, s *shard, h keyhash.Hash, en *entry, ring []uint32)) {
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) {
			s.index.each(func(idx int32) {
				en, ring := z.arena.at(idx)
				en.advance(ring, z.slots.Of(now))
				fn(z, s, en.hash, en, ring)
			})
		})
	}
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
	if now := time.Now().UnixNano(); !early && now-e.lastBeat.Load() >= e.beatEvery() {
		// A heartbeat is worth waiting for up to half its record's life,
		// not a pass's: the floors must not stop while the store answers.
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(e.staleAfter()/2))
		e.heartbeat(ctx, now)
		cancel()
	}
	// A pass bounded by one interval: a dead or black-holed store is known
	// down by the time the next pass is due.
	ctx, cancel := context.WithTimeout(context.Background(), passTimeout(time.Duration(e.interval.Load())))
	defer cancel()
	_ = e.pass(ctx, time.Now().UnixNano(), early)
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
}

// pass calls the store for the queued keys and, unless early, pushes the
// admits of the grants that ended: claim under the shard lock, one call per
// key in one round trip, merge the replies under the lock again.
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
	calls, leases := e.claimQueued(now)
	if !early {
		calls, leases = e.claimEnded(now, calls, leases)
	}
	return e.sync(ctx, now, calls, leases)
}

// passEnded wakes the requests waiting for a pass (see AwaitPass).
func (e *Engine) passEnded() {
	next := make(chan struct{})
	close(*e.passed.Swap(&next))
}

// claimQueued claims the keys queued for a call.
func (e *Engine) claimQueued(now int64) (calls []call, leases []Lease) {
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

// claimEnded claims the keys on leases whose grant ended with admits the
// store has not seen, to push them: the store then counts them exactly, in
// their time slots, and no longer holds what was left of the grant.
func (e *Engine) claimEnded(now int64, calls []call, leases []Lease) ([]call, []Lease) {
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) {
			for h, idx := range s.active {
				en, ring := z.arena.at(idx)
				if en.flags&flagQueued == 0 && now >= s.lease(en).blockUntil && en.unpushed(ring) {
					c, l := e.claim(z, s, h, en, ring, now, true)
					calls, leases = append(calls, c), append(leases, l)
				}
			}
		})
	}
	return calls, leases
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
