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

// plan is what one reconcile pass does for one key, captured under the key's
// shard lock and carried out without it.
type plan struct {
	zone   *Zone
	hash   keyhash.Hash
	demand uint32 // this instance's demand pushed by the step
	readAt int64  // the entry's previous read (see entry.readAt)
	// reserveSlot is the slot the step asked to reserve admits in, if it
	// asked (see reserve.go).
	reserveSlot int64
	// join: the step pushes a floor-share key's admits and registers it as
	// synced; leave: it deregisters a synced key that went back under its
	// floor share.
	join, leave bool
	// floor is the floor push the step sends (see Step.FloorID): kept, if
	// the step fails, to be sent again as it was.
	floor floorPush
}

// Start runs the reconciler in the background until Close. Calling it again
// does nothing. A store that can be pinged is asked first (for at most
// probeTimeout), so that an engine does not take a store it never reached as
// healthy.
func (e *Engine) Start() {
	if e.started.CompareAndSwap(false, true) {
		if p, ok := e.store.(interface{ Ping(context.Context) error }); ok {
			ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
			if err := p.Ping(ctx); err != nil {
				e.storeFailed(err)
			} else {
				e.heartbeat(ctx, time.Now().UnixMilli())
			}
			cancel()
		}
		go e.run()
	}
}

const probeTimeout = 300 * time.Millisecond

// Close stops the reconciler and pushes what is still pending, giving the
// store at most timeout. It is safe to call more than once.
func (e *Engine) Close(timeout time.Duration) {
	if !e.stopped.CompareAndSwap(false, true) {
		return
	}
	close(e.stop)
	if e.started.Load() {
		<-e.done
	}
	// The pushes get the time but what the leave needs: a flush too large
	// for it (many keys on floor shares) fails, and the instance leaves as
	// it did before (not flushed) rather than staying a member until its
	// heartbeat lapses.
	leaveTime := min(probeTimeout, timeout/4)
	ctx, cancel := context.WithTimeout(context.Background(), timeout-leaveTime)
	flushed := e.flush(ctx, time.Now().UnixNano())
	cancel()
	ctx, cancel = context.WithTimeout(context.Background(), leaveTime)
	defer cancel()
	// Stamped after the pushes landed: a read that starts later counts them.
	e.depart(ctx, time.Now().UnixNano(), flushed)
}

// flush gives back the reservations this instance holds unused and pushes
// every admit it has not pushed, those on floor shares included, so that
// the others need not leave them aside (see goneAside). Each key pushed is
// registered as synced here, as in any pass: until the others hear that
// this instance left, they count it as syncing the key, which it did, and
// leave nothing aside for it (a registration deleted now had them leave a
// whole floor share aside meanwhile). It reports whether every push
// reached the store.
func (e *Engine) flush(ctx context.Context, now int64) bool {
	e.returnReservations()
	e.passMu.Lock()
	defer e.passMu.Unlock()
	plans, steps, all := e.claimStopping(now)
	return e.sync(ctx, now, plans, steps) == nil && all
}

// flushFloorKeys bounds the keys on floor shares a stop pushes: at about
// 20µs a step, more would not fit the shutdown's time, and the stop
// pushes only what is not on a floor share, as a killed instance would
// have (the others leave its floor shares aside).
const flushFloorKeys = 50_000

