package ratelimit

import (
	"math"
	"sync"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/window"
)

// entry is the state of one key of one zone on this instance. Its mutex is the
// only lock a request takes per zone besides a shard read lock, so no lock is
// shared by all keys.
//
// Admits follow a claim model: local holds admits no reconcile pass has claimed
// yet. A pass moves them to inflight (claimed, being pushed) and clears
// inflight when it is done, so an admit is counted once locally until the
// shared counter holds it, and never pushed twice.
type entry struct {
	mu   sync.Mutex
	hash keyhash.Hash
	// fleet is false for a key created past the zone's max_keys: it has the
	// local cap only and is never pushed.
	fleet bool
	// dead is set when the reconciler evicts the entry; a request that finds it
	// set looks the key up again.
	dead bool

	window time.Duration
	tat    int64 // GCRA theoretical arrival time, Unix ns

	epoch      int64 // fixed window that local belongs to
	local      int64 // admits not yet claimed by a reconcile pass
	carry      int64 // unclaimed admits owed to carryEpoch after an epoch roll
	carryEpoch int64
	inflight   int64 // claimed by the running pass, not yet in the estimate

	remote     int64 // ceil of the fleet's sliding estimate at estimateAt
	remotePrev int64 // the previous epoch's counter behind remote, for Retry-After
	estimateAt int64 // Unix ns of the last successful read; 0 = never

	lastSeen int64 // last request for the key, Unix ns
}

func newEntry(h keyhash.Hash, fleet bool, now int64, w time.Duration) *entry {
	e := &entry{hash: h, fleet: fleet, lastSeen: now}
	e.reset(now, w)
	return e
}

// reset puts the entry at the start of window w. Admits of another window length
// are a different accounting unit and are dropped, not remapped.
func (e *entry) reset(now int64, w time.Duration) {
	e.window, e.tat = w, 0
	e.epoch, e.local, e.carry, e.carryEpoch = window.Epoch(now, w), 0, 0, 0
	// inflight stays: the running pass still owns those admits.
	e.remote, e.remotePrev, e.estimateAt = 0, 0, 0
}

// touch rolls the entry to the epoch of now and marks it active. Unclaimed
// admits of the epoch being left become carryover owed to that epoch, so an
// epoch boundary never drops them. Callers hold e.mu.
func (e *entry) touch(now int64, w time.Duration) {
	if e.window != w {
		e.reset(now, w)
	}
	if ep := window.Epoch(now, w); ep != e.epoch {
		if e.local > 0 {
			if e.carry > 0 && e.carryEpoch != e.epoch {
				// Two boundaries passed without a reconcile (interval longer than
				// the window): keep the newer epoch rather than file two epochs'
				// admits under one label.
				e.carry = 0
			}
			e.carry += e.local
			e.carryEpoch = e.epoch
		}
		e.epoch = ep
		e.local = 0
	}
	e.lastSeen = now
}

// fleetUsed is this instance's view of the fleet's consumption in the sliding
// window: the cached estimate while fresh, plus everything of its own that the
// estimate cannot contain yet.
func (e *entry) fleetUsed(now, staleAfter int64) int64 {
	used := e.local + e.carry + e.inflight
	if e.estimateAt != 0 && now-e.estimateAt < staleAfter {
		used += e.remote
	}
	return used
}

// fleetRetryAfter estimates how long until the sliding window has room for
// one more request, when used exceeds the limit by over-1. Inside the current
// epoch only the previous epoch's share decays; past the boundary the current
// epoch's count becomes the previous one and decays in turn. Events are
// assumed spread evenly, as the sliding estimate itself assumes.
func (e *entry) fleetRetryAfter(now, used, over int64) int64 {
	w := float64(e.window)
	rest := float64(window.Remaining(now, e.window))
	prev := float64(e.remotePrev)
	prevShare := prev * rest / w
	if prev > 0 && prevShare >= float64(over) {
		return int64(math.Ceil(float64(over) * w / prev))
	}
	cur := float64(used) - prevShare
	if cur <= 0 {
		return int64(rest)
	}
	wait := rest + math.Ceil((float64(over)-prevShare)*w/cur)
	return int64(math.Min(wait, rest+w))
}

// pending reports whether the entry holds admits the store has not seen.
func (e *entry) pending() bool { return e.local > 0 || e.carry > 0 || e.inflight > 0 }
