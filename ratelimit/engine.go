package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/safego"
)

// Options configure an Engine.
type Options struct {
	// Store holds the fleet's counts and slot table. Required; use
	// NewMemoryStore for a single instance.
	Store SlotStore
	// Prefix starts every store key.
	Prefix string
	// SyncInterval is the period of the reconciler (jittered by ±10%).
	// Default DefaultSyncInterval.
	SyncInterval time.Duration
	// IdleTTL is the least time an idle key is kept (default 10 minutes; a key
	// is always kept for two of its windows).
	IdleTTL time.Duration
	// Solo says the store serves this instance alone (the embedded memory
	// store): there is no fleet, and every key is limited on this
	// instance's own count, with no store call.
	Solo bool
	// MaxInstances is the number of instance slots of the fleet (default
	// DefaultMaxInstances, at most 64); every instance of a fleet must say
	// the same. A slot's floor is FloorFraction × events / MaxInstances.
	MaxInstances int
	// FixedInterval turns the floors off: every key is admitted on leases.
	FixedInterval bool
	Logger        *zap.Logger
	// OnPass, when set, is told how long the store took to answer every
	// reconcile pass that had calls and every heartbeat, and its error
	// (nil: the store was reached), for metrics.
	OnPass func(took time.Duration, err error)
	// OnEarlySync, when set, is told of every early pass, for metrics.
	OnEarlySync func()
	// OnPanic, when set, is told of a panic in the reconciler. The pass that
	// panicked is given up; the reconciler goes on with the next one.
	OnPanic safego.Report
}

// DefaultSyncInterval is used when Options.SyncInterval is zero.
const DefaultSyncInterval = 250 * time.Millisecond

// DefaultMaxInstances is used when Options.MaxInstances is zero.
const DefaultMaxInstances = 16

// FloorFraction is the part of a key's limit the instance slots share as
// floors: each may admit FloorFraction × events / MaxInstances of a key in
// any window with no store call. The rest, and the floors of slots that
// pushed theirs, go by leases.
const FloorFraction = 0.5

// minSyncInterval keeps a typo such as "1ns" from turning the reconciler into
// a busy loop against the store.
const minSyncInterval = 10 * time.Millisecond

// Engine owns the zones, their per-key state and the reconciler. One Engine
// serves every config that names the same store, across reloads.
type Engine struct {
	store        SlotStore
	prefix       string
	idleTTL      time.Duration
	log          *zap.Logger
	onPass       func(time.Duration, error)
	onEarly      func()
	onPanic      safego.Report
	solo         bool
	maxInstances atomic.Int64
	floors       atomic.Bool

	interval atomic.Int64 // nanoseconds

	zonesMu sync.Mutex
	zones   atomic.Pointer[[]*Zone] // copy-on-write: the reconciler reads it without the lock
	// inherited are the keys handed over with this instance's slot (store
	// key -> off the floor until, Unix ns), for the zones made later.
	inherited map[string]int64

	healthy atomic.Bool
	stop    chan struct{}
	done    chan struct{}
	started atomic.Bool
	stopped atomic.Bool

	// lastSync is when a call last reached the store (Unix ns, 0: never);
	// syncErrors counts the passes (and the start probe) that did not.
	lastSync   atomic.Int64
	syncErrors atomic.Uint64

	passMu sync.Mutex // one reconcile pass (or eviction) at a time
	beatMu sync.Mutex // one heartbeat at a time

	// member is this instance's id in the slot table; slot the instance
	// slot it holds (-1: none), usable for floors from floorAt (Unix ns);
	// holding the slots that may hold floor admits, as of viewAt (Unix ns);
	// live the live instances then.
	member           int64
	slot             atomic.Int64
	floorAt, viewAt  atomic.Int64
	holding          atomic.Uint64
	viewLeasing      atomic.Bool  // the last heartbeat said this instance leases
	leased           atomic.Bool  // a lease call since the last heartbeat
	grownAt          atomic.Int64 // Unix ns: the last heartbeat whose holding set gained a slot
	live             atomic.Int64
	lastBeat         atomic.Int64 // Unix ns
	slotsKey, hotKey string

	// passed is closed, and replaced, when a pass ends (see AwaitPass).
	passed atomic.Pointer[chan struct{}]

	// Keys queued for a call; kick wakes the reconciler for them.
	queueMu sync.Mutex
	queue   []queued
	kick    chan struct{}
}

type queued struct {
	zone *Zone
	hash keyhash.Hash
}