// depart tells the fleet this instance is gone, at now, rather than when its
// heartbeat lapses; its record stays for as long as its floor admits count
// in a window. A record whose Seen is its end says that every floor admit
// was pushed by then (flushed); otherwise Seen is the last heartbeat, before
// now.
func (e *Engine) depart(ctx context.Context, now int64, flushed bool) {
	if e.solo || e.members.Load() == 0 {
		return
	}
	nowMs := now / int64(time.Millisecond)
	seen := min(e.lastHeartbeat.Load(), nowMs-1)
	if flushed {
		seen = nowMs
	}
	_, _ = e.store.Heartbeat(ctx, e.membersKey, e.hotKey, Heartbeat{Member: e.member, Now: nowMs, Joined: e.joined.Load(), Seen: seen, Keep: e.keep()})
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
// together from pushing in lockstep.
func (e *Engine) nextTick() time.Duration {
	interval := e.interval.Load()
	return time.Duration(interval + rand.Int64N(interval/5+1) - interval/10)
}

// earlySpacing is the least time between two passes when keys ask for an
// early sync, which bounds the store load of early syncs.
func (e *Engine) earlySpacing() time.Duration {
	return max(time.Duration(e.interval.Load())/earlySyncsPerInterval, time.Millisecond)
}

// earlySyncsPerInterval bounds the early passes per sync interval.
const earlySyncsPerInterval = 20

// safely runs one unit of the reconciler's work, so that a panic in it
// costs that unit, not the reconciler (and with it the process).
func (e *Engine) safely(where string, work func()) {
	defer safego.Recover("reconciler "+where, e.onPanic)
	work()
}

func (e *Engine) timedPass(early bool) {
	defer safego.Recover("reconciler pass", e.onPanic)
	// A pass bounded by one interval: a dead or black-holed store is known
	// down by the time the next pass is due (a floor keeps short intervals
	// from calling a briefly busy store dead).
	ctx, cancel := context.WithTimeout(context.Background(), passTimeout(time.Duration(e.interval.Load())))
	defer cancel()
	if now := time.Now().UnixMilli(); !early && now-e.lastHeartbeat.Load() >= e.heartbeatEvery() {
		e.heartbeat(ctx, now)
	}
	_ = e.pass(ctx, time.Now().UnixNano(), early)
}

// heartbeatEvery spaces the heartbeats (ms): a quarter of their lifetime
// (staleAfter), so that a missed one or two do not drop an instance, and a
// change of the fleet's size is known within that time.
func (e *Engine) heartbeatEvery() int64 {
	return e.staleAfter() / 4 / int64(time.Millisecond)
}

// heartbeat tells the store this instance is live and which keys it syncs
// because they are busy here, and learns the fleet: its members, which set
// every zone's floor shares (see see), and its hot keys (see learnHot). A
// solo engine has no fleet. A failed heartbeat keeps what was learned last
// and marks the store down, as a failed pass does.
func (e *Engine) heartbeat(ctx context.Context, nowMs int64) {
	if e.solo || len(*e.zones.Load()) == 0 {
		return // no fleet limit here: nothing for the fleet to know
	}
	e.heartbeatMu.Lock()
	defer e.heartbeatMu.Unlock()
	e.lastHeartbeat.Store(nowMs)
	e.joined.CompareAndSwap(0, nowMs)
	now := nowMs * int64(time.Millisecond)
	promise := e.propose(now)
	f, err := e.store.Heartbeat(ctx, e.membersKey, e.hotKey, Heartbeat{
		Member: e.member, Now: nowMs, TTL: time.Duration(e.staleAfter()),
		Joined: e.joined.Load(), Seen: nowMs, Keep: e.keep(), Hot: e.announce(now),
		Promise: promise.encode(), Known: e.knownPromises(),
	})
	e.promiseSent(promise, err == nil)
	if err != nil {
		// With every key on its floor share, the heartbeat is the only call:
		// it tells whether the store is reachable.
		e.storeFailed(err)
		return
	}
	e.storeOK()
	e.holdPromises(&f, nowMs)
	e.see(f, now)
	e.learnHot(f.Hot, now)
}

// keep is how long this instance's record must outlive it: the longest
// window of its zones, in which its floor admits still count.
func (e *Engine) keep() time.Duration {
	var w int64
	for _, z := range *e.zones.Load() {
		w = max(w, z.slots.N*z.slots.Len)
	}
	return time.Duration(w + e.staleAfter())
}

// see sets every zone's view of the fleet from the membership's records.
//
// A floor share is a promise the fleet keeps across restarts: every
// instance's floor admits in any window, added up, stay within
// floorFraction × events. So an instance that left or died keeps its claim
// while its floor admits still count (one window), and a new instance takes
// no floor share until the larger shares the others held before it joined
// have left the window: one window after it joined, plus a heartbeat's
// lifetime for the others to hear of it. Until then it syncs the keys it
// sees. Instances that joined within half a heartbeat lifetime of the
// membership's founding (a fleet started together, or a store that
// restarted empty) take their shares together, a heartbeat lifetime after
// it.
func (e *Engine) see(f Fleet, now int64) {
	staleMs := e.staleAfter() / int64(time.Millisecond)
	nowMs := now / int64(time.Millisecond)
	var live int64
	for _, r := range f.Members {
		if r.Until > nowMs {
			live++
		}
	}
	if e.members.Swap(live) == 0 {
		// Just joined: for as long as a read is trusted, a key busy here
		// syncs early (see floorAdmits), as it is likely busy elsewhere too.
		e.warmUntil.Store(now + e.staleAfter())
	}
	old := e.founded.Swap(f.Founded)
	refounded := old != 0 && old != f.Founded
	if refounded {
		// The store restarted empty: the reservations it held are gone, and
		// what it counts from now on comes on top of what the keys' rings
		// hold.
		e.dropReservations()
		e.markLost()
	}
	for _, z := range *e.zones.Load() {
		v := e.countFleet(f, z.slots.N*z.slots.Len/int64(time.Millisecond), staleMs, nowMs)
		if v.eligible {
			z.fleet.eligible.Store(true)
		}
		z.fleet.probation.Store(v.probation)
		z.fleet.founding.Store(v.founding && !z.fleet.eligible.Load())
		z.fleet.probationClaims.Store(v.probationClaims)
		z.fleet.probationFewest.Store(&v.probationFewest)
		prev := z.fleet.claims.Load()
		if refounded && prev > v.claims {
			// A store that restarted empty forgot the records of those
			// gone: keep their claims for a window.
			v.claims = prev
		}
		if prev > 0 && v.claims > prev && nowMs >= f.Founded+staleMs {
			// A join, once shares are held: the others may go on with
			// their larger shares until they hear of it, and so may this
			// one (see claimsAt); the one who joined takes none for far
			// longer.
			z.fleet.graceClaims.Store(prev)
			z.fleet.graceUntil.Store(now + e.staleAfter()/2)
		}
		z.fleet.known.Store(v.known)
		z.fleet.claims.Store(v.claims)
		z.fleet.others.Store(v.others)
		z.fleet.holders.Store(v.holders)
		z.fleet.othersSeen.Store(v.othersSeen)
		z.fleet.gone.Store(&v.gone)
	}
}

// fleetCount is what the membership's records say of a zone's floor
// shares (see fleetView, which keeps it).
type fleetCount struct {
	claims, known, others, holders int64
	othersSeen                     int64 // Unix ns: the earliest last heartbeat of the others
	gone                           []goneRecord
	eligible                       bool  // this instance may take its floor share
	founding                       bool  // it is a founder that will take its share with the others
	probation                      bool  // it may take a probation share meanwhile
	probationClaims                int64 // the probation claims now (see probationTerm)
	probationFewest                []int64
}

// countFleet counts the records for a zone of the window given.
func (e *Engine) countFleet(f Fleet, windowMs, staleMs, nowMs int64) fleetCount {
	c := fleetCount{othersSeen: math.MaxInt64}
	terms := make([]probationTerm, len(f.Members))
	onProbation := make([]bool, len(f.Members))
	for i, r := range f.Members {
		eligibleAt := r.Joined + windowMs + staleMs
		founder := r.Joined <= f.Founded+staleMs/2
		if founder {
			eligibleAt = f.Founded + staleMs
		}
		terms[i], onProbation[i] = probationTermOf(r, founder, eligibleAt, windowMs, staleMs)
		knownToAll := r.Joined <= nowMs-staleMs || founder && nowMs >= eligibleAt
		switch {
		case r.Member == e.member:
			c.claims++
			if knownToAll {
				c.known++
			}
			c.eligible = nowMs >= eligibleAt
			c.founding = founder && !c.eligible
			// A fleet's founders take their floor shares together, 2 s
			// after the founding, and no probation share before; a new
			// instance takes its probation share once its term started.
			c.probation = onProbation[i] && !c.eligible && nowMs >= terms[i].from
		case r.Until > nowMs:
			c.claims++
			c.others++
			if knownToAll {
				c.known++
			}
			if nowMs+staleMs >= eligibleAt {
				c.holders++
				onProbation[i] = false // left aside a floor share
			}
			c.othersSeen = min(c.othersSeen, r.Seen*int64(time.Millisecond))
		case r.Seen >= eligibleAt && nowMs < r.Until+windowMs:
			// Gone, having known itself eligible: what it admitted
			// on its floor share counts until a window after its end.
			c.claims++
			c.known++
			c.gone = append(c.gone, goneRecord{seen: r.Seen * int64(time.Millisecond), flushed: flushedAt(r), promise: r.Promise})
			onProbation[i] = false
		}
	}
	c.countProbation(f, terms, onProbation, e.member, nowMs)
	return c
}

// countProbation counts the probation shares the others of the fleet may
// hold: those whose term has started (for one gone, before its last
// heartbeat) and not ended.
func (c *fleetCount) countProbation(f Fleet, terms []probationTerm, onProbation []bool, self, nowMs int64) {
	timeline := timelineOf(terms)
	c.probationClaims = timeline.claimsAt(nowMs)
	for i, r := range f.Members {
		t := terms[i]
		live := r.Until > nowMs
		if !onProbation[i] || r.Member == self || nowMs >= t.to || nowMs < t.from || !live && r.Seen < t.from {
			continue
		}
		fewest := timeline.fewestClaims(t, nowMs)
		if live {
			c.probationFewest = append(c.probationFewest, fewest)
		} else {
			c.gone = append(c.gone, goneRecord{seen: r.Seen * int64(time.Millisecond), flushed: flushedAt(r), fewest: fewest, promise: r.Promise})
		}
	}
}

// flushedAt is when a gone instance left having pushed every floor admit it
// had made, as its record says (its Seen is its end, see depart), in Unix
// ns; 0 if it did not.
func flushedAt(r MemberRecord) int64 {
	if r.Seen >= r.Until {
		return r.Until * int64(time.Millisecond)
	}
	return 0
}

// announce lists the keys this instance syncs because they are busy here:
// its demand for them is at least half a floor share a window. While they
// are hot, no instance admits them on a floor share, so the instances that
// sync them need to leave nothing aside for floor admits they cannot see.
func (e *Engine) announce(now int64) []HotKey {
	var hot []HotKey
	until := (now + int64(e.memberTTL())) / int64(time.Millisecond)
	interval := float64(e.interval.Load())
	for _, z := range *e.zones.Load() {
		events := z.events.Load()
		sh := share(events, z.fleet.widest())
		if sh == 0 {
			continue
		}
		perWindow := float64(z.slots.N*z.slots.Len) / interval
		z.eachShard(func(s *shard) {
			for h, idx := range s.active {
				en, ring := z.arena.at(idx)
				if en.flags&(flagSynced|flagLeaving) != flagSynced || float64(en.ownRate)*perWindow*2 < float64(sh) {
					continue
				}
				en.advance(ring, z.slots.Of(now))
				used, _ := en.scan(ring)
				// The room left but for the floor admits of those gone (the
				// live ones stop using theirs as they hear of it), as it will
				// be when the others read it: up to two heartbeats on, with
				// what leaves the window meanwhile, less what the fleet asks.
				// Those gone that heard the key hot pushed theirs, as the
				// request path counts them (bench/churn, kill: a dozen gone
				// restarts' headrooms left no room, and a new instance's
				// first request of a key at 90% of its limit was denied).
				ahead := 2 * float64(e.heartbeatEvery()*int64(time.Millisecond)) / interval
				m, isHot := s.hotAt(h, now)
				room := events - used - e.goneAside(z, h, en, m, isHot, sh, events, now) + int64(ahead*(float64(used)/perWindow-float64(en.fleetRate)))
				hot = append(hot, HotKey{Key: z.storeKey(h), Until: until, Room: room})
			}
		})
	}
	return hot
}

// learnHot takes the fleet's hot keys as the shards' hot marks. A key this
// instance holds on its floor share is queued to start syncing: the next
// early pass pushes what it admitted on the floor share and registers it.
func (e *Engine) learnHot(hot []HotKey, now int64) {
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) { clear(s.hot) })
	}
	for _, k := range hot {
		for _, z := range *e.zones.Load() {
			h, ok := z.keyOf(k.Key)
			if !ok {
				continue
			}
			s := z.shardOf(h)
			s.mu.Lock()
			if s.hot == nil {
				s.hot = make(map[keyhash.Hash]hotMark)
			}
			s.hot[h] = hotMark{at: k.At * int64(time.Millisecond), until: k.Until * int64(time.Millisecond), room: k.Room}
			if en, _ := z.lookup(s, h); en != nil && en.flags&flagFloor != 0 {
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

// Healthy reports whether the last reconcile pass reached the store.
func (e *Engine) Healthy() bool { return e.healthy.Load() }

// LastSync is when a reconcile pass last reached the store; the zero Time
// before the first. A pass with no key to sync does not contact the store,
// so an instance with no active key does not move it.
func (e *Engine) LastSync() time.Time {
	if ns := e.lastSync.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// SyncErrors counts, since the engine was built, the reconcile passes that
// failed to reach the store, and a failed probe at Start.
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

// Reconcile runs one pass over every active key now.
func (e *Engine) Reconcile(ctx context.Context) error {
	return e.pass(ctx, time.Now().UnixNano(), false)
}

// pass syncs every active key, or with early only the queued ones: claim
// under the shard lock, one store step per key in one round trip, merge the
// replies under the lock again.
func (e *Engine) pass(ctx context.Context, now int64, early bool) error {
	e.passMu.Lock()
	defer e.passMu.Unlock()
	var plans []plan
	var steps []Step
	if early {
		plans, steps = e.claimQueued(now)
		if e.onEarly != nil {
			e.onEarly()
		}
	} else {
		plans, steps = e.claimActive(now)
	}
	return e.sync(ctx, now, plans, steps)
}

// sync runs the steps of a pass in one round trip and merges their replies.
// The caller holds passMu.
func (e *Engine) sync(ctx context.Context, now int64, plans []plan, steps []Step) error {
	if len(plans) == 0 {
		return nil
	}
	replies := make([]Reply, len(steps))
	start := time.Now()
	err := e.store.Sync(ctx, steps, replies)
	if e.onPass != nil {
		e.onPass(time.Since(start), err)
	}
	interval := e.interval.Load()
	joined := false
	for i := range plans {
		if replies[i].Err == nil {
			e.merge(&plans[i], &replies[i], now, interval)
			joined = joined || plans[i].join
		} else {
			plans[i].zone.pushFailed(plans[i].hash, plans[i].floor)
		}
	}
	if err != nil {
		e.storeFailed(err)
		return err
	}
	e.storeOK()
	if joined && !e.stopped.Load() {
		// Keys started syncing here: say they are hot now rather than at
		// the next heartbeat, so that the others stop admitting them on
		// floor shares, and this instance stops leaving those aside, sooner.
		e.heartbeat(ctx, now/int64(time.Millisecond))
	}
	return nil
}

// claimActive plans every key that has something to push or was requested
// within its read's lifetime. Keys idle for longer are not re-read: their
// rings age on their own, and their next request queues a read.
func (e *Engine) claimActive(now int64) ([]plan, []Step) {
	staleAfter := e.staleAfter()
	var plans []plan
	var steps []Step
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) {
			plans, steps = e.claimShard(z, s, now, staleAfter, plans, steps)
		})
	}
	return plans, steps
}

// claimShard appends the active keys of one shard. The caller holds its
// lock.
func (e *Engine) claimShard(z *Zone, s *shard, now, staleAfter int64, plans []plan, steps []Step) ([]plan, []Step) {
	for h, idx := range s.active {
		en, ring := z.arena.at(idx)
		if en.flags&flagLeaving != 0 && now-en.leftAt >= e.leaveAfter() && en.flags&flagQueued == 0 {
			// Every other instance has read since it left: they hold its
			// floor share back for it now. It may use it if the fleet's
			// count still leaves room for every floor share; if the key got
			// busy meanwhile, it stays synced (its next step registers it).
			en.advance(ring, z.slots.Of(now))
			if used, _ := en.scan(ring); en.fresh(now, staleAfter) && e.mayGoOnFloor(z, s, h, used, now) {
				z.toFloor(s, h, en, ring)
				continue
			}
			en.flags &^= flagLeaving
		}
		if en.pending() || en.demand > 0 || now-en.lastSeen < staleAfter {
			p, st := e.claim(z, s, h, en, ring, now)
			plans, steps = append(plans, p), append(steps, st)
		}
	}
	return plans, steps
}

// mayGoOnFloor reports whether a key whose fleet count is used may go on this
// instance's floor share at now: it has one, the key is not hot nor named
// as pushed by a promise (see offFloor), and the count leaves room for every
// floor share. The caller holds the key's shard lock, s.
func (e *Engine) mayGoOnFloor(z *Zone, s *shard, h keyhash.Hash, used, now int64) bool {
	events := z.events.Load()
	floor := e.floorOf(z, events, now)
	if _, hot := s.hotAt(h, now); hot || floor == 0 || s.offFloor(h, now) {
		return false
	}
	// Every other claim at a floor share, this one at its own (a
	// probation share is smaller).
	claims := z.fleet.claimsAt(now)
	return used+(claims-1)*share(events, claims)+floor <= events
}

// busy reports whether the fleet's count of a key, as last read, is a
// quarter of its floor share or more: too much to go on it.
func busy(en *entry, ring []uint32, z *Zone, now, floor int64) bool {
	en.advance(ring, z.slots.Of(now))
	used, _ := en.scan(ring)
	return used*4 >= floor
}

// leaveAfter is how long a key that left stays synced (pushing its admits
// while deregistered) before it goes on its floor share: two intervals, so
// that every other instance that syncs the key has read that it left
// (passes are jittered by 10%) and holds back its floor share.
func (e *Engine) leaveAfter() int64 { return 2 * e.interval.Load() }

// claimQueued plans the keys queued for an early sync.
func (e *Engine) claimQueued(now int64) ([]plan, []Step) {
	e.queueMu.Lock()
	q := e.queue
	e.queue = nil
	e.queueMu.Unlock()
	plans := make([]plan, 0, len(q))
	steps := make([]Step, 0, len(q))
	for _, k := range q {
		if p, st, ok := e.claimQueuedKey(k, now); ok {
			plans, steps = append(plans, p), append(steps, st)
		}
	}
	return plans, steps
}

// claimQueuedKey claims one queued key if it is still queued.
func (e *Engine) claimQueuedKey(k queued, now int64) (plan, Step, bool) {
	s := k.zone.shardOf(k.hash)
	s.mu.Lock()
	defer s.mu.Unlock()
	if en, ring := k.zone.lookup(s, k.hash); en != nil && en.flags&flagQueued != 0 {
		p, st := e.claim(k.zone, s, k.hash, en, ring, now)
		return p, st, true
	}
	return plan{}, Step{}, false
}

// claimStopping plans, for an instance that stops, every key with admits
// it has not pushed, those on its floor share included, every key it is
// registered for, and every key it gives reservations back for; all
// reports that the floor keys were not too many to push (see
// flushFloorKeys).
func (e *Engine) claimStopping(now int64) (plans []plan, steps []Step, all bool) {
	floorKeys := 0
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) {
			for h, idx := range s.entries {
				en, ring := z.arena.at(idx)
				if en.flags&flagFloor != 0 {
					en.advance(ring, z.slots.Of(now))
					if used, _ := en.scan(ring); used == 0 {
						continue
					}
					if floorKeys++; floorKeys > flushFloorKeys {
						continue
					}
				} else if _, reserved := s.reservations[h]; !reserved && !en.pending() && en.demand == 0 && en.flags&flagSynced == 0 {
					continue
				}
				p, st := e.claim(z, s, h, en, ring, now)
				plans, steps = append(plans, p), append(steps, st)
			}
		})
	}
	return plans, steps, floorKeys <= flushFloorKeys
}

