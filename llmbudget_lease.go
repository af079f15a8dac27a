package fleetguard

import (
	"context"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/safego"
)

// Output leases (README, "Output leases"): a streamed request reserves its
// prompt and a lease of output learned from recent answers of its model, not
// its whole cap, and the lease grows with the stream, atomically across
// every budget of the request. Bytes past the lease wait for the extension;
// a refused extension ends the stream at the lease in the API's own terminal
// form and cancels the upstream request. Output the meter cannot see (hidden
// reasoning, a model not yet proven) and non-streamed answers hold their
// whole cap.
//
// Which requests lease is in llmbudget_lease_policy.go, what a model's recent
// answers teach in llmbudget_lease_history.go.

// lease is the output a streamed request holds, grown with the stream. Its
// methods run on the response's goroutine; an extension runs on its own.
//
// Its running count never falls below what the upstream can bill for what
// it has streamed: the API's own running usage (Gemini) and the strict bound
// of the text (a byte a token, usage.OutputTokenBound), or, for a model
// counted by its own public tokenizer (tokenized), that tokenizer's count of
// each output value the meter read alone, and a token a byte of any text it
// did not read. No history scales it down: a count below those bets that
// the next answer is like the last ones, and a bet lost in a budget's last
// room cannot be given back (README, "The ceiling").
type lease struct {
	h   *LLMBudget
	res *budget.Reservation
	c   *call // the request as estimated: its price, model, prompt, history
	// held is the output held; limit the output the forwarded cap allows,
	// past which nothing needs holding.
	held, limit int64
	// The running count: the output text seen, and the count it makes with
	// the API's own running usage.
	text, count int64
	// tokens is the tokenizer's count of the text: of each value the meter
	// counted (tokensText bytes and tokensSeen tokens at its last reading),
	// and a token a byte of an event's text it did not count whole. It is
	// the count while the model is tokenized, with a margin: twice the
	// largest event's text, in bytes, so that the events an upstream
	// generates while the lease withholds them and before it sees the cut
	// (a busy machine's upstream gets a second one out), which it bills, are
	// held too.
	tokenized                      bool
	tokens, tokensText, tokensSeen int64
	margin                         int64
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
	return &lease{h: h, res: res, c: c, held: c.lease, limit: c.outputCap, count: usage.OutputTokenBound(0),
		tokenized: c.tokens != nil && c.history.countsTokens()}
}

// observe folds one event into the running count. It reports whether the
// event carried output: only such an event waits for the lease (a usage
// report delivers nothing).
func (l *lease) observe(r usage.Reading) (output bool) {
	// An event's text is its tokens only when the meter's counter read all
	// of it (the values it counted hold as many bytes as the meter's
	// text grew by); else a token a byte.
	text, counted := r.OutputTextBytes-l.text, r.OutputTokensText-l.tokensText
	if counted == text {
		l.tokens += r.OutputTokens - l.tokensSeen
	} else {
		l.tokens += max(text, 0)
	}
	l.margin = max(l.margin, 2*text)
	l.tokensText, l.tokensSeen = r.OutputTokensText, r.OutputTokens
	if r.OutputTextBytes > l.text {
		l.text = r.OutputTextBytes
		output = true
	}
	if r.InputKnown {
		l.inputExcess = r.Usage.InputTokens - l.c.req.PromptTokens
	}
	// (The bound is at least a token an event with text: each has a byte.)
	// The API's own running usage (Gemini's) gets the margin too: an
	// upstream bills the events it generates before it sees a cut.
	running := r.Usage.OutputTokens
	if running > 0 {
		running += l.margin
	}
	l.count = max(running, l.bound(), l.count)
	return output
}

// bound is the count of the text seen: the tokenizer's, and its margin,
// while the model is counted by it (an answer of it that bills more ends
// that for every stream of it, this one included); a proxy tokenizer's at
// its scale while the text is within its density; else the strict bound.
func (l *lease) bound() int64 {
	if !l.tokenized {
		return usage.OutputTokenBound(l.text)
	}
	switch o := l.c.history; {
	case o.tokensRevoked.Load():
	case !l.c.proxy:
		return l.tokens + usage.OutputOverheadTokens + l.margin
	case o.trusts(l.tokens, l.text):
		// Another model's tokenizer, at the scale this model's answers
		// taught, for text no denser than they showed.
		return scaled(l.tokens, o.scale.Load()) + usage.OutputOverheadTokens + l.margin
	}
	return usage.OutputTokenBound(l.text)
}

// need is what the lease must hold for the stream so far: its output count
// and the input the upstream reported beyond the estimate.
func (l *lease) need() int64 { return min(l.count, l.limit) + l.inputExcess }

// step is how far ahead of the count a lease is extended.
func (l *lease) step() int64 { return max(l.h.outputLeaseMin/4, l.held/4) }

// admit reports whether the output counted so far may reach the client:
// within the lease, or once an extension covers it (waiting for it if it
// must). An extension starts when the count comes within half a step of
// the lease and takes it a step past the count, so the count grows by half a
// step between extensions: the lease grows geometrically (a step is a
// quarter of it), a few store calls a stream at any event rate, and holds
// at most a third more than the count. Once one is refused the lease is
// tight: it is extended only by what an event needs, when it needs it, so a
// stream near the limit spends the budget to its last tokens. It is false when a tight extension was refused,
// or one failed.
func (l *lease) admit() bool {
	if l.pending != nil {
		select {
		case ext := <-l.pending:
			l.apply(ext)
		default:
		}
	}
	full := l.full()
	if l.held >= full {
		return true // the forwarded cap bounds the rest
	}
	if l.pending == nil && !l.refused && (l.need() > l.held || !l.tight && l.need()+l.step()/2 > l.held) {
		l.extend()
	}
	for l.need() > l.held && l.held < full {
		if l.pending == nil {
			return false
		}
		l.apply(<-l.pending)
		if l.need() > l.held && !l.refused && l.held < full {
			l.extend()
		}
	}
	return true
}

// full is the most the lease needs to hold: the output the forwarded cap
// allows, and the input the upstream reported beyond the estimate.
func (l *lease) full() int64 { return l.limit + max(l.inputExcess, 0) }

func (l *lease) apply(ext extension) {
	l.pending = nil
	switch {
	case ext.granted:
		l.held += ext.more
	case l.h.Shadow || ext.failed && l.h.FailOpen:
		// Shadow mode enforces nothing, and fail_open admits while the store
		// fails: the stream runs on unleased, and settles to what it reports.
		l.held = l.full()
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
	more = min(more, l.full()-l.held)
	spend := budget.Spend{Tokens: more}
	if l.h.hasUSD {
		// At the rates of the reservation: its tier and prompt's.
		spend.CostMicros = l.c.rates.CostMicros(budget.Usage{OutputTokens: more})
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

// holdAll extends the lease to the whole cap, waiting for the answer: for an
// answer whose output cannot be counted as it passes. It reports whether the
// whole cap is held (meteringWriter.holdAllOrRefuse decides what passes).
func (l *lease) holdAll() bool {
	l.count = max(l.count, l.limit)
	return l.admit() && l.held >= l.full()
}

// wait ends the extension in flight, if any, before the settle reads the
// reservation.
func (l *lease) wait() {
	if l.pending != nil {
		l.apply(<-l.pending)
	}
}

// charge is the output a stream that ended without its usage is charged
// at most: what the lease holds, less the input the upstream reported beyond
// the estimate, so that the settle charges what the reservation holds.
func (l *lease) charge() int64 { return max(l.held-l.inputExcess, 0) }
