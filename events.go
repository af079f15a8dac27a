package fleetguard

import (
	"fmt"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// Events the handlers emit through Caddy's events app, so an `events`
// handler can react to a denial. Their data names the zone or budget and a
// hash of the key, never the key.
const (
	// eventFleetlimitExceeded: a request a zone denied (or would have, with
	// dry_run). Data: zone, key_hash, fleet (the window, not the local burst
	// cap, denied), retry_after (seconds), dry_run.
	eventFleetlimitExceeded = "fleetlimit_exceeded"
	// eventLLMBudgetDenied: a request a budget denied (or would have, with
	// shadow). Data: budget, scope, scope_hash, unit, requested, used, limit
	// (in the budget's unit: tokens, or dollars as a float for usd), shadow,
	// path.
	eventLLMBudgetDenied = "llmbudget_denied"
	// eventLLMBudgetTruncated: a stream ended at its output lease because
	// an extension was refused (or the store did not answer). Data: budget
	// (the one that refused, "" when the store failed), reservation,
	// held_output (the output tokens the stream was held to), model.
	eventLLMBudgetTruncated = "llmbudget_truncated"
	// eventLLMBudgetThreshold: a scope value of a budget reached a
	// threshold of its alert_at, emitted once per window for the whole
	// fleet (by the instance whose settle reached it first). Data: budget,
	// scope, value (the team or model by name: its limit_for or price
	// entry's, else as the request named it; absent for a key, whose value
	// is a credential, and for a global budget), scope_hash (absent for a
	// global budget), threshold (percent of the limit), used and limit (in
	// the budget's unit: tokens, or dollars as a float for usd), unit,
	// window_end (RFC 3339). The same is logged, at Info below 100% and at
	// Warn at 100%.
	eventLLMBudgetThreshold = "llmbudget_threshold"
)

// emitter emits a handler's events on its config's events app.
type emitter struct {
	ctx    caddy.Context
	events *caddyevents.App
}

func newEmitter(ctx caddy.Context) (emitter, error) {
	app, err := ctx.App("events")
	if err != nil {
		return emitter{}, fmt.Errorf("loading the events app: %w", err)
	}
	return emitter{ctx: ctx, events: app.(*caddyevents.App)}, nil
}

// wants reports whether anything observes name, so callers build no event
// data that nothing reads.
func (e emitter) wants(name string) bool { return e.events != nil && e.events.ShouldEmit(name) }

func (e emitter) emit(name string, data map[string]any) {
	e.events.Emit(e.ctx, name, data)
}

// emitDenied emits llmbudget_denied for d.
func (h *LLMBudget) emitDenied(d *budget.Denial, c *call, shadow bool) {
	if !h.events.wants(eventLLMBudgetDenied) {
		return
	}
	h.events.emit(eventLLMBudgetDenied, map[string]any{
		"budget":     d.Budget.Name,
		"scope":      d.Budget.Scope.String(),
		"scope_hash": keyhash.Of(c.dims.Value(d.Budget.Scope)).String(),
		"unit":       d.Budget.Unit.String(),
		"requested":  unitAmount(d.Budget.Unit, d.Amount),
		"used":       unitAmount(d.Budget.Unit, d.Used),
		"limit":      unitAmount(d.Budget.Unit, d.Limit),
		"shadow":     shadow,
		"path":       c.path,
	})
}

// unitAmount is an amount of a budget's counter as its events and logs
// carry it, in the budget's unit: tokens as an integer, a usd budget's
// micro-dollars as dollars (a float64).
func unitAmount(u budget.Unit, n int64) any {
	if u == budget.USD {
		return dollars(n)
	}
	return n
}

// zapAmount is unitAmount as a log field.
func zapAmount(key string, u budget.Unit, n int64) zap.Field {
	if u == budget.USD {
		return zap.Float64(key+"_usd", dollars(n))
	}
	return zap.Int64(key, n)
}
