package ratelimit

import (
	"context"
	"errors"
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
	// Store holds the fleet's shared slot counts. Required; use
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
	// store): there is no fleet to coordinate with, so the near-limit
	// mechanisms are off.
	Solo bool
	// FixedInterval turns the near-limit mechanisms off: keys are synced only
	// every SyncInterval, an instance spends all the headroom it sees, and a
	// key new to the instance is decided on its own counts until the first
	// read. Default false: early sync, headroom share and first contact are on.
	FixedInterval bool
	Logger        *zap.Logger
	// OnPass, when set, is told how long the store took to sync every
	// reconcile pass that had keys, and its error (nil: the store was
	// reached), for metrics.
	OnPass func(took time.Duration, err error)
	// OnEarlySync, when set, is told of every early pass, for metrics.
	OnEarlySync func()
	// OnPanic, when set, is told of a panic in the reconciler. The pass that
	// panicked is given up; the reconciler goes on with the next one.
	OnPanic safego.Report
}

// DefaultSyncInterval is used when Options.SyncInterval is zero.
const DefaultSyncInterval = 250 * time.Millisecond

// minSyncInterval keeps a typo such as "1ns" from turning the reconciler into
// a busy loop against the store.
const minSyncInterval = 10 * time.Millisecond

// Engine owns the zones, their per-key state and the reconciler. One Engine
// serves every config that names the same store, across reloads.
type Engine struct {
	store     SlotStore
	prefix    string
	idleTTL   time.Duration
	log       *zap.Logger
	onPass    func(time.Duration, error)
	onEarly   func()
	onPanic   safego.Report
	solo      bool
	nearLimit atomic.Bool

	interval atomic.Int64 // nanoseconds

	zonesMu sync.Mutex
	zones   atomic.Pointer[[]*Zone] // copy-on-write: the reconciler reads it without the lock

	healthy atomic.Bool
	stop    chan struct{}
	done    chan struct{}
	started atomic.Bool
	stopped atomic.Bool

	// lastSync is when a pass last reached the store (Unix ns, 0: never);
	// syncErrors counts the passes (and the start probe) that did not.
	lastSync   atomic.Int64
	syncErrors atomic.Uint64

	passMu sync.Mutex // one reconcile pass (or eviction) at a time
	// heartbeatMu keeps a new zone's heartbeat (see Zone) from running
	// into the reconciler's: each learns the whole fleet and its hot keys.
	heartbeatMu sync.Mutex

	// member is this instance's number in the fleet's membership, joined
	// when it first heartbeated (Unix ms), and members the live instances
	// as of the last heartbeat (0: not known yet, and then no key admits on
	// a floor share).
	member     int64
	joined     atomic.Int64
	members    atomic.Int64
	membersKey string
	hotKey     string
	warmUntil  atomic.Int64 // Unix ns: until then a key busy here syncs early (see floorAdmits)
	// founded is the membership's founding as last seen (Unix ms), and
	// lastHeartbeat when the last heartbeat was sent (Unix ms).
	founded       atomic.Int64
	lastHeartbeat atomic.Int64
	// promised is the floor promise the store holds (see promise.go),
	// promising the one a heartbeat is sending, and promiseGen the
	// generation of bounds that admits raise now; promiseGens are every
	// generation of the last window (under heartbeatMu).
	promised, promising, promiseGen atomic.Pointer[promises]
	promiseGens                     promiseGenerations
	// gonePromises are the gone members' promises the last heartbeat
	// learned, by member (under heartbeatMu; see heldPromises).
	gonePromises map[int64]heldPromise
	// floorPushes numbers this instance's floor pushes (see floorPush).
	floorPushes atomic.Uint64

	// Keys queued for an early sync; kick wakes the reconciler for them.
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
	if o.IdleTTL <= 0 {
		o.IdleTTL = 10 * time.Minute
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	e := &Engine{
		store:      o.Store,
		prefix:     o.Prefix,
		idleTTL:    o.IdleTTL,
		log:        o.Logger,
		onPass:     o.OnPass,
		onEarly:    o.OnEarlySync,
		onPanic:    o.OnPanic,
		member:     1 + rand.Int64N(1<<53-1),
		membersKey: o.Prefix + ":rl:members:{fleet}",
		hotKey:     o.Prefix + ":rl:hot:{fleet}",
		solo:       o.Solo,
		stop:       make(chan struct{}),
		done:       make(chan struct{}),
		kick:       make(chan struct{}, 1),
	}
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

// SetNearLimit turns the near-limit mechanisms on or off (see
// Options.FixedInterval); they stay off for a Solo engine.
func (e *Engine) SetNearLimit(on bool) { e.nearLimit.Store(on && !e.solo) }

// NearLimit reports whether the near-limit mechanisms are on.
func (e *Engine) NearLimit() bool { return e.nearLimit.Load() }

// Members is how many instances the last heartbeat found live, this one
// included (0 before the first, and for a solo engine).
func (e *Engine) Members() int64 { return e.members.Load() }

// SyncInterval is the reconciler's period.
func (e *Engine) SyncInterval() time.Duration { return time.Duration(e.interval.Load()) }

// floorFraction is the part of a key's limit the instances share as floor
// shares: each instance that holds a claim (see fleetView) may admit
// floorFraction × events / claims of a key in any window without telling the
// store. The rest is for the instances that sync the key, and for keys an
// instance has not read yet.
const floorFraction = 0.8

// minFloor is the least floor share worth having: a smaller one would send
// the key to the store after a request or two anyway.
const minFloor = 4

// share is one floor share of events among claims, or 0 when there is none
// (no claims known yet, or a share too small: a limit below what the fleet
// can share has no floor, and every instance syncs it).
func share(events, claims int64) int64 { return cut(floorFraction, events, claims) }

func cut(fraction float64, events, claims int64) int64 {
	if claims <= 0 {
		return 0
	}
	if f := int64(fraction * float64(events) / float64(claims)); f >= minFloor {
		return f
	}
	return 0
}

// floorOf is this instance's floor share of a key of z at now (its
// probation share while it may not take a floor share yet), or 0 when it
// has none (the near-limit mechanisms are off, or the share is too small).
func (e *Engine) floorOf(z *Zone, events, now int64) int64 {
	if !e.nearLimit.Load() {
		return 0
	}
	if !z.fleet.eligible.Load() {
		if !z.fleet.probation.Load() {
			return 0
		}
		return probationShare(events, z.fleet.probationClaims.Load())
	}
	return share(events, z.fleet.claimsAt(now))
}

// memberTTL is how long a key's registration as synced by this instance
// lasts without being renewed by a pass: as long as a read is trusted. A
// registration that outlives its instance (a crash) costs nothing: the
// others only hold back less for an instance that admits nothing.
func (e *Engine) memberTTL() time.Duration {
	return time.Duration(e.staleAfter())
}

// staleAfter is how long a read of the fleet's counts is trusted: past it the
// store is taken as unreachable (if it is) or the key as idle.
func (e *Engine) staleAfter() int64 {
	return max(4*e.interval.Load(), int64(2*time.Second))
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
	e.zonesMu.Lock()
	defer e.zonesMu.Unlock()
	cur := *e.zones.Load()
	if z := find(cur); z != nil {
		z.events.Store(l.Events)
		return z
	}
	z := newZone(e.prefix, name, len(cur), l.slots)
	z.events.Store(l.Events)
	next := append(append(make([]*Zone, 0, len(cur)+1), cur...), z)
	e.zones.Store(&next)
	if e.started.Load() && e.healthy.Load() {
		// A new zone of a running engine learns the fleet now (joining it,
		// for the first zone), so that its first requests already have
		// their floor shares, hot marks and reservations: a zone that knew
		// no fleet until the next heartbeat would admit a tenth of each
		// key's limit unseen, on top of what the fleet counts. (With the
		// store down, limits are per instance and a config with many zones
		// should not wait for it once per zone.)
		ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
		e.heartbeat(ctx, time.Now().UnixMilli())
		cancel()
	}
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
	// Remaining is how many more requests this instance may admit for the
	// key after this one without hearing from the fleet (0 when denied): at
	// most what the fleet can still admit as far as this instance knows,
	// what the other instances may admit unseen counted as used. On one
	// instance (or with the near-limit mechanisms off) it is the window's
	// room as this instance knows it. Through other instances the fleet may
	// admit more.
	Remaining int64
	// Reset is, for an admitted request, the time until the oldest request
	// that counts leaves the window (when Remaining next grows).
	Reset time.Duration
	// RetryAfter is, for a denial, when the request would fit: exact to one
	// slot for the window, exact for the local cap.
	RetryAfter time.Duration
	// Fleet is true when the window (not the local cap) denied the request.
	Fleet bool
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
	staleAfter := e.staleAfter()
	near := e.nearLimit.Load() && e.healthy.Load()
	if len(checks) == 1 {
		// The usual single zone, without the stack arrays of the general case.
		c, v := &checks[0], &out[0]
		floor := e.floorIf(near, c, now)
		s, en, ring, untracked := c.Zone.lock(c.Key, now, floor > 0)
		tat, oldest := e.judge(c, s, en, ring, untracked, now, staleAfter, floor, near, v)
		if v.Allowed {
			record(s, c.Key, en, ring, untracked, c.Limit, tat, oldest, now, v)
		}
		s.mu.Unlock()
		if v.Allowed {
			return -1
		}
		return 0
	}
	return e.allowMany(now, checks, out, staleAfter, near)
}

// allowMany is Allow for more than one check. Its arrays are in a frame of
// its own so that the single check does not carry them on the stack.
//
//go:noinline
func (e *Engine) allowMany(now int64, checks []Check, out []Verdict, staleAfter int64, near bool) int {
	var shards [MaxChecks]*shard
	var entries [MaxChecks]*entry
	var rings [MaxChecks][]uint32
	var untracked [MaxChecks]*untrackedState
	var tats, oldest [MaxChecks]int64
	checks = checks[:min(len(checks), MaxChecks)]
	denied := -1
	for i := range checks {
		c := &checks[i]
		floor := e.floorIf(near, c, now)
		shards[i], entries[i], rings[i], untracked[i] = c.Zone.lock(c.Key, now, floor > 0)
		tats[i], oldest[i] = e.judge(c, shards[i], entries[i], rings[i], untracked[i], now, staleAfter, floor, near, &out[i])
		if !out[i].Allowed && denied < 0 {
			denied = i
		}
	}
	if denied < 0 {
		for i := range checks {
			record(shards[i], checks[i].Key, entries[i], rings[i], untracked[i], checks[i].Limit, tats[i], oldest[i], now, &out[i])
		}
	}
	for i := len(checks) - 1; i >= 0; i-- {
		shards[i].mu.Unlock()
	}
	return denied
}

// judge decides one check at now and fills v; it changes only the key's
// clock (slots that left, last seen, demand). The key's state is its entry
// and ring, or, when the zone does not track it (en nil), its untracked
// local cap. It returns the GCRA state to record and the oldest slot that
// counts. The caller holds the key's shard lock, s.
func (e *Engine) judge(c *Check, s *shard, en *entry, ring []uint32, untracked *untrackedState, now, staleAfter, floor int64, near bool, v *Verdict) (tat, oldest int64) {
	l := c.Limit
	if en == nil {
		return judgeUntracked(l, untracked, now, v), 0
	}
	en.advance(ring, l.slots.Of(now))
	if near && en.flags&flagFloor == 0 && reserves(c.Zone, l.Events) {
		en.flags |= flagReserved
		return e.judgeReserved(c, s, en, ring, now, v)
	}
	en.flags &^= flagReserved
	events := l.Events
	if near {
		events -= e.nearSetAside(c, s, en, now, staleAfter)
	}
	en.lastSeen = now
	en.demand++
	used, oldest := en.scan(ring)
	g := gcraCheck(en.tat, now, l)
	*v = Verdict{}
	onFloor := near && en.flags&flagFloor != 0
	if onFloor && floor == 0 {
		// Its floor share is gone (the share became too small): it syncs
		// from the next early pass, and until then admits as a key not read
		// yet.
		e.enqueue(c.Zone, c.Key, en)
		onFloor = false
	}
	// A reservation held here is an admit the store counts already.
	held := int64(0)
	if near && !onFloor {
		held = s.reservedOf(c.Key, e.lapseSlot(c.Zone, now))
	}
	// left is what this instance may still admit of the key after this
	// request without hearing from the fleet: what Remaining says (see
	// Verdict).
	left := events - used - 1
	switch {
	case held > 0 && g.allowed:
		en.flags |= flagReserved
		left = held - 1
	case used >= events:
		v.Fleet = true
		v.RetryAfter = time.Duration(en.untilFree(ring, l.slots, now, used-events+1))
	case onFloor && !e.floorAdmits(c.Zone, c.Key, en, used, floor, l.Events, now):
		v.Fleet = true
		v.RetryAfter = time.Duration(e.interval.Load())
	case onFloor:
		left = floor - used - 1
	case near:
		var ok bool
		if ok, left = e.shareAdmits(c.Zone, s, c.Key, en, l.Events, events, used, now, staleAfter); !ok {
			v.Fleet = true
			v.RetryAfter = time.Duration(e.interval.Load())
		}
	}
	v.settle(g, left)
	return g.newTAT, oldest
}

// nearSetAside is what a key not on its floor share leaves aside for the
// floor admits of others it cannot see (see setAside), after it forgets a
// registration that has lapsed.
func (e *Engine) nearSetAside(c *Check, s *shard, en *entry, now, staleAfter int64) int64 {
	if en.flags&flagSynced != 0 && now-en.lastSeen >= staleAfter+int64(e.memberTTL()) {
		// Idle for so long that its registration has lapsed, and its read
		// is stale: it reads again before it syncs again, or goes on its
		// floor share.
		en.flags &^= flagSynced | flagLeaving
	}
	if en.flags&flagFloor != 0 {
		return 0
	}
	return e.setAside(c.Zone, s, c.Key, en, c.Limit.Events, now)
}

// settle completes a verdict the fleet did not refuse by the key's GCRA
// check, with what this instance may still admit of the key (left).
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

// floorIf is this instance's floor share of c's key when the near-limit
// mechanisms are on (near), else 0.
func (e *Engine) floorIf(near bool, c *Check, now int64) int64 {
	if !near {
		return 0
	}
	return e.floorOf(c.Zone, c.Limit.Events, now)
}

// setAside is what a key this instance does not admit on its floor share
// leaves for the floor (and probation) admits of others that it cannot see:
// a share for every gone instance whose admits may be missing from the
// key's read (see goneAside), and, until every live instance has heard that
// the key is hot (see heard), a floor share for every holder that does not
// sync it (syncing counts those registered) and what every instance on
// probation may hold (they register no key, see probationAside). An
// instance that has heard admits the key on no floor share: it pushed what
// it had admitted on one and syncs from then on. The caller holds the key's
// shard lock, s.
func (e *Engine) setAside(z *Zone, s *shard, h keyhash.Hash, en *entry, events, now int64) int64 {
	sh := share(events, z.fleet.widest())
	if sh == 0 {
		return 0
	}
	m, hot := s.hotAt(h, now)
	aside := e.goneAside(z, h, en, m, hot, sh, events, now)
	if !hot || !e.heard(z, en, m) {
		aside += max(z.fleet.holders.Load()-int64(en.syncing), 0)*sh + probationAside(z, events)
	}
	return aside
}

// goneAside is what a key h of events leaves aside for the gone instances
// whose floor (sh) or probation admits of it may be missing from en's last
// read: all but those that left having pushed them (flushed) an interval or
// more before that read began, and, of a key hot since m (hot), those that
// heartbeated after it became hot (they pushed them then); for each, no
// more than its last floor promise says it held (see promise.go). The
// admits a promise counts were made by the heartbeat that sent it (seen; an
// interval on, for the promise's folding and the clocks): once their slot
// has left the window at now, only the promise's headroom is left aside, for
// the admits after it (bench/churn, kill: the key at 90% of its limit was
// denied in the seconds after its founders' admits had left the window).
func (e *Engine) goneAside(z *Zone, h keyhash.Hash, en *entry, m hotMark, hot bool, sh, events, now int64) int64 {
	gone := z.fleet.gone.Load()
	if gone == nil {
		return 0
	}
	interval := e.interval.Load()
	var aside int64
	for _, g := range *gone {
		past := now >= z.slots.LeavesAt(z.slots.Of(g.seen+interval))
		switch {
		case g.flushed != 0 && en.readAt > g.flushed+interval:
		case hot && g.seen > m.at+interval:
		case g.fewest > 0:
			aside += g.promise.bound(z, h, probationShare(events, g.fewest), events, past)
		default:
			aside += g.promise.bound(z, h, sh, events, past)
		}
	}
	return aside
}

// heard reports whether every other live instance has heard that a key
// became hot (m) and pushed what it admitted of it on a floor or probation
// share,
// and en's last read saw it: each heartbeated after it (it pushes in the pass
// that runs its heartbeat), and the read came after the last of those
// heartbeats, or after one a heartbeat period before.
func (e *Engine) heard(z *Zone, en *entry, m hotMark) bool {
	seen := z.fleet.othersSeen.Load()
	interval := e.interval.Load()
	return seen > m.at && (en.readAt > seen+interval/2 || seen > m.at+e.heartbeatEvery()*int64(time.Millisecond)+2*interval)
}

// floorAdmits admits a key on its floor share while this instance's own
// admits in the window stay under it. From three quarters of the share on,
// or from the first admit past what its floor promise allows (see
// promise.go), the key is queued to start syncing (push its admits,
// register, read the fleet's counts): early enough that it rarely meets
// the share, and, past the promise, so that what the others do not leave
// aside for this instance is in the store an early pass later. Just after
// this instance joined, an eighth of its floor share queues it too: a key
// busy here is likely busy elsewhere, where the others hold a floor share
// back for this instance until it syncs the key.
func (e *Engine) floorAdmits(z *Zone, h keyhash.Hash, en *entry, used, floor, events, now int64) bool {
	e.notePromised(z, h, min(used+1, floor))
	if (used+1)*4 >= 3*floor || used+1 > e.promisedCap(z, h, floor, events) || (used+1)*8 >= floor && now < e.warmUntil.Load() {
		e.enqueue(z, h, en)
	}
	return used < floor
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

// record counts an admitted request of h in the key's ring (or takes one of
// its reservations, which the ring counts already), or for an untracked key
// in its local cap alone. The caller holds the key's shard lock, s.
func record(s *shard, h keyhash.Hash, en *entry, ring []uint32, untracked *untrackedState, l *Limit, tat, oldest, now int64, v *Verdict) {
	if en == nil {
		untracked.tat = tat
		return
	}
	n := int64(len(ring))
	if en.flags&flagReserved != 0 {
		// The ring counts the reservation in its slot already; the admit
		// moves to head, in the store at the next step.
		if slot := s.takeReserved(h, en.head); slot != en.head {
			if slot > en.head-n {
				ring[slotIndex(slot, n)]--
			}
			ring[slotIndex(en.head, n)]++
			en.pendCur++
		}
	} else {
		ring[slotIndex(en.head, n)]++
		en.pendCur++
		en.sinceRead++
	}
	en.tat = tat
	// The oldest counted request (this one, if it is the only one) leaves the
	// window when its slot does.
	v.Reset = time.Duration(max(l.slots.LeavesAt(oldest)-now, 0))
}

// shareAdmits applies the near-limit mechanisms to a request the window would
// admit, and says what the instance may admit after it before its next read
// (its part of the headroom, the others' parts counted as used): a key without a fresh read (first contact, or idle past its read's
// lifetime) is queued for a read and admits only its first allowance
// meanwhile; a key whose fleet headroom is small against the fleet's demand
// admits only this instance's share of it until the next read; a key that has
// spent half of what it may spend is queued for an early sync.
func (e *Engine) shareAdmits(z *Zone, s *shard, h keyhash.Hash, en *entry, limit, events, used, now, staleAfter int64) (ok bool, left int64) {
	since := int64(en.sinceRead)
	var allowance int64
	part := int64(-1) // this instance's part of the headroom, for Remaining
	if !en.fresh(now, staleAfter) {
		e.enqueue(z, h, en)
		allowance = firstAllowance(z, s, h, limit, now)
	} else {
		allowance, part = e.readAllowance(z, h, en, limit, events, used, now)
	}
	if part < 0 || part > allowance {
		part = allowance
	}
	return since < allowance, part - since - 1
}

// readAllowance is what this instance may admit of a key read fresh, and
// its part of the fleet's headroom; it asks for the early syncs and the
// reservations the key's standing calls for.
func (e *Engine) readAllowance(z *Zone, h keyhash.Hash, en *entry, limit, events, used, now int64) (allowance, part int64) {
	since := int64(en.sinceRead)
	// The fleet's headroom as of the last read, plus what has left the
	// window since.
	headroom := events - used + since
	allowance = headroom
	// This instance's part: its share of the demand, but no more than
	// an even part, for an instance whose demand the reads have not
	// shown may admit as much unseen.
	part = headroom / (z.fleet.others.Load() + 1)
	if en.flags&flagRated == 0 {
		// No demand measured yet (one read): an even part.
		allowance = part
	} else if en.fleetRate > 0 {
		part = min(part, int64(float64(headroom)*float64(en.ownRate/en.fleetRate)))
	}
	// If the fleet could spend the headroom before the next read (the
	// read's age and two intervals more: a busy machine's reconciler
	// runs late), take only this instance's share of it, and keep the
	// reads coming: every admit asks for an early sync (coalesced: one
	// pass per earlySpacing at most).
	intervals := float64(now-en.readAt)/float64(e.interval.Load()) + 2
	shared := en.flags&flagRated != 0 && intervals*float64(en.fleetRate) >= float64(headroom) && en.fleetRate > 0
	if shared {
		// What the others admitted since the read (its age, and an
		// early pass's spacing for their pushes) is not in it.
		unseen := float64(en.fleetRate-en.ownRate) * (intervals - 2 + 1.0/earlySyncsPerInterval)
		// Rounded to the nearest request: the parts of many instances
		// add up to the headroom, give or take half a request each
		// (rounded down, a key evenly at 95% of its limit, whose window
		// reads full by the one slot it over-counts, is denied).
		allowance = int64(float64(headroom-int64(unseen))*float64(en.ownRate/en.fleetRate) + 0.5)
	}
	// A key near its limit pushes every admit at once: one lost with
	// the instance (kill -9) would be admitted again by the others.
	// Nor does any key hold more than unpushedMost unpushed here.
	nearFull := used*5 >= events*4
	unpushed := int64(en.pendCur) + int64(en.pendPrev) + 1
	if since < allowance && (shared || nearFull || (since+1)*2 >= allowance || unpushed >= unpushedMost(limit)) {
		e.enqueue(z, h, en)
	}
	if since >= allowance && headroom > since && en.flags&flagRated != 0 && 8*en.ownRate >= en.fleetRate {
		// This instance's part is spent, the fleet's is not: what
		// rounding down left goes by reservations, which the store
		// hands out exactly (see reserve.go). An instance with less
		// than an eighth of the demand asks for none: it would hold one
		// that busier ones could use.
		e.askReservation(z, h, en)
	}
	return allowance, part
}

// unpushedMost is the most of a synced key's admits (limit) an instance
// holds before it pushes them (an early pass later), what a kill -9 of it
// loses and the others admit again: a hundredth of the limit, at least one,
// so that two instances killed at once cost a window at most 2% over
// (bench/churn, kill: a key filling at 4x its limit went 3-4 over, the
// admits of the interval before the kill).
func unpushedMost(limit int64) int64 { return max(limit/100, 1) }

// firstAllowance is what an instance admits of a key before it has read the
// fleet's count: its part of what the others' floor shares leave of the
// limit, rounded down so that the live instances' parts never add up to
// more than it, or its part of the room a hot key's announcer saw, rounded
// up. That room is already a forecast two heartbeats ahead, less what the
// fleet asks meanwhile; rounded down too, a key evenly at 95% of its limit
// on 4 instances was denied 24-69 times a run (bench/fleet accuracy group).
// Where the part comes to 0 (a limit below the fleet's size, a hot key
// with no room) the key's first request on this instance is denied and its
// read queued. The caller holds the key's shard lock, s.
func firstAllowance(z *Zone, s *shard, h keyhash.Hash, limit, now int64) int64 {
	live := z.fleet.others.Load() + 1
	if m, hot := s.hotAt(h, now); hot {
		return (max(m.room, 0) + live - 1) / live
	}
	claims := z.fleet.widest()
	if claims == 0 {
		// The fleet is not known yet (no heartbeat answered): a tenth.
		return (limit + 9) / 10
	}
	// Its own claim holds nothing of a key it does not admit on its floor
	// share.
	return (limit - (claims-1)*share(limit, claims)) / live
}

// enqueue asks the reconciler for an early sync of the key, once until it
// runs. The caller holds the key's shard lock.
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
