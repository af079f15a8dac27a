package fleetguard

import (
	"context"
	"math"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/safego"
)

// Output leases (DESIGN.md "Output leases"): a streamed request reserves its
// prompt and a lease of output learned from recent answers of its model, not
// its whole cap, and the lease grows with the stream, atomically across
// every budget of the request. Bytes past the lease wait for the extension;
// a refused extension ends the stream at the lease in the API's own terminal
// form and cancels the upstream request. Output the meter cannot see (hidden
// reasoning) and non-streamed answers hold their whole cap.
//
// Which requests lease is in llmbudget_lease_policy.go, what a model's recent
// answers teach in llmbudget_lease_history.go.

// lease is the output a streamed request holds, grown with the stream. Its
// methods run on the response's goroutine; an extension runs on its own.
//
// Its running count never falls below what the upstream can bill for what
// it has streamed: the API's own running usage (Gemini), one token an event
// with output, and the strict bound of the text (a byte a token,
// usage.OutputTokenBound), which a model's history may scale down only while
// the budgets' room could absorb what that scaling may miss (endGame).
type lease struct {
	h   *LLMBudget
	res *budget.Reservation
	c   *call // the request as estimated: its price, model, prompt, history
	// held is the output held; limit the output the forwarded cap allows,
	// past which nothing needs holding.
	held, limit int64
	// ratio scales the strict bound down to what this model's answers use
	// (1: the bound as is, and then for good).
	ratio float64
	// The running count: text seen, events with text, and the count they
	// make with the API's own running usage.
	text, deltas, count int64
	// inputExcess is the input the upstream reported beyond the estimate
	// (below it: negative), which the lease holds too.
	inputExcess int64
	pending     chan extension // the extension in flight
	refused     bool
	tight       bool   // an extension was refused: extend by what is needed only
	refusedBy   string // the budget that refused ("" when the store failed)
}

// extension is the answer to one extension of more output tokens.
type extension struct {
	more    int64
	granted bool
	failed  bool   // the store did not answer
	by      string // the budget that refused it
}

func newLease(h *LLMBudget, res *budget.Reservation, c *call) *lease {
	l := &lease{h: h, res: res, c: c, held: c.lease, limit: c.outputCap, ratio: 1}
	if bits := c.history.ratio.Load(); bits != 0 && !h.Shadow {
		l.ratio = math.Float64frombits(bits)
		h.store.calibratedLeases.Add(1)
		l.endGame()
	}
	l.count = usage.OutputTokenBound(0)
	return l
}

// observe folds one event into the running count. It reports whether the
// event carried output: only such an event waits for the lease (a usage
// report delivers nothing).
func (l *lease) observe(r usage.Reading) (output bool) {
	if r.OutputTextBytes > l.text {
		l.text = r.OutputTextBytes
		l.deltas++
		output = true
	}
	if r.InputKnown {
		l.inputExcess = r.Usage.InputTokens - l.c.req.PromptTokens
	}
	l.count = max(r.Usage.OutputTokens, l.bound(), l.deltas, l.count)
	return output
}

// bound is the strict bound of the text seen, scaled by the ratio.
func (l *lease) bound() int64 {
	strict := usage.OutputTokenBound(l.text)
	if l.ratio >= 1 {
		return strict
	}
	return int64(math.Ceil(float64(strict) * l.ratio))
}

// need is what the lease must hold for the stream so far: its output count
// and the input the upstream reported beyond the estimate.
func (l *lease) need() int64 { return l.count + l.inputExcess }

// endGame ends the scaling of a calibrated lease when the room its budgets
// have left could not absorb what the scaled counts of this instance's
// calibrated streams may miss: each may stream up to its lease at the strict
// bound (held/ratio, within its cap). From then on it counts strictly, so a
// budget's last room is never spent on a count that may be short. The room
// is what the store answered with the last reserve or extension; streams of
// other instances are not seen (README: "The ceiling").
func (l *lease) endGame() {
	if l.ratio >= 1 {
		return
	}
	miss := min(int64(math.Ceil(float64(l.held)/l.ratio)), l.limit) - l.held
	miss *= max(l.h.store.calibratedLeases.Load(), 1)
	spend := budget.Spend{Tokens: miss}
	if l.h.hasUSD {
		spend.CostMicros = l.c.price.CostMicros(budget.Usage{OutputTokens: miss})
	}
	for _, hd := range l.res.Holds {
		if hd.Budget.Limit-hd.Used < hd.Budget.Amount(spend) {
			l.strict()
			l.count = max(l.count, l.bound())
			return
		}
	}
}

