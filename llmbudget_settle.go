package fleetguard

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
)

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
	h.reportCrossings(res)
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

// reportCrossings counts, logs and emits the alert thresholds res's settle
// was the first of the fleet to reach: once per window per scope value per
// threshold, since the store marks each as it is reached.
func (h *LLMBudget) reportCrossings(res *budget.Reservation) {
	for _, c := range res.Crossings() {
		pct := strconv.Itoa(c.Percent)
		metrics.llmThresholds.WithLabelValues(c.Budget.Name, pct).Inc()
		_, hash, _ := strings.Cut(c.ScopeID, "-") // "" for global
		h.logger.Info("budget threshold reached",
			zap.String("budget", c.Budget.Name), zap.String("scope", c.Budget.Scope.String()), zap.String("scope_hash", hash),
			zap.Int("threshold", c.Percent), zap.Int64("used", c.Used), zap.Int64("limit", c.Limit))
		if !h.events.wants(eventLLMBudgetThreshold) {
			continue
		}
		data := map[string]any{
			"budget": c.Budget.Name, "scope": c.Budget.Scope.String(), "threshold": c.Percent,
			"used": c.Used, "limit": c.Limit, "unit": c.Budget.Unit.String(),
			"window_end": c.WindowEnd.UTC().Format(time.RFC3339),
		}
		if hash != "" {
			data["scope_hash"] = hash
		}
		h.events.emit(eventLLMBudgetThreshold, data)
	}
}
