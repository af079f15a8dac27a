package fleetguard

import (
	"context"
	"time"
)

// A leased stream forwards output only within its grant: what a sweep
// would settle its reservation to should this instance fall silent (killed,
// or cut off from the store; budget/lapse.go). The lease holds the output
// a stream may reach in the budgets; the grant, a finer mark within it, is
// what it has been let reach. A grant is raised ahead of the stream, by the
// output it makes in grantAhead at its rate so far, and written with the
// instance's next word (within a quarter of a second), so a stream that
// keeps its pace never waits for one; a stream that outruns it waits for a
// grant written at once. So a dead instance's streams are settled to what
// they were granted (their output so far and about a second of it
// ahead), not to the leases ahead of them.

const (
	// grantAhead is how much of a stream's output, at its rate so far, a
	// grant covers beyond its count.
	grantAhead = time.Second
	// grantLeast is the least a grant covers beyond a stream's count, in
	// tokens.
	grantLeast = 64
)

// grant is a lease's grant, kept as what a lapse would give back of the
// output the lease holds (back; the gate is the lease less it, so an
// extension raises both alike, in the store and here): a smaller back
// waiting to be written (raiseBack, its number raiseSeq; 0: none), and next,
// the need past which the next grant is asked for. ungated: nothing is
// gated (shadow mode, fail_open in an outage).
type grant struct {
	back, raiseBack, raiseSeq, next int64
	started                         time.Time
	ungated                         bool
}

// startGrant starts a lease's grant: all of its first lease, as the store
// has it, until the stream's pace says how much of it a grant needs.
func (l *lease) startGrant() {
	l.grant = grant{started: time.Now(), ungated: l.h.Shadow}
}

// gate is the output the stream may forward.
func (l *lease) gate() int64 { return l.held - l.grant.back }

// grantStep is how far past the need a grant goes: the stream's output in
// grantAhead at its rate so far, its margin, and at least grantLeast.
func (l *lease) grantStep() int64 {
	elapsed := max(time.Since(l.grant.started), time.Millisecond)
	rate := int64(float64(l.count) * float64(grantAhead) / float64(elapsed))
	return max(rate, grantLeast) + l.margin
}

// granted reports whether the output counted so far is within the grant.
// Past next it asks for the grant a step past the need, written with the
// instance's next word: a lower one (the stream is slower than the lease is
// long) holds here at once, a higher one once the store has it. Past the
// gate it waits for one written at once. It is false when the stream must
// end where it is: the store holds its reservation no more (a sweep took
// this instance for dead), or did not answer for maxLeaseWait, or is known
// down.
func (l *lease) granted() bool {
	g := &l.grant
	if g.ungated {
		return true
	}
	if g.raiseSeq > 0 && l.res.GrantWritten() >= g.raiseSeq {
		g.back, g.raiseSeq = g.raiseBack, 0
	}
	need := l.need()
	if g.raiseSeq == 0 && need > g.next {
		step := l.grantStep()
		switch back := l.held - min(need+step, l.held); {
		case back > g.back:
			l.h.engines.budgets.Grant(l.res, l.spendOf(back))
			g.back = back // held to at once: the store's is higher until written
		case back < g.back:
			g.raiseBack, g.raiseSeq = back, l.h.engines.budgets.Grant(l.res, l.spendOf(back))
		}
		// Asked again half a step on, or halfway to the lease's end: a
		// stream's first rate (of its first events) can be far above its
		// pace.
		g.next = need + min(step, l.held-need)/2
	}
	if need <= l.gate() {
		return true
	}
	return l.waitGrant(need)
}

// waitGrant writes a grant past need at once, trying again while the store
// does not answer, as an extension does. A stream it ends takes the
// extension in flight first, so what it is told it used is what is charged.
func (l *lease) waitGrant(need int64) bool {
	step := l.grantStep()
	back := l.held - min(need+step, l.held)
	budgets := l.h.engines.budgets
	deadline := time.Now().Add(maxLeaseWait)
	for backoff := extendBackoff; ; backoff = min(2*backoff, maxExtendBackoff) {
		ctx, cancel := context.WithTimeout(context.Background(), l.h.storeTimeout)
		gone, err := budgets.GrantNow(ctx, l.res, l.spendOf(back))
		cancel()
		switch {
		case err == nil && !gone:
			l.grant.back, l.grant.raiseSeq, l.grant.next = back, 0, need+min(step, l.held-need)/2
			return true
		case err == nil, budgets.Down(), time.Now().After(deadline):
			// Gone: a sweep took this instance for dead.
			if l.h.FailOpen && err != nil {
				l.grant.ungated = true // fail_open: the stream runs on unleased
				return true
			}
			l.wait()
			l.refused = true
			return false
		}
		time.Sleep(backoff)
	}
}