// claim takes the key's unpushed admits and demand into a step. A key on its
// floor share pushes its admits in the window and registers as synced; a
// synced key renews its registration, or gives it up when the fleet's count
// has fallen under a quarter of its floor share. The caller holds the key's
// shard lock.
func (e *Engine) claim(z *Zone, s *shard, h keyhash.Hash, en *entry, ring []uint32, now int64) (plan, Step) {
	p := plan{zone: z, hash: h, demand: en.demand, readAt: en.readAt}
	st := Step{
		Key:    z.storeKey(h),
		Adds:   [2]SlotCount{{Slot: en.head, Count: int64(en.pendCur)}, {Slot: en.head - 1, Count: int64(en.pendPrev)}},
		Demand: int64(en.demand),
		Oldest: z.slots.Oldest(now),
		TTL:    time.Duration(2 * z.slots.N * z.slots.Len),
	}
	if e.registers(z, s, h, en, ring, now, &p, &st) && (z.fleet.eligible.Load() || z.fleet.founding.Load()) {
		// (An instance on probation registers no key: the others leave
		// its probation share aside in every key, see probationAside.)
		st.Member, st.Now, st.MemberTTL = e.member, now/int64(time.Millisecond), e.memberTTL()
	}
	st.Moved = s.claimMoved(h)
	if en.flags&flagReserved != 0 && en.demand > 0 && !e.stopped.Load() && s.reservedOf(h, e.lapseSlot(z, now)) == 0 {
		// Asked for here and none held: reserve some, within what the key
		// leaves aside for the floor admits of others.
		events := z.events.Load()
		st.Reserve, st.Limit = reserveWant(en, events), events-e.setAside(z, s, h, en, events, now)
		p.reserveSlot = en.head
	}
	en.pendCur, en.pendPrev, en.demand = 0, 0, 0
	en.flags &^= flagQueued
	return p, st
}

