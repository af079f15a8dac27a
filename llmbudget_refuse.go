package fleetguard

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
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
	"github.com/fleetguard/fleetguard/internal/safego"
)

// refusal is why llmbudget answers a request itself instead of forwarding it
// budgeted. Every phase of ServeHTTP hands its refusals to refuse.
type refusal struct {
	kind refusalKind
	// status, errType (default invalid_request_error), code and message
	// make the error body; a budget denial builds them in refuse.
	status                 int
	errType, code, message string
	allow                  string // the Allow header of a 405
	retryAfter             int64  // seconds; 0: no Retry-After
	noRetry                bool   // x-should-retry: false: waiting does not help
	// body is what was read of the request body, forwarded where the
	// refusal is not enforced; bodyStart: only its start (the rest follows).
	body      []byte
	bodyStart bool
	// denial, for refusedBudget; now, when admit wrote its RateLimit
	// items, which its Retry-After counts from too.
	denial *budget.Denial
	now    time.Time
}

// refusalKind says what is refused, which decides how it is counted and
// whether shadow mode or fail_open forward it instead.
type refusalKind uint8

const (
	// refusedRequest: the request itself (method, path, body), before any
	// budget: requests_total{budget="",decision="rejected"}.
	refusedRequest refusalKind = iota
	// refusedUnpriced: a model without a price under a dollar budget,
	// counted as denied by the first dollar budget.
	refusedUnpriced
	// refusedStoreDown: the budget store failed (503, or forwarded
	// unbudgeted with fail_open).
	refusedStoreDown
	// refusedBudget: a budget does not admit it (429 tokens, 402 dollars).
	refusedBudget
)

// refuse answers ref, or, where it is not enforced, counts it and forwards
// the request unbudgeted: in shadow mode nothing is refused (a budget's
// denial never gets here in shadow mode: reserve admits it over the limit),
// and with fail_open a store failure is forwarded.
func (h *LLMBudget) refuse(w http.ResponseWriter, r *http.Request, repl *caddy.Replacer, next caddyhttp.Handler, c *call, ref *refusal) error {
	if h.enforced(ref) {
		return h.answer(w, repl, c, ref)
	}
	return h.forwardUnbudgeted(w, r, next, ref)
}

// enforced reports whether ref is answered; where it is not (shadow mode, or
// fail_open with the store down) it is counted here and the request goes
// on unbudgeted.
func (h *LLMBudget) enforced(ref *refusal) bool {
	switch {
	case ref.kind == refusedStoreDown && (h.FailOpen || h.Shadow):
		h.countAll(decisionFailOpen)
	case h.Shadow:
		h.shadowRejected.Inc()
		h.logger.Info("shadow: request would be refused", zap.Int("status", ref.status), zap.String("code", ref.code), zap.String("reason", ref.message))
	default:
		return true
	}
	return false
}

// answer counts an enforced refusal and writes it in the API's error shape.
func (h *LLMBudget) answer(w http.ResponseWriter, repl *caddy.Replacer, c *call, ref *refusal) error {
	switch ref.kind {
	case refusedRequest:
		h.rejected.Inc()
	case refusedUnpriced:
		h.decisions[h.firstUSD][decisionDenied].Inc()
	case refusedStoreDown:
		h.countAll(decisionStoreError)
	case refusedBudget:
		h.decisions[h.budgetIndex(ref.denial.Budget)][decisionDenied].Inc()
		h.explainDenial(repl, c, ref)
	}
	hdr := w.Header()
	if ref.allow != "" {
		hdr.Set("Allow", ref.allow)
	}
	if ref.retryAfter > 0 {
		hdr.Set("Retry-After", strconv.FormatInt(ref.retryAfter, 10))
	}
	if ref.noRetry {
		hdr.Set("X-Should-Retry", "false")
	}
	return writeError(w, c.format, ref.status, cmp.Or(ref.errType, "invalid_request_error"), ref.code, ref.message)
}

// forwardUnbudgeted hands the request to the next handler as the client sent
// it.
func (h *LLMBudget) forwardUnbudgeted(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, ref *refusal) error {
	switch {
	case ref.bodyStart:
		forwardRest(r, ref.body)
	case ref.body != nil:
		h.restoreBody(r, ref.body)
	}
	return next.ServeHTTP(w, r)
}

