package ratelimit

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/window"
)

// Options configure an Engine.
type Options struct {
	// Store holds the fleet's shared counters. Required; use NewMemoryStore for
	// a single instance.
	Store CounterStore
	// Prefix starts every store key.
	Prefix string
	// SyncInterval is the period of the reconciler (jittered by ±10%).
	SyncInterval time.Duration
	// IdleTTL is the least time an idle key is kept (default 10 minutes; a key
	// is always kept for two of its windows).
	IdleTTL time.Duration
	Logger  *zap.Logger
	// OnPass, when set, is told the outcome of every reconcile pass that had
	// keys to sync (nil error: the store was reached), for metrics.
	OnPass func(err error)
}

// DefaultSyncInterval is used when Options.SyncInterval is zero.
const DefaultSyncInterval = 250 * time.Millisecond

// minSyncInterval keeps a typo such as "1ns" from turning the reconciler into
// a busy loop against the store.
const minSyncInterval = 10 * time.Millisecond

// Engine owns the zones, their per-key state and the reconciler. One Engine
// serves every config that names the same store, across reloads.
type Engine struct {
	store   CounterStore
	prefix  string
	idleTTL time.Duration
	log     *zap.Logger
	onPass  func(error)

	interval atomic.Int64 // nanoseconds

	zonesMu sync.Mutex
	zones   atomic.Pointer[[]*Zone] // copy-on-write: the reconciler reads it without the lock

	healthy atomic.Bool
	stop    chan struct{}
	done    chan struct{}
	started atomic.Bool
	stopped atomic.Bool

	passMu sync.Mutex // one reconcile pass at a time
}

// NewEngine builds an engine; call Start to run its reconciler.
func NewEngine(o Options) (*Engine, error) {
	if o.Store == nil {
		return nil, errors.New("ratelimit: a counter store is required")
	}
	if o.IdleTTL <= 0 {
		o.IdleTTL = 10 * time.Minute
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	e := &Engine{
		store:   o.Store,
		prefix:  o.Prefix,
		idleTTL: o.IdleTTL,
		log:     o.Logger,
		onPass:  o.OnPass,
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
	}
	e.SetSyncInterval(o.SyncInterval)
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

// SyncInterval is the reconciler's period.
func (e *Engine) SyncInterval() time.Duration { return time.Duration(e.interval.Load()) }

// staleAfter is how old an estimate may be before the gate ignores it.
func (e *Engine) staleAfter() int64 {
	return max(4*e.interval.Load(), int64(2*time.Second))
}

// Zone returns the zone called name, creating it on first use.
func (e *Engine) Zone(name string) *Zone {
	for _, z := range *e.zones.Load() {
		if z.name == name {
			return z
		}
	}
	e.zonesMu.Lock()
	defer e.zonesMu.Unlock()
	cur := *e.zones.Load()
	for _, z := range cur {
		if z.name == name {
			return z
		}
	}
	z := newZone(name, len(cur))
	next := append(append(make([]*Zone, 0, len(cur)+1), cur...), z)
	e.zones.Store(&next)
	return z
}

// Zones lists the zones in creation order.
func (e *Engine) Zones() []*Zone { return append([]*Zone(nil), *e.zones.Load()...) }

// Check is one zone's part of a request: which zone, its policy and the key.
type Check struct {
	Zone  *Zone
	Limit *Limit
	Key   keyhash.Hash
}

// Verdict is one zone's answer for a request.
type Verdict struct {
	Allowed bool
	// Remaining is how many more requests the zone admits now after this one
	// (0 when denied).
	Remaining int64
	// Reset is the time until the zone's quota is whole again as far as this
	// instance knows: the end of the current window.
	Reset time.Duration
	// RetryAfter is, for a denial, when the request would fit.
	RetryAfter time.Duration
	// Fleet is true when the fleet cap (not the local cap) denied the request.
	Fleet bool
}

// MaxChecks bounds the zones of one request so the request path can keep its
// working set on the stack.
const MaxChecks = 16

// ErrTooManyZones is returned by Allow for more than 16 zones in one request.
var ErrTooManyZones = errors.New("ratelimit: more than 16 zones in one request")

// Allow decides a request at now (Unix ns) against every check, which must be
// ordered by ascending Zone.ID and name each zone once. It fills out (one
// Verdict per check) and returns the index of the first denying check, or -1
// when all admit. The request is recorded in every zone only when all admit:
// a denial consumes nothing anywhere. Allow never touches the store.
func (e *Engine) Allow(now int64, checks []Check, out []Verdict) (int, error) {
	if len(checks) > MaxChecks {
		return -1, ErrTooManyZones
	}
	var entries [MaxChecks]*entry
	var taken [MaxChecks]gcra
	staleAfter := e.staleAfter()
retry:
	for i := range checks {
		c := &checks[i]
		en := c.Zone.lookup(c.Key, now, c.Limit.Window)
		en.mu.Lock()
		if en.dead {
			en.mu.Unlock()
			for j := 0; j < i; j++ {
				entries[j].mu.Unlock()
			}
			goto retry
		}
		entries[i] = en
	}
	denied := -1
	for i := range checks {
		l := checks[i].Limit
		en := entries[i]
		en.touch(now, l.Window)
		v := &out[i]
		*v = Verdict{Reset: window.Remaining(now, l.Window)}
		g := gcraCheck(en.tat, now, l)
		taken[i] = g
		remaining := g.remaining
		if en.fleet {
			used := en.fleetUsed(now, staleAfter)
			if used >= l.Events {
				v.Fleet = true
				v.RetryAfter = time.Duration(en.fleetRetryAfter(now, used, used-l.Events+1))
				if denied < 0 {
					denied = i
				}
				continue
			}
			remaining = min(remaining, l.Events-used-1)
		}
		if !g.allowed {
			v.RetryAfter = time.Duration(g.retryAfter)
			if denied < 0 {
				denied = i
			}
			continue
		}
		v.Allowed = true
		v.Remaining = remaining
	}
	if denied < 0 {
		for i := range checks {
			en := entries[i]
			en.tat = taken[i].newTAT
			if en.fleet {
				en.local++
			}
		}
	}
	for i := range checks {
		entries[i].mu.Unlock()
	}
	return denied, nil
}