// registers decides what the key's step says of this instance: a floor
// push, a join, a leave, or nothing; it reports whether the step registers
// (or renews) this instance as syncing the key. Every step but an
// unregistered key's names this instance.
func (e *Engine) registers(z *Zone, s *shard, h keyhash.Hash, en *entry, ring []uint32, now int64, p *plan, st *Step) bool {
	floor := e.floorOf(z, z.events.Load(), now)
	// A founder is to take its floor share with the others: a key busy
	// against that share already syncs (see below).
	joinFloor := floor
	if floor == 0 && z.fleet.founding.Load() {
		joinFloor = share(z.events.Load(), z.fleet.widest())
	}
	register := true
	switch {
	case en.flags&flagFloor != 0:
		p.join = true
		en.advance(ring, z.slots.Of(now))
		// A push sent again leaves what was admitted since it was claimed
		// to go as any pending admit; a new one holds them.
		var again bool
		if p.floor, again = e.floorPushOf(s, h, en, ring); !again {
			st.Adds = [2]SlotCount{}
		}
		st.Floor, st.FloorID, st.Now = p.floor.slots, p.floor.id, now/int64(time.Millisecond)
	case en.flags&flagSynced == 0 && en.readAt > 0 && joinFloor > 0 && busy(en, ring, z, now, joinFloor):
		// Tracked before it could go on a floor share (the fleet's size
		// not known yet, or a founder before the shares are taken), and
		// found busy by a read: sync it. One found idle goes on its floor
		// share when this step's reply is merged. A founder registers it
		// already: the others count it as a holder from the founding,
		// and leave its share aside in every key it does not sync
		// (bench/fleet edges: a restarted instance denied a key at 90%
		// of its limit 2 s after the founding).
		p.join = true
	case en.flags&flagLeaving != 0:
		// Deregistered, and still pushing its admits until the others have
		// read that it left (see leaveAfter).
		register = false
		st.Member, st.Now = e.member, now/int64(time.Millisecond)
	case en.flags&flagSynced != 0:
		en.advance(ring, z.slots.Of(now))
		if used, _ := en.scan(ring); used*4 < floor && en.fresh(now, e.staleAfter()) {
			p.leave = true // (a TTL of 0 deregisters it)
			register = false
			st.Member, st.Now = e.member, now/int64(time.Millisecond)
		}
	default:
		register = false
	}
	return register
}

