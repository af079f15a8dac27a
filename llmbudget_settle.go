package fleetguard

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
)

// finish decides, once, what the response used and hands the settle to the
// background. It runs deferred, so it also runs when the client goes away,
// the upstream fails or a later handler panics.
func (h *LLMBudget) finish(r *http.Request, res *budget.Reservation, mw *meteringWriter, promptEstimate, outputCap int64, price budget.Price, model string) {
	mw.drain()
	out := mw.outcome(promptEstimate, outputCap, r.Context().Err() != nil)
	spend, err := price.SpendOf(out.usage)
	if err != nil {
		// No request uses that much, or less than nothing: the report is
		// broken or hostile, so the usage is unknown and the reservation
		// stands, as for a response that reports none.
		metrics.llmInvalidUsage.Inc()
		h.logger.Warn("the upstream reported usage out of range; the reservation is kept",
			zap.String("reservation", res.ID), zap.Error(err))
		out, spend = outcome{source: sourceReserved}, budget.Spend{}
	}
	reserved := promptEstimate + outputCap
	// The response reaches the client first: the settle runs after this
	// handler has returned, off the response path.
	h.store.settleLater(func() { h.settle(res, out, spend, reserved, model) })
}

// settle applies the outcome of a response to its reservation, on a context
// of its own (the request's is done, and a reload may have cleaned up the
// config that admitted it). model is the price book's name for the model
// ("" when unpriced).
func (h *LLMBudget) settle(res *budget.Reservation, out outcome, spend budget.Spend, reservedTokens int64, model string) {
	if fault := settleFault.Load(); fault != nil {
		(*fault)()
	}
	ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
	defer cancel()
	var err error
	op := "settle"
	switch {
	case out.source == sourceReleased:
		op = "release"
		err = h.store.budgets.Release(ctx, res)
	case out.source.keepsReservation():
		// No readable usage, or a client that left after the upstream had the
		// request: the upstream bills it, so the reservation stands. Never free.
		err = h.store.budgets.Keep(ctx, res)
	default:
		err = h.store.budgets.Settle(ctx, res, spend)
	}
	if errors.Is(err, budget.ErrReservationLost) {
		// Nothing was applied: the record expired (a response longer than
		// a reservation lives) or the store lost its data (a Redis restarted
		// empty). What the counters hold is what the store kept.
		metrics.llmSettleOutcomes.WithLabelValues("lost").Inc()
		h.logger.Warn("settling a budget reservation found no reservation to apply to; nothing was applied",
			zap.String("reservation", res.ID), zap.Strings("budgets", holdNames(res.Holds)), zap.Stringer("usage_source", out.source))
		return
	}
	if err != nil {
		// The settle's outcome is unknown (it may apply late); it is resolved
		// in the background and counted there, never as charged here.
		metrics.storeErrors.WithLabelValues(op).Inc()
		metrics.llmSettleOutcomes.WithLabelValues("unknown").Inc()
		h.logger.Warn("settling a budget reservation failed; it is retried in the background, and the counters keep the reservation meanwhile",
			zap.String("reservation", res.ID), zap.Strings("budgets", holdNames(res.Holds)), zap.Error(err))
		return
	}
	metrics.llmSettleOutcomes.WithLabelValues("ok").Inc()
	metrics.llmSettles.WithLabelValues(out.source.String()).Inc()
	if out.source == sourceReleased {
		return
	}
	for _, hold := range res.Holds {
		amount := hold.Amount
		if out.source.charged() {
			amount = hold.Budget.Amount(spend)
		}
		metrics.llmCharged.WithLabelValues(hold.Budget.Name, hold.Budget.Unit.String()).Add(float64(amount))
	}
	if out.source.charged() {
		observeUsage(model, out.usage, spend)
		if out.source == sourceReported && reservedTokens > 0 {
			metrics.llmUsageRatio.Observe(float64(out.usage.Tokens()) / float64(reservedTokens))
		}
	}
}

// settleFault, when set, runs at the start of every settle: a test makes a
// settle panic with it, to show that Caddy survives one.
var settleFault atomic.Pointer[func()]

// observeUsage counts the tokens and cost of a settled request.
func observeUsage(model string, u budget.Usage, spend budget.Spend) {
	label := model
	if label == "" {
		label = "other"
	}
	metrics.llmTokens.WithLabelValues(label, "input").Add(float64(u.InputTokens))
	metrics.llmTokens.WithLabelValues(label, "cached_input").Add(float64(u.CachedInputTokens))
	metrics.llmTokens.WithLabelValues(label, "output").Add(float64(u.OutputTokens))
	if model != "" {
		metrics.llmCost.WithLabelValues(model).Add(float64(spend.CostMicros) / budget.MicrosPerUSD)
	}
}

func holdNames(holds []budget.Hold) []string {
	names := make([]string, len(holds))
	for i, h := range holds {
		names[i] = h.Budget.Name
	}
	return names
}
