package fleetguard

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
)

// finish decides, once, what the response used and hands the settle to the
// background. It runs deferred, so it also runs when the client goes away,
// the upstream fails or a later handler panics.
func (h *LLMBudget) finish(r *http.Request, res *budget.Reservation, mw *meteringWriter, c *call) {
	if mw.cancelUpstream != nil {
		mw.cancelUpstream() // the lease's context ends with the request
	}
	mw.drain()
	promptEstimate, outputCap := c.req.PromptTokens, c.outputCap*c.req.N
	if l := mw.lease; l != nil {
		// The extension in flight ends before the settle reads the
		// reservation; what is held bounds an estimate.
		l.wait()
		outputCap = l.charge()
	}
	out := outcomeOf(mw, promptEstimate, outputCap, r.Context().Err() != nil)
	if out.source == sourceEstimated && out.usage.ServiceTier == budget.StandardTier {
		// No tier said: the one reserved for, the worst it asked for.
		out.usage.ServiceTier = c.req.ServiceTier
	}
	if c.history != nil && mw.meter != nil && out.source == sourceReported && !mw.truncated {
		// What the answer showed against what it billed, leased or not
		// (a model on probation holds its cap until it is proven).
		a := answerOf(mw, c, out.usage.OutputTokens)
		if news := c.history.learn(a); news != "" {
			h.logger.Warn(news, zap.String("model", c.req.Model), zap.Int64("reported_output", a.reported),
				zap.Int64("text_bytes", a.text), zap.Int64("tokenizer_count", a.tokens), zap.Bool("proxy", a.proxy))
		}
	}
	spend, err := c.price.SpendOf(out.usage)
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
	dims := c.dims
	h.engines.settleLater(func() { h.settle(res, out, spend, reserved, c.model, dims) })
}

// outcome is how a response ended, for the settle.
type outcome struct {
	source usageSource
	usage  budget.Usage
}

// usageSource is where a settle's usage comes from, the usage_source label.
type usageSource uint8

const (
	// sourceReleased: the upstream answered an error, or could not be
	// reached: nothing to bill, the reservation is released.
	sourceReleased usageSource = iota
	// sourceReserved: a success with no readable usage: the reservation is
	// kept, never free.
	sourceReserved
	// sourceAbandoned: the client went away after the request was
	// forwarded, before a response: the upstream bills it, so the
	// reservation is kept.
	sourceAbandoned
	// sourceReported: the upstream reported the usage.
	sourceReported
	// sourceEstimated: a stream cut before its usage report, charged the
	// prompt and the output seen.
	sourceEstimated
)

// usageSources are every usageSource.
var usageSources = [...]usageSource{sourceReleased, sourceReserved, sourceAbandoned, sourceReported, sourceEstimated}

func (s usageSource) String() string {
	return [...]string{"released", "reserved", "abandoned", "reported", "estimated"}[s]
}

// keepsReservation reports whether the settle charges what was reserved
// (the usage is unknown, and the upstream bills the request).
func (s usageSource) keepsReservation() bool { return s == sourceReserved || s == sourceAbandoned }

// charged reports whether the settle charges usage that was read.
func (s usageSource) charged() bool { return s == sourceReported || s == sourceEstimated }

// statusClientClosed is the status Caddy's reverse_proxy gives a request whose
// client went away before the response.
const statusClientClosed = 499

// outcomeOf decides what the response w metered used: promptEstimate and outputCap are
// the reservation's input estimate and output cap (an estimate never charges
// more output than was reserved); gone says the client went away.
func outcomeOf(w *meteringWriter, promptEstimate, outputCap int64, gone bool) outcome {
	// Nothing reached the client, which went away: 499 is what Caddy's
	// reverse_proxy writes for a client that closed the request.
	if gone && (w.status == 0 || w.status == statusClientClosed) {
		return outcome{source: sourceAbandoned}
	}
	if w.status == 0 || w.status < 200 || w.status >= 300 {
		return outcome{source: sourceReleased}
	}
	if w.meter == nil {
		if w.overflow || w.opaque {
			return outcome{source: sourceReserved}
		}
		if u, ok := usage.FromJSON(w.format, w.capture); ok {
			return outcome{usage: u, source: sourceReported}
		}
		return outcome{source: sourceReserved}
	}
	w.meter.Close()
	r := w.meter.Reading()
	switch {
	case r.Complete:
		return outcome{usage: r.Usage, source: sourceReported}
	case r.Bytes == 0 && gone:
		// The client left before the first byte; the upstream had started.
		return outcome{source: sourceAbandoned}
	case r.Bytes == 0:
		// A stream that ended before any output: nothing was delivered.
		return outcome{source: sourceReleased}
	}
	// The stream ended (or the client left) after output started but before
	// a usage event: charge the prompt plus the output seen so far.
	u := budget.Usage{InputTokens: promptEstimate, ServiceTier: r.Usage.ServiceTier}
	if r.InputKnown {
		u = u.WithInputOf(r.Usage)
	}
	// The strict bound of the text, or the lease's count (the tokenizer's
	// for a tokenized model): the upstream bills no more for it.
	if w.lease != nil {
		u.OutputTokens = max(r.Usage.OutputTokens, w.lease.count, w.lease.bound())
	} else {
		u.OutputTokens = max(r.Usage.OutputTokens, usage.OutputTokenBound(r.OutputTextBytes))
	}
	u.OutputTokens = min(u.OutputTokens, outputCap)
	return outcome{usage: u, source: sourceEstimated}
}