// merge folds a step's reply into the key: its registration, the ring's
// counts, the demand's rates, and, for a key read before it could go on a
// floor share, that share.
func (e *Engine) merge(p *plan, r *Reply, now, interval int64) {
	z := p.zone
	s := z.shardOf(p.hash)
	s.mu.Lock()
	defer s.mu.Unlock()
	en, ring := z.lookup(s, p.hash)
	if en == nil {
		return
	}
	en.advance(ring, z.slots.Of(now))
	switch {
	case p.leave:
		en.flags |= flagLeaving
		en.leftAt = now
	case p.join:
		if p.floor.id != "" {
			s.notePushed(z, p.hash, now, int64(e.memberTTL()))
		}
		z.toSynced(s, p.hash, en)
		delete(s.floorPushes, p.hash)
	}
	en.syncing = uint16(min(r.Syncing, math.MaxUint16))
	if r.Reserved > 0 {
		s.addReserved(p.hash, r.Reserved, p.reserveSlot)
	} else {
		s.checkReserved(p.hash, r.Slots)
	}
	mergeSlots(en, ring, r.Slots)
	mergeDemand(en, p, r.Demand, now, interval)
	en.readAt = now
	if en.flags&(flagFloor|flagSynced) == 0 {
		// Read before it could go on a floor share: it goes there now if
		// the fleet's count is small, as for a leave (it never registered,
		// so the others already hold its share back for it).
		if used, _ := en.scan(ring); used*4 < e.floorOf(z, z.events.Load(), now) && e.mayGoOnFloor(z, s, p.hash, used, now) {
			z.toFloor(s, p.hash, en, ring)
		}
	}
}