// forwardRest hands the next handler what was read of the body, then the rest
// as it comes: shadow mode forwards a body llmbudget stopped reading.
func forwardRest(r *http.Request, start []byte) {
	r.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(start), r.Body), r.Body}
}

// explainDenial fills in a budget's denial: 429 for a token budget, 402 for
// a dollar budget (admit wrote its RateLimit items), the placeholders, the event, the
// debug line, when to retry, and a message in the budget's unit.
func (h *LLMBudget) explainDenial(repl *caddy.Replacer, c *call, ref *refusal) {
	d := ref.denial
	retry := ceilSeconds(d.WindowEnd.Sub(ref.now))
	ref.status, ref.errType, ref.code = h.denialOf(d.Budget.Unit)
	repl.Set("http.llmbudget.budget", d.Budget.Name)
	h.emitDenied(d, c, false)
	h.noteDeniedKey(d, c.dims)
	h.logger.Debug("request denied by budget",
		zap.String("budget", d.Budget.Name),
		zap.String("scope", d.Budget.Scope.String()),
		zap.String("principal_hash", keyhash.Of(c.dims.Principal).String()),
		zap.String("model", c.dims.Model),
		zapAmount("requested", d.Budget.Unit, d.Amount),
		zapAmount("used", d.Budget.Unit, d.Used),
		zapAmount("limit", d.Budget.Unit, d.Limit))
	amount := func(n int64) string { return formatAmount(d.Budget.Unit, n) }
	window := d.Budget.Period()
	switch {
	case d.Amount > d.Limit:
		// No window will ever admit it: say what to lower, and tell SDKs not
		// to retry (they would sleep Retry-After and fail again).
		ref.code, ref.noRetry = "request_exceeds_budget", true
		ref.message = fmt.Sprintf("this request alone needs up to %s (its prompt plus max_tokens × n), more than the whole limit of budget %q (%s per %s): lower max_tokens or shorten the prompt",
			amount(d.Amount), d.Budget.Name, amount(d.Limit), window)
		if c.holdNote != "" {
			ref.message += " " + c.holdNote
		}
		return
	case d.Used >= d.Limit:
		ref.message = fmt.Sprintf("budget %q (%s, per %s) is exhausted for this window: %s of %s used; it resets at %s",
			d.Budget.Name, d.Budget.Scope, window, amount(d.Used), amount(d.Limit), resetAt(d.WindowEnd))
	default:
		// Headroom remains, but not enough: the request does not fit. It may
		// once requests in flight settle below what they reserved, which
		// is said only when this instance has some (those of other
		// instances are not seen).
		ref.message = fmt.Sprintf("this request needs up to %s and does not fit in budget %q (%s, per %s): %s of %s left in this window (reserved or used: %s)",
			amount(d.Amount), d.Budget.Name, d.Budget.Scope, window, amount(d.Limit-d.Used), amount(d.Limit), amount(d.Used))
		if h.engines.inFlight.n.Load() > 0 {
			ref.message += "; it may fit once requests in flight settle, or when the window resets at " + resetAt(d.WindowEnd)
		} else {
			ref.message += "; the window resets at " + resetAt(d.WindowEnd)
		}
	}
	if c.holdNote != "" {
		ref.message += " " + c.holdNote
	}
	ref.retryAfter = retry
	repl.Set("http.llmbudget.retry_after", retry)
	// SDKs retry a 429 after sleeping Retry-After: with a long window one
	// call would block for hours. They honour x-should-retry.
	ref.noRetry = time.Duration(retry)*time.Second > h.maxRetryAfter
}

// resetAt names when a window ends as a time, in UTC (RFC 3339), which reads
// the same in a log read later; Retry-After carries the seconds.
func resetAt(end time.Time) string { return end.UTC().Format(time.RFC3339) }

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

// budgetIndex is the index of b among the handler's budgets.
func (h *LLMBudget) budgetIndex(b *budget.Budget) int {
	for i := range h.budgets {
		if h.budgets[i].Name == b.Name {
			return i
		}
	}
	return 0
}

