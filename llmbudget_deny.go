package fleetguard

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// refuse answers a request llmbudget cannot budget (not forwarded). In shadow
// mode it is counted and logged, and forwarded: nothing is refused.
func (h *LLMBudget) refuse(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, format usage.Format, status int, errType, code, message string) error {
	if h.Shadow {
		h.shadowRejected.Inc()
		h.logger.Info("shadow: request would be refused", zap.Int("status", status), zap.String("code", code), zap.String("reason", message))
		return next.ServeHTTP(w, r)
	}
	h.rejected.Inc()
	return h.reject(w, format, status, errType, code, message)
}

// shadowDenied counts, logs and announces a denial that shadow mode does not
// enforce.
func (h *LLMBudget) shadowDenied(r *http.Request, d *budget.Denial, dims budget.Dims) {
	h.decisions[h.budgetIndex(d.Budget)][shadowDenied].Inc()
	h.logger.Info("shadow: request would be denied by budget",
		zap.String("budget", d.Budget.Name),
		zap.String("scope", d.Budget.Scope.String()),
		zap.Int64("requested", d.Amount),
		zap.Int64("used", d.Used),
		zap.Int64("limit", d.Budget.Limit))
	h.emitDenied(r, d, dims, true)
}

// deny answers 429 for a token budget and 402 for a dollar budget.
func (h *LLMBudget) deny(w http.ResponseWriter, r *http.Request, format usage.Format, repl *caddy.Replacer, d *budget.Denial, dims budget.Dims) error {
	now := time.Now()
	retry := ceilSeconds(d.WindowEnd.Sub(now))
	status, code := http.StatusTooManyRequests, "token_budget_exceeded"
	if d.Budget.Unit == budget.USD {
		status, code = http.StatusPaymentRequired, "usd_budget_exceeded"
	}
	amount := func(n int64) string { return formatAmount(d.Budget.Unit, n) }
	hdr := w.Header()
	h.setRateLimitHeaders(hdr, d.Holds, now)
	repl.Set("http.llmbudget.budget", d.Budget.Name)
	h.emitDenied(r, d, dims, false)
	h.logger.Debug("request denied by budget",
		zap.String("budget", d.Budget.Name),
		zap.String("scope", d.Budget.Scope.String()),
		zap.String("principal_hash", keyhash.Of(dims.Principal).String()),
		zap.String("model", dims.Model),
		zap.Int64("requested", d.Amount),
		zap.Int64("used", d.Used),
		zap.Int64("limit", d.Budget.Limit))
	if d.Amount > d.Budget.Limit {
		// No window will ever admit it: say what to lower, and tell SDKs not
		// to retry (they would sleep Retry-After and fail again).
		hdr.Set("X-Should-Retry", "false")
		return h.reject(w, format, status, "budget_exceeded", "request_exceeds_budget", fmt.Sprintf(
			"this request alone needs up to %s (its prompt plus max_tokens × n), more than the whole limit of budget %q (%s per %s): lower max_tokens or shorten the prompt",
			amount(d.Amount), d.Budget.Name, amount(d.Budget.Limit), time.Duration(d.Budget.Window)))
	}
	hdr.Set("Retry-After", strconv.FormatInt(retry, 10))
	repl.Set("http.llmbudget.retry_after", retry)
	if time.Duration(retry)*time.Second > h.maxRetryAfter {
		// SDKs retry a 429 after sleeping Retry-After: with a long window one
		// call would block for hours. They honour x-should-retry.
		hdr.Set("X-Should-Retry", "false")
	}
	if d.Used >= d.Budget.Limit {
		return h.reject(w, format, status, "budget_exceeded", code, fmt.Sprintf(
			"budget %q (%s, per %s) is exhausted for this window: %s of %s used; it resets in %ds",
			d.Budget.Name, d.Budget.Scope, time.Duration(d.Budget.Window), amount(d.Used), amount(d.Budget.Limit), retry))
	}
	// Headroom remains, but not enough: the request does not fit. It may
	// once requests in flight settle below what they reserved.
	return h.reject(w, format, status, "budget_exceeded", code, fmt.Sprintf(
		"this request needs up to %s and does not fit in budget %q (%s, per %s): %s of %s left in this window (reserved or used: %s); it may fit once requests in flight settle, or when the window resets in %ds",
		amount(d.Amount), d.Budget.Name, d.Budget.Scope, time.Duration(d.Budget.Window), amount(d.Budget.Limit-d.Used), amount(d.Budget.Limit), amount(d.Used), retry))
}

// formatAmount writes n in the budget's unit, as its users count it: tokens,
// or dollars (a USD budget counts micro-dollars) with at least two decimals
// and no rounding, so a denial never reads as if it fit.
func formatAmount(u budget.Unit, n int64) string {
	if u != budget.USD {
		return strconv.FormatInt(n, 10) + " tokens"
	}
	sign := ""
	if n < 0 {
		sign, n = "-", -n
	}
	fraction := strings.TrimRight(fmt.Sprintf("%06d", n%budget.MicrosPerUSD), "0")
	for len(fraction) < 2 {
		fraction += "0"
	}
	return sign + "$" + strconv.FormatInt(n/budget.MicrosPerUSD, 10) + "." + fraction
}

// emitDenied emits llmbudget_denied for d.
func (h *LLMBudget) emitDenied(r *http.Request, d *budget.Denial, dims budget.Dims, shadow bool) {
	if !h.events.wants(eventLLMBudgetDenied) {
		return
	}
	h.events.emit(eventLLMBudgetDenied, map[string]any{
		"budget":     d.Budget.Name,
		"scope":      d.Budget.Scope.String(),
		"scope_hash": keyhash.Of(dims.Value(d.Budget.Scope)).String(),
		"unit":       d.Budget.Unit.String(),
		"requested":  d.Amount,
		"used":       d.Used,
		"limit":      d.Budget.Limit,
		"shadow":     shadow,
		"path":       r.URL.Path,
	})
}

// setRateLimitHeaders writes RateLimit-Policy and RateLimit with one item per
// budget.
func (h *LLMBudget) setRateLimitHeaders(hdr http.Header, holds []budget.Hold, now time.Time) {
	buf := make([]byte, 0, 48*len(holds))
	for _, hold := range holds {
		buf = appendRateLimitItem(buf, hold.Budget.Name, hold.Budget.Limit-hold.Used, hold.WindowEnd.Sub(now))
	}
	setRateLimitHeaders(hdr, h.policy, string(buf))
}