// mergeSlots sets each slot of the ring to what the store holds plus this
// instance's admits since the claim. After a push of the key failed (for a
// window, see pushFailed) or a store that restarted empty, it takes the
// larger of that and what the ring knew, so that this instance never
// forgets its own admits; otherwise it takes the store's count even when it
// fell (a reservation moved to the slot it was used in), so that no admit
// is counted in two slots.
func mergeSlots(en *entry, ring []uint32, slots []SlotCount) {
	n := int64(len(ring))
	lost := en.flags&flagLost != 0
	en.flags &^= flagLost
	for _, sc := range slots {
		if sc.Slot > en.head || sc.Slot <= en.head-n {
			continue
		}
		v := sc.Count
		switch sc.Slot {
		case en.head:
			v += int64(en.pendCur)
		case en.head - 1:
			v += int64(en.pendPrev)
		}
		i := slotIndex(sc.Slot, n)
		switch {
		case lost:
			// The store lost what the ring knew: what it holds now was
			// admitted since (this instance's pushes may count twice, which
			// errs on the safe side).
			ring[i] = max(ring[i], uint32(min(v+int64(ring[i]), math.MaxUint32)))
		case en.head < en.mergeMaxUntil:
			ring[i] = max(ring[i], uint32(min(v, math.MaxUint32)))
		default:
			ring[i] = uint32(min(max(v, 0), math.MaxUint32))
		}
	}
	en.sinceRead = en.pendCur + en.pendPrev
}