// NewEngine builds an engine; call Start to run its reconciler.
func NewEngine(o Options) (*Engine, error) {
	if o.Store == nil {
		return nil, errors.New("ratelimit: a slot store is required")
	}
	if o.MaxInstances == 0 {
		o.MaxInstances = DefaultMaxInstances
	}
	if o.MaxInstances < 1 || o.MaxInstances > 64 {
		return nil, fmt.Errorf("ratelimit: max instances must be between 1 and 64, got %d", o.MaxInstances)
	}
	if o.IdleTTL <= 0 {
		o.IdleTTL = 10 * time.Minute
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	e := &Engine{
		store:    o.Store,
		prefix:   o.Prefix,
		idleTTL:  o.IdleTTL,
		log:      o.Logger,
		onPass:   o.OnPass,
		onEarly:  o.OnEarlySync,
		onPanic:  o.OnPanic,
		member:   1 + rand.Int64N(1<<53-1),
		slotsKey: o.Prefix + ":rl:slots:{fleet}",
		hotKey:   o.Prefix + ":rl:hot3:{fleet}",
		solo:     o.Solo,
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
		kick:     make(chan struct{}, 1),
	}
	e.slot.Store(-1)
	passed := make(chan struct{})
	e.passed.Store(&passed)
	e.maxInstances.Store(int64(o.MaxInstances))
	e.SetSyncInterval(o.SyncInterval)
	e.SetNearLimit(!o.FixedInterval)
	e.healthy.Store(true)
	e.zones.Store(&[]*Zone{})
	return e, nil
}

// SetSyncInterval changes the reconciler's period from its next tick on.
func (e *Engine) SetSyncInterval(d time.Duration) {
	if d <= 0 {
		d = DefaultSyncInterval
	}
	d = max(d, minSyncInterval)
	e.interval.Store(int64(d))
}

// SetMaxInstances changes the number of instance slots (1 to 64; 0:
// DefaultMaxInstances) from the next heartbeat on. Every instance of a fleet
// must say the same: the floors of a fleet that disagrees do not add up.
func (e *Engine) SetMaxInstances(n int) {
	if n <= 0 {
		n = DefaultMaxInstances
	}
	e.maxInstances.Store(int64(min(n, 64)))
}

// MaxInstances is the number of instance slots.
func (e *Engine) MaxInstances() int { return int(e.maxInstances.Load()) }

// SetNearLimit turns the floors on or off (see Options.FixedInterval).
func (e *Engine) SetNearLimit(on bool) { e.floors.Store(on) }

// NearLimit reports whether the floors are on.
func (e *Engine) NearLimit() bool { return e.floors.Load() }

// Members is how many instances the last heartbeat found live, this one
// included (0 before the first, and for a solo engine).
func (e *Engine) Members() int64 { return e.live.Load() }

// Slot is the instance slot this engine holds (-1: none).
func (e *Engine) Slot() int { return int(e.slot.Load()) }

// SyncInterval is the reconciler's period.
func (e *Engine) SyncInterval() time.Duration { return time.Duration(e.interval.Load()) }

// floorOf is this instance's floor of a key of events at now: 0 without a
// usable slot, with floors off, or for a limit too small to share.
func (e *Engine) floorOf(events, now int64) int64 {
	if !e.floors.Load() || e.slot.Load() < 0 || now < e.floorAt.Load() {
		return 0
	}
	return floorSize(events, int(e.maxInstances.Load()))
}

// floorSize is F, a slot's floor of a key of events.
func floorSize(events int64, slots int) int64 {
	return int64(FloorFraction * float64(events) / float64(slots))
}

// leaseLife is the demand a grant is sized for, and how long a slot's mark
// lasts (twice that) unless renewed (ns): four intervals.
func (e *Engine) leaseLife() int64 { return 4 * e.interval.Load() }

// beatEvery spaces the heartbeats (ns): two intervals.
func (e *Engine) beatEvery() int64 { return 2 * e.interval.Load() }

// viewFor is how long an instance acts on a heartbeat's holding set (ns):
// three heartbeats. A slot left out of an answered heartbeat has its floor
// usable only viewFor after it (see slots.lua), so a grant computed
// without it may be used until then.
func (e *Engine) viewFor() int64 { return 3 * e.beatEvery() }

// blockLive reports whether the key's grant may still be used at now: it
// has not outlived its window, and either it held back every slot's floor,
// or no heartbeat since its own added a slot to the holding set and the
// last one is recent enough that no slot out of it can have its floor yet.
func (e *Engine) blockLive(en *entry, now int64) bool {
	if now >= en.blockUntil {
		return false
	}
	return en.blockView == allSlots || e.grownAt.Load() <= en.blockView && now < e.viewAt.Load()+e.viewFor()
}

// allSlots is entry.blockView for a grant that held back every slot's floor.
const allSlots = 1<<63 - 1

// staleAfter is how long the store may fail before limits go per instance.
func (e *Engine) staleAfter() int64 {
	return max(4*e.interval.Load(), int64(2*time.Second))
}

// holdingAt is the slots a lease call holds floors back for at now, and
// the heartbeat they are of (allSlots: every slot, the last heartbeat being
// too old to act on, or one that did not say this instance leases, and so
// recorded nothing of the slots out of it).
func (e *Engine) holdingAt(now int64) (uint64, int64) {
	if at := e.viewAt.Load(); e.viewLeasing.Load() && now-at < e.viewFor()-e.beatEvery() {
		return e.holding.Load(), at
	}
	return 1<<e.maxInstances.Load() - 1, allSlots
}

// Zone returns the zone called name with the window and precision of l,
// creating it on first use. A zone name with another window or precision is
// another zone: its counts mean something else.
func (e *Engine) Zone(name string, l *Limit) *Zone {
	find := func(zs []*Zone) *Zone {
		for _, z := range zs {
			if z.name == name && z.slots == l.slots {
				return z
			}
		}
		return nil
	}
	if z := find(*e.zones.Load()); z != nil {
		z.events.Store(l.Events)
		return z
	}
	z := e.addZone(name, l, find)
	if e.started.Load() && e.healthy.Load() && e.slot.Load() < 0 {
		// The first zone of a running engine takes its slot now, so that
		// its first requests have their floors.
		ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
		e.heartbeat(ctx, time.Now().UnixNano())
		cancel()
	}
	return z
}

// addZone finds or makes the zone called name under zonesMu.
func (e *Engine) addZone(name string, l *Limit, find func([]*Zone) *Zone) *Zone {
	e.zonesMu.Lock()
	defer e.zonesMu.Unlock()
	cur := *e.zones.Load()
	if z := find(cur); z != nil {
		z.events.Store(l.Events)
		return z
	}
	z := newZone(e.prefix, name, len(cur), l.slots)
	z.events.Store(l.Events)
	z.inherit(e.inherited)
	next := append(append(make([]*Zone, 0, len(cur)+1), cur...), z)
	e.zones.Store(&next)
	return z
}

// Zones lists the zones in creation order.
func (e *Engine) Zones() []*Zone { return append([]*Zone(nil), *e.zones.Load()...) }

// Check is one zone's part of a request: which zone, its policy and the key.
type Check struct {
	Zone  *Zone
	Limit *Limit // the zone's events and burst; its window and precision are the zone's
	Key   keyhash.Hash
}

// Verdict is one zone's answer for a request.
type Verdict struct {
	Allowed bool
	// Remaining is how many more requests the fleet can admit of the key
	// after this one as far as this instance knows, never more (0 when
	// denied): on a floor, what is left of it; on leases, what is left of
	// the grant; with the store down or alone, the window's room on this
	// instance's count.
	Remaining int64
	// Reset is, for an admitted request, the time until the oldest request
	// that counts leaves the window (when Remaining next grows).
	Reset time.Duration
	// RetryAfter is, for a denial, when the request would fit: exact to one
	// slot for the window on this instance's count, one interval when it
	// waits for a lease, exact for the local cap.
	RetryAfter time.Duration
	// Fleet is true when the window (not the local cap) denied the request.
	Fleet bool
	// Leasing is true when the request was denied for want of a grant the
	// key has asked for and has had none yet: the next pass may bring it
	// (see Engine.AwaitPass).
	Leasing bool
}

// MaxChecks bounds the zones of one request so the request path can keep its
// working set on the stack.
const MaxChecks = 16

// Allow decides a request at now (Unix ns) against every check. Checks must be
// at most MaxChecks, ordered by ascending Zone.ID and name each zone once. It
// fills out (one Verdict per check) and returns the index of the first
// denying check, or -1 when all admit. The request is recorded in every zone
// only when all admit: a denial consumes nothing anywhere. Allow never waits
// on the store.
func (e *Engine) Allow(now int64, checks []Check, out []Verdict) int {
	fleet := !e.solo && e.healthy.Load()
	if len(checks) == 1 {
		// The usual single zone, without the stack arrays of the general case.
		c, v := &checks[0], &out[0]
		s, en, ring, untracked := c.Zone.lock(c.Key, now)
		tat, oldest := e.judge(c, s, en, ring, untracked, now, fleet, v)
		if v.Allowed {
			record(en, ring, untracked, c.Limit, tat, oldest, now, v)
		}
		s.mu.Unlock()
		if v.Allowed {
			return -1
		}
		return 0
	}
	return e.allowMany(now, checks, out, fleet)
}

// allowMany is Allow for more than one check. Its arrays are in a frame of
// its own so that the single check does not carry them on the stack.
//
//go:noinline
func (e *Engine) allowMany(now int64, checks []Check, out []Verdict, fleet bool) int {
	var shards [MaxChecks]*shard
	var entries [MaxChecks]*entry
	var rings [MaxChecks][]uint32
	var untracked [MaxChecks]*untrackedState
	var tats, oldest [MaxChecks]int64
	checks = checks[:min(len(checks), MaxChecks)]
	denied := -1
	for i := range checks {
		c := &checks[i]
		shards[i], entries[i], rings[i], untracked[i] = c.Zone.lock(c.Key, now)
		tats[i], oldest[i] = e.judge(c, shards[i], entries[i], rings[i], untracked[i], now, fleet, &out[i])
		if !out[i].Allowed && denied < 0 {
			denied = i
		}
	}
	if denied < 0 {
		for i := range checks {
			record(entries[i], rings[i], untracked[i], checks[i].Limit, tats[i], oldest[i], now, &out[i])
		}
	}
	for i := len(checks) - 1; i >= 0; i-- {
		shards[i].mu.Unlock()
	}
	return denied
}

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
	en.lastSeen = now
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
// window stay under F. From three quarters of F on, or when the key is hot,
// it is queued to go to leases. It returns what is left.
func (e *Engine) judgeFloor(c *Check, s *shard, en *entry, used, now int64, v *Verdict) int64 {
	f := e.floorOf(c.Limit.Events, now)
	if len(s.noFloor) > 0 && s.noFloor[c.Key] > now {
		f = 0 // handed over by the slot's last holder
	}
	if (used+1)*4 >= 3*f || s.isHot(c.Key, now) {
		e.enqueue(c.Zone, c.Key, en)
	}
	if used >= f {
		v.Fleet, v.Leasing = true, en.flags&flagRated == 0
		v.RetryAfter = time.Duration(e.interval.Load())
	}
	return f - used - 1
}

// judgeLease admits a key on leases while its grant lasts; one half spent
// queues the next call. A key whose mark lapsed a window ago, with no grant
// left, goes back to its floor. It returns what is left.
func (e *Engine) judgeLease(c *Check, s *shard, en *entry, used, now int64, v *Verdict) int64 {
	if !e.blockLive(en, now) {
		en.block = 0
	}
	// The admits others made on grants that relied on this slot's mark
	// count for a window after it lapsed: the floor waits for them.
	if en.block == 0 && en.markUntil+c.Limit.Window.Nanoseconds() <= now && !s.isHot(c.Key, now) && used < e.floorOf(c.Limit.Events, now) {
		c.Zone.toFloor(s, c.Key, en)
		return e.judgeFloor(c, s, en, used, now, v)
	}
	interval := e.interval.Load()
	if (en.block*2 <= targetOf(en.rate) || en.blockUntil-now < 2*interval) && (en.room > 0 || now-en.calledAt >= interval) {
		// Half spent, or about to end: the next block is asked for now;
		// with no room at the last call, once an interval.
		e.enqueue(c.Zone, c.Key, en)
	}
	if en.block == 0 {
		v.Fleet, v.Leasing = true, en.room > 0 || en.flags&flagRated == 0
		v.RetryAfter = time.Duration(interval)
	}
	// What the fleet can surely still admit, as this instance knows it:
	// its grant (the room last seen may have gone to others since).
	return en.block - 1
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
// takes it from the grant as an admit to push), or for an untracked key in
// its local cap alone. The caller holds the key's shard lock.
func record(en *entry, ring []uint32, untracked *untrackedState, l *Limit, tat, oldest, now int64, v *Verdict) {
	if en == nil {
		untracked.tat = tat
		return
	}
	ring[slotIndex(en.head, int64(len(ring)))]++
	if en.flags&flagLease != 0 {
		en.block = max(en.block-1, 0)
	}
	en.tat = tat
	// The oldest counted request (this one, if it is the only one) leaves the
	// window when its slot does.
	v.Reset = time.Duration(max(l.slots.LeavesAt(oldest)-now, 0))
}

// AwaitPass waits until the reconciler ends a pass, at most timeout.
func (e *Engine) AwaitPass(timeout time.Duration) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-*e.passed.Load():
	case <-t.C:
	}
}

// enqueue asks the reconciler for a call for the key, once until it runs.
// The caller holds the key's shard lock.
func (e *Engine) enqueue(z *Zone, h keyhash.Hash, en *entry) {
	if en.flags&flagQueued != 0 {
		return
	}
	en.flags |= flagQueued
	e.queueMu.Lock()
	e.queue = append(e.queue, queued{zone: z, hash: h})
	e.queueMu.Unlock()
	select {
	case e.kick <- struct{}{}:
	default:
	}
}
