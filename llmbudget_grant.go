package fleetguard

import (
	"context"
	"math"
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
	// tokens: a stream's first events come before it has a rate.
	grantLeast = 64
	// noGate: the stream forwards all its lease holds.
	noGate = math.MaxInt64
)

// grant is a lease's grant: gate is the output the stream may forward;
// raise, a higher gate asked for, and raiseSeq its number (0: none); next,
// the need past which the next raise is asked for; started, when the stream
// began, for its rate.
type grant struct {
	gate, raise, raiseSeq, next int64
	started                     time.Time
}

// startGrant gives a new lease its first grant, written with the next word:
// the least grant, the rest of the first lease given back by a sweep. The
// stream forwards within it before the store has it: until then a sweep
// would keep the whole hold, which is more. In shadow mode nothing is held
// back, so nothing is gated.
func (l *lease) startGrant() {
	l.grant = grant{gate: noGate, next: noGate, started: time.Now()}
	if l.h.Shadow || l.held <= 2*grantLeast {
		return
	}
	l.grant.gate, l.grant.next = grantLeast, grantLeast/2
	l.h.engines.budgets.Grant(l.res, l.spendOf(l.held-grantLeast))
}

// step is how far past the need a grant goes: the stream's output in
// grantAhead at its rate so far, its margin, and at least grantLeast.
func (l *lease) grantStep() int64 {
	elapsed := max(time.Since(l.grant.started), time.Millisecond)
	rate := int64(float64(l.count) * float64(grantAhead) / float64(elapsed))
	return max(rate, grantLeast) + l.margin
}

// granted reports whether the output counted so far is within the grant,
// asking for a higher one once the need passes next, and waiting for one
// written at once when the need passes the gate. It is false when the
// stream must end where it is: the store holds its reservation no more (a
// sweep took this instance for dead), or did not answer for maxLeaseWait,
// or is known down.
func (l *lease) granted() bool {
	g := &l.grant
	if g.gate == noGate {
		return true
	}
	if g.raiseSeq > 0 && l.res.GrantWritten() >= g.raiseSeq {
		l.setGate(g.raise)
	}
	need := l.need()
	if g.raiseSeq == 0 && need > g.next {
		if target := min(need+l.grantStep(), l.held); target > g.gate {
			g.raise = target
			g.raiseSeq = l.h.engines.budgets.Grant(l.res, l.spendOf(l.held-target))
		}
	}
	if need <= g.gate {
		return true
	}
	return l.waitGrant(need)
}

// setGate moves the gate to target, and the next raise to half a step
// short of it.
func (l *lease) setGate(target int64) {
	g := &l.grant
	g.gate, g.raiseSeq = target, 0
	g.next = target - l.grantStep()/2
	if target >= l.held {
		g.next = target // raised again only once the lease grows
	}
}

// waitGrant writes a grant past need at once, trying again while the store
// does not answer, as an extension does.
func (l *lease) waitGrant(need int64) bool {
	target := min(need+l.grantStep(), l.held)
	budgets := l.h.engines.budgets
	deadline := time.Now().Add(maxLeaseWait)
	for backoff := extendBackoff; ; backoff = min(2*backoff, maxExtendBackoff) {
		ctx, cancel := context.WithTimeout(context.Background(), l.h.storeTimeout)
		gone, err := budgets.GrantNow(ctx, l.res, l.spendOf(l.held-target))
		cancel()
		switch {
		case err == nil && !gone:
			l.setGate(target)
			return true
		case err == nil:
			l.refused = true // swept: the fleet took this instance for dead
			return false
		case l.h.FailOpen:
			l.grant.gate = noGate // fail_open: the stream runs on unleased
			return true
		case budgets.Down() || time.Now().After(deadline):
			l.refused = true
			return false
		}
		time.Sleep(backoff)
	}
}