// strict makes the lease count by the strict bound from now on (and no more
// as a calibrated lease in flight).
func (l *lease) strict() {
	if l.ratio < 1 {
		l.ratio = 1
		l.h.store.calibratedLeases.Add(-1)
	}
}

// step is how far ahead of the count a lease is extended.
func (l *lease) step() int64 { return max(l.h.outputLeaseMin/4, l.held/4) }

// admit reports whether the output counted so far may reach the client:
// within the lease, or once an extension covers it (waiting for it if it
// must). An extension starts when the count nears the lease, so the wait is
// rare. Once one is refused the lease is tight: it is extended only by what
// an event needs, when it needs it, so a stream near the limit spends the
// budget to its last tokens. It is false when a tight extension was refused,
// or one failed.
func (l *lease) admit() bool {
	if l.pending != nil {
		select {
		case ext := <-l.pending:
			l.apply(ext)
		default:
		}
	}
	if l.held >= l.limit {
		return true // the forwarded cap bounds the rest
	}
	if l.pending == nil && !l.refused && (l.need() > l.held || !l.tight && l.need()+l.step() > l.held) {
		l.extend()
	}
	for l.need() > l.held && l.held < l.limit {
		if l.pending == nil {
			return false
		}
		l.apply(<-l.pending)
		if l.need() > l.held && !l.refused && l.held < l.limit {
			l.extend()
		}
	}
	return true
}

func (l *lease) apply(ext extension) {
	l.pending = nil
	switch {
	case ext.granted:
		l.held += ext.more
		l.endGame()
	case l.h.Shadow || ext.failed && l.h.FailOpen:
		// Shadow mode enforces nothing, and fail_open admits while the store
		// fails: the stream runs on unleased, and settles to what it reports.
		l.held = l.limit
	case !ext.failed && !l.tight:
		l.tight = true // a budget is nearly spent: ask for what is needed only
	default:
		l.refused, l.refusedBy = true, ext.by
	}
}

// extend asks, off the byte path, for enough more output to cover the count
// and a step beyond it (a tight lease: the count only), up to the forwarded
// cap.
func (l *lease) extend() {
	more := l.need() - l.held
	if !l.tight {
		more += l.step()
	}
	more = min(more, l.limit-l.held)
	spend := budget.Spend{Tokens: more}
	if l.h.hasUSD {
		spend.CostMicros = l.c.price.CostMicros(budget.Usage{OutputTokens: more})
	}
	ch := make(chan extension, 1)
	l.pending = ch
	h, res := l.h, l.res
	go func() {
		ext := extension{more: more, failed: true} // until the store answers
		defer func() { ch <- ext }()
		defer safego.Recover("llmbudget lease", h.store.reportPanic)
		ctx, cancel := context.WithTimeout(context.Background(), h.storeTimeout)
		defer cancel()
		denial, err := h.store.budgets.Extend(ctx, res, spend)
		switch {
		case err != nil:
			metrics.llmLeaseExtensions.WithLabelValues("failed").Inc()
			msg := "extending an output lease failed; the stream ends at its lease"
			if h.FailOpen || h.Shadow {
				msg = "extending an output lease failed; the stream goes on unleased (fail_open or shadow)"
			}
			h.logger.Warn(msg, zap.String("reservation", res.ID), zap.Error(err))
		case denial != nil:
			ext.failed, ext.by = false, denial.Budget.Name
			metrics.llmLeaseExtensions.WithLabelValues("refused").Inc()
		default:
			ext.failed, ext.granted = false, true
			metrics.llmLeaseExtensions.WithLabelValues("granted").Inc()
		}
	}()
}

// learn tells the model's history how this answer ended: reported output
// tokens, counted as l.count.
func (l *lease) learn(reported int64) {
	l.c.history.learn(l.count, usage.OutputTokenBound(l.text), reported)
}

// holdAll extends the lease to the whole cap, waiting for the answer: for an
// answer whose output cannot be counted as it passes. Refused, the answer
// passes all the same (it cannot be cut) and is charged what it reports.
func (l *lease) holdAll() bool {
	l.count = max(l.count, l.limit)
	return l.admit() && l.held >= l.limit
}

// wait ends the extension in flight, if any, before the settle reads the
// reservation.
func (l *lease) wait() {
	if l.pending != nil {
		l.apply(<-l.pending)
	}
}

// end tells the store the lease is no longer in flight.
func (l *lease) end() { l.strict() }

// charge is the output a stream that ended without its usage is charged
// at most: what the lease holds, less the input the upstream reported beyond
// the estimate, so that the settle charges what the reservation holds.
func (l *lease) charge() int64 { return max(l.held-l.inputExcess, 0) }
