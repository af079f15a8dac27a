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
	// Store holds the fleet's counts and slot table (RedisStore). Required
	// but with Solo, where there is no fleet to share counts with.
	Store SlotStore
	// Prefix starts every store key.
	Prefix string
	// SyncInterval is the period of the reconciler (jittered by ±10%).
	// Default DefaultSyncInterval.
	SyncInterval time.Duration
	// IdleTTL is the least time an idle key is kept (default 10 minutes; a key
	// is always kept for two of its windows).
	IdleTTL time.Duration
	// Solo says this instance is alone (the embedded store): there is no
	// fleet, and every key is limited on this instance's own count, with
	// no store call.
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
	// fleetSlots is the fleet's max instances as the last heartbeat learned
	// it (this instance's until then), and lastMismatch the last differing
	// number logged.
	fleetSlots, lastMismatch atomic.Int64
	floors                   atomic.Bool

	interval atomic.Int64 // nanoseconds

	zonesMu sync.Mutex
	zones   atomic.Pointer[[]*Zone] // copy-on-write: the reconciler reads it without the lock

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
	// slot it holds (-1: none) and life its life there, its floor usable
	// until heldUntil (its record's end as of its last heartbeat); view the
	// lives of the slots at the last heartbeat; live the live instances
	// then.
	member           int64
	slot, life       atomic.Int64
	heldUntil        atomic.Int64
	view             atomic.Pointer[slotView]
	live             atomic.Int64
	lastBeat         atomic.Int64 // Unix ns
	announced        int64        // the last heartbeat that reached the store, Unix ns (beatMu)
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
	if o.Store == nil && !o.Solo {
		return nil, errors.New("ratelimit: a slot store is required for a fleet")
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
		slotsKey: o.Prefix + ":rl3:slots:{fleet}",
		hotKey:   o.Prefix + ":rl3:hot:{fleet}",
		solo:     o.Solo,
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
		kick:     make(chan struct{}, 1),
	}
	e.slot.Store(-1)
	passed := make(chan struct{})
	e.passed.Store(&passed)
	e.SetMaxInstances(o.MaxInstances)
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
// DefaultMaxInstances) from the next heartbeat on (see learnSlots).
func (e *Engine) SetMaxInstances(n int) {
	if n <= 0 {
		n = DefaultMaxInstances
	}
	e.maxInstances.Store(int64(min(n, 64)))
	e.fleetSlots.CompareAndSwap(0, int64(min(n, 64)))
}

// MaxInstances is the number of instance slots this instance is
// configured with; floors are sized by the fleet's (slots).
func (e *Engine) MaxInstances() int { return int(e.maxInstances.Load()) }

func (e *Engine) slots() int { return int(e.fleetSlots.Load()) }

// SetNearLimit turns the floors on or off (see Options.FixedInterval).
func (e *Engine) SetNearLimit(on bool) { e.floors.Store(on) }

// NearLimit reports whether the floors are on.
func (e *Engine) NearLimit() bool { return e.floors.Load() }

// Members is how many instances the last heartbeat found live, this one
// included (0 before the first, and for a solo engine).
func (e *Engine) Members() int64 { return e.live.Load() }

// SyncInterval is the reconciler's period.
func (e *Engine) SyncInterval() time.Duration { return time.Duration(e.interval.Load()) }

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
	if e.started.Load() && e.healthy.Load() {
		// A zone made on a running engine hears the fleet's hot keys (and
		// the first takes the slot) before its first request.
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
	// the grant and this instance's share of the room the fleet had left at
	// its last call (the room split among the instances holding grants:
	// the rest may have gone to them since); with the store down or alone,
	// the window's room on this instance's count.
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
			record(s, en, ring, untracked, c.Limit, tat, oldest, now, v)
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
			record(shards[i], entries[i], rings[i], untracked[i], checks[i].Limit, tats[i], oldest[i], now, &out[i])
		}
	}
	for i := len(checks) - 1; i >= 0; i-- {
		shards[i].mu.Unlock()
	}
	return denied
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
