package budget

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fleetguard/fleetguard/internal/safego"
)

// An instance that dies (kill -9, a lost machine) cannot settle what it had
// in flight. Its holds would stay for the rest of their windows, whole
// leases ahead included. So each instance owns its reservations: while it
// has any open it says so every wordEvery, and any instance that finds an
// owner silent for the lapse settles the owner's open reservations in one
// step (Store.Sweep), each to what it holds less what its stream had not
// been granted to use.
//
// A grant is what a stream may forward: the stream waits at its grant as it
// waits at its lease, until the store has the higher one. So a sweep never
// settles below what the stream could have sent, even if its instance was
// only cut off from the store, not dead: its stream stops at the grant the
// sweep charged. A reservation never granted (an answer that is not
// streamed, a stream not leased) keeps its whole hold.

const (
	// DefaultLapse is how long an owner may be silent before its open
	// reservations are swept: many words, so that a slow machine or a short
	// store stall does not pass for a death.
	DefaultLapse = 6 * time.Second
	// wordEvery is how often an instance with open reservations speaks;
	// grantEvery how often it writes the grants its streams asked for.
	wordEvery  = time.Second
	grantEvery = 250 * time.Millisecond
	// sweepEvery is about how often a speaking instance sweeps (jittered,
	// so a fleet's sweeps spread out), sweepBatch the most one sweep
	// settles.
	sweepEvery = 2 * time.Second
	sweepBatch = 256
)

// grants is a reservation's grant state: the last number given, the grant
// waiting to be written (nil when none) and the highest number written.
type grants struct {
	mu      sync.Mutex
	seq     int64
	waiting []int64
	written atomic.Int64
}

// GrantWritten is the number of the last grant of r the store has.
func (r *Reservation) GrantWritten() int64 { return r.grants.written.Load() }

// Grant asks that a lapse of r return giveBack: the part of its hold its
// stream has not been granted to use. The instance's next word (within
// grantEvery) writes it; GrantWritten tells when. It returns the grant's
// number.
func (e *Engine) Grant(r *Reservation, giveBack Spend) int64 {
	g := &r.grants
	g.mu.Lock()
	g.seq++
	seq := g.seq
	g.waiting = returnsOf(r, giveBack)
	g.mu.Unlock()
	return seq
}

// GrantNow writes a grant of r at once, for a stream that waits for it. Gone
// reports a reservation the store does not hold any more (settled, or swept:
// its stream must stop where it is).
func (e *Engine) GrantNow(ctx context.Context, r *Reservation, giveBack Spend) (gone bool, err error) {
	g := &r.grants
	g.mu.Lock()
	g.seq++
	grant := Grant{Record: e.recordKey(r), Seq: g.seq, Returns: returnsOf(r, giveBack)}
	g.waiting = nil
	g.mu.Unlock()
	answer, err := e.store.Grant(ctx, e.ownersKey(), e.owner, []Grant{grant})
	if e.failed(err) != nil {
		return false, err
	}
	if !answer[0] {
		r.grants.wrote(grant.Seq)
	}
	return answer[0], nil
}

// wrote records that the store has grant seq.
func (g *grants) wrote(seq int64) {
	for {
		was := g.written.Load()
		if seq <= was || g.written.CompareAndSwap(was, seq) {
			return
		}
	}
}

// returnsOf is giveBack in the unit of each of r's counters, at most what
// each holds.
func returnsOf(r *Reservation, giveBack Spend) []int64 {
	out := make([]int64, len(r.Holds))
	for i := range r.Holds {
		out[i] = max(r.Holds[i].Budget.Amount(giveBack), 0)
	}
	return out
}

// record names r's record and its owner, this engine.
func (e *Engine) record(r *Reservation) Record {
	return Record{Key: e.recordKey(r), Owners: e.ownersKey(), Owner: e.owner}
}

// ownersKey names the owners' set, <prefix>:bg:{b}:owners, in the budgets'
// hash tag: an owner's open set is <owners>:<owner>.
func (e *Engine) ownersKey() string { return e.prefix + ":bg:{b}:owners" }

// opened counts r among the engine's open reservations, and starts its
// word with the first.
func (e *Engine) opened(r *Reservation) {
	e.openMu.Lock()
	e.open[r] = struct{}{}
	e.openMu.Unlock()
	e.speakOnce.Do(func() {
		e.background.Add(1)
		go e.speak()
	})
}

// settled takes r out of the engine's open reservations.
func (e *Engine) settled(r *Reservation) {
	e.openMu.Lock()
	delete(e.open, r)
	e.openMu.Unlock()
}

// speak is the engine's word: every grantEvery it writes the grants its
// streams asked for, and at least every wordEvery, while it has open
// reservations, it says it is alive; about every sweepEvery it sweeps the
// silent owners' reservations.
func (e *Engine) speak() {
	defer e.background.Done()
	defer safego.Recover("budget word", e.OnPanic)
	tick := time.NewTicker(grantEvery)
	defer tick.Stop()
	var spoke, swept time.Time
	for {
		select {
		case <-e.closed:
			return
		case <-tick.C:
		}
		now := time.Now()
		grants, of, open := e.waitingGrants()
		if len(grants) > 0 || open && now.Sub(spoke) >= wordEvery {
			if e.say(grants, of) {
				spoke = now
			}
		}
		if now.Sub(swept) >= sweepEvery+time.Duration(rand.Int64N(int64(sweepEvery))) {
			swept = now
			e.sweep()
		}
	}
}

// waitingGrants takes the grants waiting to be written and their
// reservations, and reports whether any reservation is open.
func (e *Engine) waitingGrants() (grants []Grant, of []*Reservation, open bool) {
	e.openMu.Lock()
	defer e.openMu.Unlock()
	for r := range e.open {
		g := &r.grants
		g.mu.Lock()
		if g.waiting != nil {
			grants = append(grants, Grant{Record: e.recordKey(r), Seq: g.seq, Returns: g.waiting})
			of = append(of, r)
			g.waiting = nil
		}
		g.mu.Unlock()
	}
	return grants, of, len(e.open) > 0
}

// say writes grants with the engine's word, and reports whether the store
// took it. A grant not written is asked again by its stream when it needs it.
func (e *Engine) say(grants []Grant, of []*Reservation) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	gone, err := e.store.Grant(ctx, e.ownersKey(), e.owner, grants)
	if err != nil {
		return false // not a store error of a request's: like a probe's
	}
	for i, g := range grants {
		if !gone[i] {
			of[i].grants.wrote(g.Seq)
		}
	}
	return true
}

// sweep settles the open reservations of owners silent for the lapse.
func (e *Engine) sweep() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	n, err := e.store.Sweep(ctx, e.ownersKey(), e.owner, e.Lapse, sweepBatch)
	if err == nil && n > 0 && e.OnSweep != nil {
		e.OnSweep(n)
	}
}