// mergeDemand averages the demand since the previous read into the key's
// rates: what this instance pushed, and what the store's counter (demand, the
// fleet's) grew by. The first read has nothing to take the counter's growth
// from: the rates start at the second.
func mergeDemand(en *entry, p *plan, demand, now, interval int64) {
	fleet := uint32(demand) - en.fleetDemand
	if fleet < p.demand || fleet > math.MaxInt32 {
		fleet = p.demand // the counter restarted (expired, or a store restart)
	}
	if dt := now - p.readAt; p.readAt > 0 && dt > 0 {
		perInterval := float64(interval) / float64(dt)
		own, all := float64(p.demand)*perInterval, float64(fleet)*perInterval
		if en.flags&flagRated == 0 {
			en.ownRate, en.fleetRate = float32(own), float32(all)
			en.flags |= flagRated
		} else {
			keep := math.Exp(-float64(dt) / float64(demandHorizon*interval))
			en.ownRate = float32(keep*float64(en.ownRate) + (1-keep)*own)
			en.fleetRate = float32(keep*float64(en.fleetRate) + (1-keep)*all)
		}
	}
	en.fleetDemand = uint32(demand)
}

// storeFailed counts a failed call to the store, and gives up on the fleet
// once nothing has reached the store for staleAfter: a single slow or
// failed call (a busy machine's read past its timeout, a failover) is not
// an outage, and limiting per instance admits up to the limit on each, so
// until then the fleet's reads stand (they age as the request path reads
// them) and floor shares hold.
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

// markLost marks every key this instance reads from the store as read
// before the store restarted empty (see flagLost).
func (e *Engine) markLost() {
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) {
			for _, idx := range s.active {
				en, _ := z.arena.at(idx)
				en.flags |= flagLost
			}
		})
	}
}