// settle applies the outcome of a response to its reservation, on a context
// of its own (the request's is done, and a reload may have cleaned up the
// config that admitted it). model is the price book's name for the model
// ("" when unpriced); dims, who the request was budgeted for, names the
// scope values of its alerts.
func (h *LLMBudget) settle(res *budget.Reservation, out outcome, spend budget.Spend, reservedTokens int64, model string, dims budget.Dims) {
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
		err = h.engines.budgets.Release(ctx, res)
	case out.source.keepsReservation():
		// No readable usage, or a client that left after the upstream had the
		// request: the upstream bills it, so the reservation stands. Never free.
		err = h.engines.budgets.Keep(ctx, res)
	default:
		err = h.engines.budgets.Settle(ctx, res, spend)
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
	h.reportCrossings(res, &dims)
	if out.source == sourceReleased {
		return
	}
	for _, hold := range res.Holds {
		amount := hold.Amount
		if out.source.charged() {
			amount = hold.Budget.Amount(spend)
		}
		metrics.llmCharged.WithLabelValues(hold.Budget.Name, hold.Budget.Unit.String()).Add(float64(amount))
		if hold.Budget.Unit == budget.USD {
			metrics.llmChargedUSD.WithLabelValues(hold.Budget.Name).Add(dollars(amount))
		}
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
// threshold, since the store marks each as it is reached. A threshold below
// 100% logs at Info, the limit itself at Warn.
func (h *LLMBudget) reportCrossings(res *budget.Reservation, dims *budget.Dims) {
	for _, c := range res.Crossings() {
		metrics.llmThresholds.WithLabelValues(c.Budget.Name, strconv.Itoa(c.Percent)).Inc()
		_, hash, _ := strings.Cut(c.ScopeID, "-") // "" for global
		value := scopeName(&c, dims)
		level := zap.InfoLevel
		if c.Percent >= 100 {
			level = zap.WarnLevel
		}
		if ce := h.logger.Check(level, "budget threshold reached"); ce != nil {
			ce.Write(zap.String("budget", c.Budget.Name), zap.String("scope", c.Budget.Scope.String()),
				zap.String("value", value), zap.String("scope_hash", hash), zap.Int("threshold", c.Percent),
				zapAmount("used", c.Budget.Unit, c.Used), zapAmount("limit", c.Budget.Unit, c.Limit),
				zap.String("window_end", c.WindowEnd.UTC().Format(time.RFC3339)))
		}
		if h.events.wants(eventLLMBudgetThreshold) {
			h.events.emit(eventLLMBudgetThreshold, thresholdData(&c, hash, value))
		}
	}
}

// scopeName is the name of a crossing's scope value, where it is one: the
// config's name for it (limit_for, a priced model), else the team or model
// the request was budgeted for. A key's value is a credential: it has none
// ("", as a global budget's).
func scopeName(c *budget.Crossing, dims *budget.Dims) string {
	if name, ok := c.Budget.Names[c.ScopeID]; ok {
		return name
	}
	switch c.Budget.Scope {
	case budget.PerTeam, budget.PerModel:
		return dims.Value(c.Budget.Scope)
	}
	return ""
}

// thresholdData is the data of an llmbudget_threshold event.
func thresholdData(c *budget.Crossing, hash, value string) map[string]any {
	data := map[string]any{
		"budget": c.Budget.Name, "scope": c.Budget.Scope.String(), "threshold": c.Percent,
		"used": unitAmount(c.Budget.Unit, c.Used), "limit": unitAmount(c.Budget.Unit, c.Limit), "unit": c.Budget.Unit.String(),
		"window_end": c.WindowEnd.UTC().Format(time.RFC3339),
	}
	if hash != "" {
		data["scope_hash"] = hash
	}
	if value != "" {
		data["value"] = value
	}
	return data
}