// denialOf is the status, error type and code of a denial by a budget of
// unit u. A token budget's is 429 budget_exceeded. A dollar budget's reads
// to each SDK as the provider's own quota error: 429 insufficient_quota in
// OpenAI's shape (its SDK's RateLimitError, as for OpenAI's own exhausted
// quota), Anthropic's rate_limit_error and Gemini's RESOURCE_EXHAUSTED
// alike; or, with usd_denial_status 402, 402 usd_budget_exceeded.
func (h *LLMBudget) denialOf(u budget.Unit) (status int, errType, code string) {
	switch {
	case u != budget.USD:
		return http.StatusTooManyRequests, "budget_exceeded", "token_budget_exceeded"
	case h.USDDenialStatus == http.StatusPaymentRequired:
		return http.StatusPaymentRequired, "budget_exceeded", "usd_budget_exceeded"
	}
	return http.StatusTooManyRequests, "insufficient_quota", "insufficient_quota"
}

// deniedNotes bounds the store calls in flight that note denied keys: past
// it, a denial goes unnoted (keys_denied_total counts a little low) rather
// than pile up calls while the store is slow.
var deniedNotes = make(chan struct{}, 16)

// noteDeniedKey counts, off the request path, a key that a key budget
// denied for the first time in its window, fleet-wide: the store says
// which instance's denial was the first.
func (h *LLMBudget) noteDeniedKey(d *budget.Denial, dims budget.Dims) {
	if d.Budget.Scope != budget.PerKey {
		return
	}
	select {
	case deniedNotes <- struct{}{}:
	default:
		return
	}
	b, id, e := d.Budget, budget.ScopeID(d.Budget, dims), h.engines
	go func() {
		defer func() { <-deniedNotes }()
		defer safego.Recover("llmbudget denied note", e.reportPanic)
		ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
		defer cancel()
		if first, err := e.budgets.NoteDenied(ctx, b, id); err == nil && first {
			metrics.llmKeysDenied.WithLabelValues(b.Name).Inc()
		}
	}()
}

// Errors are written in the shape of the API being called, so that each
// official SDK raises its own error class (RateLimitError for a 429, …) with
// the message, which names the budget:
//
//	OpenAI (and compatible servers, Ollama): {"error":{"type","code","message","param"}}
//	Anthropic: {"type":"error","error":{"type":"rate_limit_error","message"}}
//	Gemini:    {"error":{"code":429,"status":"RESOURCE_EXHAUSTED","message"}}

type openAIError struct {
	Error struct {
		Type    string  `json:"type"`
		Code    string  `json:"code"`
		Message string  `json:"message"`
		Param   *string `json:"param"`
	} `json:"error"`
}

type anthropicError struct {
	Type  string `json:"type"`
	Error struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
}

type geminiError struct {
	Error struct {
		Code    int    `json:"code"`
		Status  string `json:"status"`
		Message string `json:"message"`
	} `json:"error"`
}

// writeError answers status with an error of the format's API. errType and
// code are the OpenAI-style type and code; the message carries the code for
// APIs whose shape has no field for it.
func writeError(w http.ResponseWriter, f usage.Format, status int, errType, code, message string) error {
	var v any
	switch f {
	case usage.Anthropic:
		var e anthropicError
		e.Type, e.Error.Type, e.Error.Message = "error", anthropicType(status), message+" ("+code+")"
		v = e
	case usage.Gemini:
		var e geminiError
		e.Error.Code, e.Error.Status, e.Error.Message = status, geminiStatus(status), message+" ("+code+")"
		v = e
	default:
		var e openAIError
		e.Error.Type, e.Error.Code, e.Error.Message = errType, code, message
		v = e
	}
	body, err := json.Marshal(v)
	if err != nil {
		return err
	}
	body = append(body, '\n')
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, err = w.Write(body)
	return err
}

// anthropicType is the Anthropic error type of a status.
func anthropicType(status int) string {
	switch status {
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case http.StatusPaymentRequired:
		return "billing_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusRequestEntityTooLarge:
		return "request_too_large"
	case http.StatusServiceUnavailable:
		return "overloaded_error"
	}
	if status >= 500 {
		return "api_error"
	}
	return "invalid_request_error"
}

// geminiStatus is the Google API status of an HTTP status.
func geminiStatus(status int) string {
	switch status {
	case http.StatusTooManyRequests, http.StatusPaymentRequired:
		return "RESOURCE_EXHAUSTED"
	case http.StatusNotFound:
		return "NOT_FOUND"
	case http.StatusServiceUnavailable:
		return "UNAVAILABLE"
	}
	if status >= 500 {
		return "INTERNAL"
	}
	return "INVALID_ARGUMENT"
}
