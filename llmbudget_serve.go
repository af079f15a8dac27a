package fleetguard

import (
	"bytes"
	"cmp"
	"context"
	"errors"
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
	"github.com/fleetguard/fleetguard/budget/bpe"
	"github.com/fleetguard/fleetguard/budget/usage"
)

// ServeHTTP budgets a request in phases, found in this file in call order:
// screen, then gate (readBody, identify, estimate, chooseLease,
// priceEstimate, reserve, admit), then the forward with the
// response metered (llmbudget_meter.go, with a lease: llmbudget_lease.go)
// and the settle after it (llmbudget_settle.go). A refusal from any phase
// goes to refuse (llmbudget_refuse.go), which applies shadow mode,
// fail_open, metrics, events and the API's error shape.
func (h *LLMBudget) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	var c call
	budgeted, ref := h.screen(r, &c)
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	var res *budget.Reservation
	if budgeted && c.socket == notSocket {
		res, ref = h.gate(w, r, repl, &c)
	}
	switch {
	case ref != nil:
		return h.refuse(w, r, repl, next, &c, ref)
	case c.socket != notSocket:
		return h.serveSocket(w, r, repl, next, &c)
	case res == nil:
		return next.ServeHTTP(w, r) // not an LLM call: a read, or an unknown path passed
	}
	mw, upstream := newMeteringWriter(w, r, h, res, &c)
	defer h.finish(r, res, mw, &c)
	if mw.lease != nil {
		defer endTruncated(mw)
	}
	err := next.ServeHTTP(mw, upstream)
	if mw.truncated {
		return nil // the client has a finished answer; the upstream's cancel is ours
	}
	return err
}

// call is a request as the budget sees it, filled in by the phases of gate.
type call struct {
	path string // as the client sent it, for the llmbudget_denied event
	req  usage.Request
	// body is the request body as the client sent it; forward, as it is
	// forwarded (its output bounded, its stream asked for usage).
	body, forward []byte
	outputCap     int64 // per output (choice, candidate)
	// leaseSize is the output a leased stream holds first (0: the whole
	// cap is held, no lease); history, its model's recent answers.
	leaseSize int64
	history   *outputHistory
	// tokens is the model's public tokenizer, once loaded, while its
	// answers have not billed more than it counts.
	tokens *bpe.Counter
	dims   budget.Dims
	spend  budget.Spend
	model  string // the price book's name of the model ("" unpriced)
	price  budget.Price
	// rates are the price's rates for the estimate: the long-context tier's
	// when the prompt estimate is above its threshold, the service tier's
	// the body asks for. A lease's extensions are charged at them.
	rates budget.Rates
	// holdNote explains a hold larger than the body shows, for a denial.
	holdNote string
	// wholeCap, when not empty, says why the request holds its whole
	// output cap, never a lease: it asks for output the meter does not
	// count, or has a field of no known class (llmbudget_unknown.go).
	wholeCap string
	// The one-byte fields, together (the call is allocated per request).
	format usage.Format
	// sse: a Gemini request asked for SSE (alt=sse), which the meter reads
	// as it passes.
	sse bool
	// injectedUsage: llmbudget asked the stream for its usage
	// (include_usage), which the client did not.
	injectedUsage bool
	// learned: leaseSize was learned from the model's answers.
	learned bool
	// proxy: tokens is another model's tokenizer, which counts at a scale
	// the model's answers taught.
	proxy bool
	// socket: the request opens a WebSocket session whose messages are
	// budgeted one response at a time (llmbudget_socket.go).
	socket socketKind
}

// gate runs the phases of a budgeted request before its forward: readBody,
// identify (with requireScopes), estimate, chooseLease, priceEstimate, reserve and admit. It returns the reservation of an
// admitted request, or the refusal of a phase.
func (h *LLMBudget) gate(w http.ResponseWriter, r *http.Request, repl *caddy.Replacer, c *call) (*budget.Reservation, *refusal) {
	body, err := h.readBody(r)
	if ref := bodyRefusal(body, err, h.maxRequestBody); ref != nil {
		return nil, ref
	}
	c.body = body
	h.identify(r, repl, c)
	if ref := h.requireScopes(c); ref != nil {
		return nil, ref
	}
	if ref := h.estimate(c); ref != nil {
		return nil, ref
	}
	h.chooseLease(c)
	if ref := h.priceEstimate(c); ref != nil {
		return nil, ref
	}
	res, ref := h.reserve(r, c)
	h.admit(w, r, res, c, ref)
	return res, ref
}

// screen decides from the method and path alone: budgeted (go on), passed
// unbudgeted (a read, or an unknown path with unknown_paths pass), or
// refused. Methods are compared without regard to case: some upstream
// frameworks upper-case the method and serve a "post" like a POST.
func (h *LLMBudget) screen(r *http.Request, c *call) (budgeted bool, ref *refusal) {
	c.path, c.format = r.URL.Path, h.format
	if isUpgrade(r) {
		return h.screenUpgrade(r, c)
	}
	if c.format == usage.Unknown {
		c.format = usage.FormatFromPath(r.URL.Path)
	}
	if !strings.EqualFold(r.Method, http.MethodPost) {
		if isRead(r.Method) {
			return false, nil // not an LLM call: reads are free
		}
		if c.format == usage.Unknown {
			return h.screenUnknownPath(r)
		}
		return false, &refusal{kind: refusedRequest, status: http.StatusMethodNotAllowed, code: "method_not_allowed",
			allow: "GET, HEAD, OPTIONS, POST",
			message: fmt.Sprintf("llmbudget budgets %s with POST and passes reads (GET, HEAD, OPTIONS); it does not forward %s",
				usage.NormalizePath(r.URL.Path), r.Method)}
	}
	if c.format == usage.Unknown {
		return h.screenUnknownPath(r)
	}
	return true, nil
}

// screenUnknownPath passes or refuses, by UnknownPaths, a request that is not
// a read to a path llmbudget does not budget: a PUT or PATCH may make an
// upstream generate as well as a POST.
func (h *LLMBudget) screenUnknownPath(r *http.Request) (budgeted bool, ref *refusal) {
	if h.UnknownPaths == "pass" {
		return false, nil
	}
	return false, &refusal{kind: refusedRequest, status: http.StatusNotFound, code: "unbudgeted_path",
		message: fmt.Sprintf("llmbudget does not know how to budget %s %s, so it does not forward it (set unknown_paths pass to forward such requests unbudgeted)",
			strings.ToUpper(r.Method), usage.NormalizePath(r.URL.Path))}
}

// isRead reports whether method is one that reads (GET, HEAD, OPTIONS, in any
// case): such requests to an API's paths (listing stored completions, say)
// are not billed as generation.
func isRead(method string) bool {
	return strings.EqualFold(method, http.MethodGet) || strings.EqualFold(method, http.MethodHead) || strings.EqualFold(method, http.MethodOptions)
}

var errBodyTooLarge = errors.New("request body too large")

// readBody reads at most MaxRequestBody bytes. Past that it returns
// errBodyTooLarge with what it read; a failed read returns what it read too
// (the start of the body: shadow mode forwards it, then the rest).
func (h *LLMBudget) readBody(r *http.Request) ([]byte, error) {
	if r.ContentLength > h.maxRequestBody {
		return nil, errBodyTooLarge
	}
	if r.Body == nil {
		return nil, nil
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, h.maxRequestBody+1))
	if err != nil {
		return body, err
	}
	if int64(len(body)) > h.maxRequestBody {
		return body, errBodyTooLarge
	}
	return body, nil
}

// bodyRefusal is the refusal of a body readBody could not read whole.
func bodyRefusal(body []byte, err error, limit int64) *refusal {
	switch {
	case errors.Is(err, errBodyTooLarge):
		return &refusal{kind: refusedRequest, status: http.StatusRequestEntityTooLarge, code: "request_too_large",
			message: fmt.Sprintf("request body exceeds %d bytes", limit), body: body, bodyStart: true}
	case err != nil:
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "unreadable_body",
			message: "reading the request body failed: " + err.Error(), body: body, bodyStart: true}
	}
	return nil
}

// identify names who the request is budgeted for (its principal and team)
// and reads the one query parameter the lease choice needs.
func (h *LLMBudget) identify(r *http.Request, repl *caddy.Replacer, c *call) {
	if h.Principal != "" {
		c.dims.Principal = repl.ReplaceAll(h.Principal, "")
	} else {
		c.dims.Principal = apiCredential(r, c.format)
	}
	if h.Team != "" {
		c.dims.Team = repl.ReplaceAll(h.Team, "")
	}
	if c.format == usage.Gemini && r.URL.RawQuery != "" {
		// Streamed as SSE only with alt=sse; else a JSON array the meter
		// does not read as it passes.
		c.sse = strings.EqualFold(r.URL.Query().Get("alt"), "sse")
	}
}

// apiCredential is the credential the API being called authenticates with,
// the default principal of `key` budgets: Anthropic's x-api-key, Gemini's
// x-goog-api-key or key query parameter, else the Authorization header (which
// Anthropic and Gemini clients may send instead). It is hashed before use.
func apiCredential(r *http.Request, f usage.Format) string {
	switch f {
	case usage.Anthropic:
		if k := r.Header.Get("X-Api-Key"); k != "" {
			return "x-api-key " + k
		}
	case usage.Gemini:
		if k := r.Header.Get("X-Goog-Api-Key"); k != "" {
			return "x-goog-api-key " + k
		}
		if k := r.URL.Query().Get("key"); k != "" {
			return "x-goog-api-key " + k
		}
	}
	return r.Header.Get("Authorization")
}

// requireScopes refuses a request that names no value for a scope one of
// its budgets is kept per (a team budget's request without its team): it
// would otherwise be budgeted as the empty value, a budget no team owns.
func (h *LLMBudget) requireScopes(c *call) *refusal {
	for _, rs := range h.required {
		if c.dims.Value(rs.scope) != "" {
			continue
		}
		code, what, from := "missing_team", "team", h.Team
		if rs.scope == budget.PerKey {
			code, what, from = "missing_principal", "principal", cmp.Or(h.Principal, "its API credential")
		}
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: code, noRetry: true, body: c.body,
			message: fmt.Sprintf("budget %q is kept per %s, and this request names no %s (%s is empty): it is refused rather than charged to no one's budget",
				rs.budget, rs.scope, what, from)}
	}
	return nil
}

// estimate reads the body as the upstream will and bounds what it can
// bill: its output cap and forwarded body (boundOutput), and its hidden
// input (boundInput).
func (h *LLMBudget) estimate(c *call) *refusal {
	if ref := h.parse(c); ref != nil {
		return ref
	}
	return h.bound(c)
}

// parse reads the body as the upstream will.
func (h *LLMBudget) parse(c *call) *refusal {
	var err error
	if c.req, err = usage.ParseRequest(c.format, c.path, c.body); err != nil {
		code := "invalid_request"
		if errors.Is(err, usage.ErrAmbiguous) {
			code = "ambiguous_request"
		}
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: code, message: err.Error(), body: c.body}
	}
	if model, ok := h.deployments[c.req.Model]; ok && c.req.Deployment {
		c.req.Model = model
	}
	c.dims.Model = c.req.Model
	return nil
}

// bound bounds what the parsed request can bill: its output cap and
// forwarded body, what it asks that the budget cannot meter, and its hidden
// input.
func (h *LLMBudget) bound(c *call) *refusal {
	if ref := h.boundOutput(c); ref != nil {
		return ref
	}
	if ref := h.boundUnknown(c); ref != nil {
		return ref
	}
	return h.boundInput(c)
}

// boundOutput decides the cap per output c is held to and the body it is
// forwarded with (its output bounded, its stream asked for usage). What is
// held bounds what the upstream may write: a request is forwarded with the
// output cap it reserved, in its API's own field, whether it named one or
// not (README, "The cap is forwarded").
func (h *LLMBudget) boundOutput(c *call) *refusal {
	var err error
	if c.outputCap, err = h.outputCap(c.req); err != nil {
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "output_cap_too_large", message: err.Error(), body: c.body}
	}
	if c.forward, c.injectedUsage, err = h.forwardBody(c.format, c.req, c.body, c.outputCap); err != nil {
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "invalid_request", message: err.Error(), body: c.body}
	}
	return nil
}

// outputCap is the cap per output a request is held to and forwarded with:
// its own, or DefaultMaxTokens when it names none, and at most
// MaxOutputTokens. A larger cap of its own is an errOutputCapTooLarge when
// OverMaxOutputTokens is "refuse".
func (h *LLMBudget) outputCap(req usage.Request) (int64, error) {
	if req.NoOutput {
		return 0, nil
	}
	limit := int64(usage.MaxOutputCap)
	if h.MaxOutputTokens > 0 {
		limit = h.MaxOutputTokens
	}
	if req.MaxOutputTokens == 0 {
		return min(h.defaultMaxTokens, limit), nil
	}
	if req.MaxOutputTokens > limit && h.OverMaxOutputTokens == overMaxOutputRefuse {
		return 0, errOutputCapTooLarge{req.MaxOutputTokensField, req.MaxOutputTokens, limit}
	}
	return min(req.MaxOutputTokens, limit), nil
}

// errOutputCapTooLarge is a request whose own output cap is over
// MaxOutputTokens, with OverMaxOutputTokens "refuse".
type errOutputCapTooLarge struct {
	field      string
	cap, limit int64
}

func (e errOutputCapTooLarge) Error() string {
	return fmt.Sprintf("%s is %d, more than the largest output cap this gateway forwards (%d): lower it", e.field, e.cap, e.limit)
}

// forwardBody is body as it is forwarded: an OpenAI stream that does not ask
// for its usage is made to (askedUsage: the client does not see the usage
// chunk it did not ask for), and the output is bounded to outputCap in the
// API's own field. Shadow mode enforces nothing, so it leaves the cap as the
// client wrote it.
func (h *LLMBudget) forwardBody(format usage.Format, req usage.Request, body []byte, outputCap int64) (forward []byte, injectedUsage bool, err error) {
	rw := usage.Rewrites{
		IncludeUsage: (format == usage.OpenAIChat || format == usage.OpenAICompletions) && req.Stream && !req.IncludeUsage && h.injectStreamUsage(),
		ChatCapField: h.chatCapField,
	}
	if !h.Shadow {
		rw.OutputCap = outputCap
	}
	forward, err = usage.Rewrite(format, body, rw)
	return forward, rw.IncludeUsage, err
}

func (h *LLMBudget) injectStreamUsage() bool {
	return h.InjectStreamUsage == nil || *h.InjectStreamUsage
}

// boundInput makes the prompt estimate of a request with hidden input the
// context window, or refuses the request (hidden_input refuse).
func (h *LLMBudget) boundInput(c *call) *refusal {
	why := c.req.HiddenInput
	if why == "" {
		return nil
	}
	if h.HiddenInput == hiddenInputRefuse {
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "hidden_input", body: c.body, noRetry: true,
			message: fmt.Sprintf("this request makes the upstream bill input it does not show (%s), which a budget cannot bound; send the input itself", why)}
	}
	c.req.PromptTokens = max(c.req.PromptTokens, h.contextWindow)
	c.holdNote = fmt.Sprintf("(the request names input it does not show, %s, so its prompt is held at context_window, %d tokens)", why, h.contextWindow)
	return nil
}

// chooseLease decides whether the stream leases (leasable), which counter
// counts it, and how much it holds: only a model proven to bill no output
// its text does not show leases (outputHistory).
func (h *LLMBudget) chooseLease(c *call) {
	if !h.leasable(c) {
		return
	}
	c.history = h.engines.histories.of(c.req.Model)
	h.engines.loadLearned(c.history, c.req.Model, h.storeTimeout)
	if v, proxy := h.tokenizerOf(c.req.Model); v != 0 && !c.history.tokensRevoked.Load() {
		c.tokens, c.proxy = bpe.Loaded(v), proxy
	}
	if c.history.leases() {
		// Learned from the answers' counts as this stream will be counted:
		// by the tokenizer, or a token a byte.
		learned := c.history.leaseSize.Load()
		if c.tokens != nil && c.history.countsTokens() {
			learned = c.history.tokensLeaseSize.Load()
		}
		c.leaseSize = min(max(learned, h.outputLeaseMin), c.outputCap)
		c.learned = learned > 0
	}
}

// leasable reports whether the output of c can be leased: a single streamed
// answer whose every token the meter sees.
func (h *LLMBudget) leasable(c *call) bool {
	if !h.outputLeases || !c.req.Stream || c.req.N != 1 || c.req.NoOutput || c.req.Reasoning || c.wholeCap != "" || c.outputCap <= h.outputLeaseMin {
		return false
	}
	switch c.format {
	case usage.Gemini:
		return c.sse && !h.isReasoningModel(c.req.Model)
	case usage.OpenAIChat, usage.OpenAICompletions, usage.OpenAIResponses, usage.Anthropic, usage.Ollama:
		return !h.isReasoningModel(c.req.Model)
	}
	return false
}

func (h *LLMBudget) isReasoningModel(model string) bool {
	model = strings.ToLower(model)
	base := model[strings.LastIndexByte(model, '/')+1:]
	for _, p := range h.reasoningModels {
		if globMatch(p, model) || globMatch(p, base) {
			return true
		}
	}
	return false
}

// globMatch matches s against pattern, where * matches any run of
// characters (including none) and everything else matches itself.
func globMatch(pattern, s string) bool {
	parts := strings.Split(pattern, "*")
	if len(parts) == 1 {
		return pattern == s
	}
	if !strings.HasPrefix(s, parts[0]) {
		return false
	}
	s = s[len(parts[0]):]
	for _, part := range parts[1 : len(parts)-1] {
		i := strings.Index(s, part)
		if i < 0 {
			return false
		}
		s = s[i+len(part):]
	}
	return strings.HasSuffix(s, parts[len(parts)-1])
}

// tokenizerOf is the vocabulary model is counted by (0: none), and whether
// it is a proxy's.
func (h *LLMBudget) tokenizerOf(model string) (v bpe.Vocabulary, proxy bool) {
	if len(h.tokenizers) == 0 && len(h.proxyTokenizers) == 0 {
		return 0, false
	}
	model = strings.ToLower(model)
	base := model[strings.LastIndexByte(model, '/')+1:]
	if v := matchTokenizer(h.tokenizers, model, base); v != 0 {
		return v, false
	}
	v = matchTokenizer(h.proxyTokenizers, model, base)
	return v, v != 0
}

// matchTokenizer is the vocabulary of table whose pattern matches the model
// (lowercased) or its base name, or 0.
func matchTokenizer(table []tokenizerPatterns, model, base string) bpe.Vocabulary {
	for _, tp := range table {
		for _, p := range tp.patterns {
			if globMatch(p, model) || globMatch(p, base) {
				return tp.vocab
			}
		}
	}
	return 0
}

// priceEstimate prices the worst the request can reach: its prompt, and its
// lease or its whole cap, at the tier it asks for and the long-context tier
// when its prompt estimate is above the threshold. A dollar budget refuses
// a model without a price.
func (h *LLMBudget) priceEstimate(c *call) *refusal {
	output := c.outputCap * c.req.N
	if c.leaseSize > 0 {
		output = c.leaseSize
	}
	estimate := budget.Usage{InputTokens: c.req.PromptTokens, OutputTokens: output, ServiceTier: c.req.ServiceTier}
	c.spend = budget.Spend{Tokens: estimate.Tokens()}
	var priced bool
	c.model, c.price, priced = h.prices.Find(h.priceName(c))
	if !h.hasUSD {
		return nil
	}
	if !priced {
		return &refusal{kind: refusedUnpriced, status: http.StatusPaymentRequired, errType: "budget_exceeded", code: "model_not_priced",
			noRetry: true, body: c.body, // waiting never prices it
			message: fmt.Sprintf("model %q has no price in the price book, so a dollar budget cannot admit it", c.req.Model)}
	}
	c.rates = c.price.RatesFor(estimate)
	c.spend.CostMicros = c.price.CostMicros(estimate)
	return nil
}

// priceName is the name c's model is priced by: provider-qualified, so that
// the provider's own price comes first ("azure/gpt-4o", "groq/llama-3.3-70b-
// versatile" in a prices_file); the price book resolves it past the prefix
// to the bare name when the table has no such entry (and a price line of
// the bare name wins over the file).
func (h *LLMBudget) priceName(c *call) string {
	provider := h.Provider
	switch {
	case c.req.Deployment:
		provider = "azure"
	case provider != "":
	case c.format == usage.Gemini:
		provider = "gemini"
	case c.format == usage.Anthropic:
		provider = "anthropic"
	case c.format == usage.Ollama:
		provider = "ollama"
	}
	if provider == "" || strings.HasPrefix(c.req.Model, provider+"/") {
		return c.req.Model
	}
	return provider + "/" + c.req.Model
}

// reserve charges the estimate to every budget at once. In shadow mode a
// denial is counted and the request reserved over the limit all the same:
// the numbers a real limit would have seen.
func (h *LLMBudget) reserve(r *http.Request, c *call) (*budget.Reservation, *refusal) {
	ctx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
	defer cancel()
	res, denial, err := h.engines.budgets.Reserve(ctx, h.budgets, c.dims, c.spend)
	if denial != nil {
		res, denial, err = h.waitForRoom(r, c, denial)
	}
	if denial != nil && h.Shadow {
		h.shadowDenied(denial, c)
		res, err = h.engines.budgets.ReserveOverLimit(ctx, h.budgets, c.dims, c.spend)
		denial = nil
	}
	if err != nil {
		if !errors.Is(err, budget.ErrStoreDown) {
			metrics.storeErrors.WithLabelValues("reserve").Inc()
		}
		h.engines.budgetStoreFailed(h.logger, h.FailOpen || h.Shadow, err)
		return nil, &refusal{kind: refusedStoreDown, status: http.StatusServiceUnavailable, errType: "service_unavailable",
			code: "budget_store_unavailable", message: "the budget store is unavailable; try again shortly", retryAfter: 1, body: c.body}
	}
	h.engines.budgetStoreOK(h.logger)
	if denial != nil {
		return nil, &refusal{kind: refusedBudget, denial: denial}
	}
	h.engines.inFlight.reserved()
	return res, nil
}

// A request refused because streams in flight hold the room, not because it
// was spent, fits once they settle: a stream holds up to its text's strict
// bound (a token a byte, about 4 times what English costs) until then. So a
// refusal of a request that fits the budget's limit waits, up to
// SettleWait, for the settles of this instance's requests in flight and
// tries again after each (and every settleRetryTick, for other instances').
//
// waitForRoom retries a denied reserve after settles until it is admitted,
// a settle here can no longer lift the denial (the request is larger than
// the limit, or nothing is in flight on this instance), the store fails, or
// SettleWait passes. It returns the last outcome. (Requests in flight on
// other instances are not seen: without any here, a refusal is answered at
// once.)
func (h *LLMBudget) waitForRoom(r *http.Request, c *call, denial *budget.Denial) (*budget.Reservation, *budget.Denial, error) {
	if h.settleWait <= 0 || h.Shadow || denial.Amount > denial.Limit || h.engines.inFlight.n.Load() == 0 {
		return nil, denial, nil
	}
	deadline := time.NewTimer(h.settleWait)
	defer deadline.Stop()
	tick := time.NewTicker(settleRetryTick)
	defer tick.Stop()
	metrics.llmSettleWaits.Inc()
	for {
		select {
		case <-h.engines.inFlight.next():
		case <-tick.C:
		case <-deadline.C:
			return nil, denial, nil
		case <-r.Context().Done():
			return nil, denial, nil
		}
		h.relearn(c)
		ctx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
		res, d, err := h.engines.budgets.Reserve(ctx, h.budgets, c.dims, c.spend)
		cancel()
		if d == nil || err != nil {
			return res, nil, err
		}
		if denial = d; h.engines.inFlight.n.Load() == 0 {
			return nil, denial, nil // nothing here left to settle
		}
	}
}

// relearn holds a waiting request as what its model's answers have taught
// since it was estimated: a cold model's first wave holds whole caps, and the
// first answers that settle while it waits prove the model, so the rest of
// the wave holds leases and fits. The room its model's history gives never
// grows a hold: a model found hidden meanwhile keeps the whole cap it held.
func (h *LLMBudget) relearn(c *call) {
	if c.history == nil || c.leaseSize > 0 || !c.history.leases() {
		return
	}
	h.chooseLease(c)
	if c.leaseSize > 0 && c.tokens != nil && !c.proxy && !c.history.countsTokens() {
		// Its own tokenizer has not proven its count yet: leased now, the
		// stream would be counted a token a byte, and a cut at a budget's
		// end charged about four times what English bills. One answer
		// counted by the tokenizer proves it; wait for that. (A proxy
		// needs several answers to teach its scale: its wave is leased
		// a token a byte meanwhile.)
		c.leaseSize, c.learned = 0, false
		return
	}
	if c.leaseSize > 0 {
		_ = h.priceEstimate(c) // priced before: the same price, a smaller output
	}
}

// settleRetryTick is how often a waiting request tries again without a
// settle of its own instance.
const settleRetryTick = 100 * time.Millisecond

// shadowDenied counts, logs and announces a denial that shadow mode does not
// enforce.
func (h *LLMBudget) shadowDenied(d *budget.Denial, c *call) {
	h.decisions[h.budgetIndex(d.Budget)][decisionShadowDenied].Inc()
	h.logger.Info("shadow: request would be denied by budget",
		zap.String("budget", d.Budget.Name),
		zap.String("scope", d.Budget.Scope.String()),
		zapAmount("requested", d.Budget.Unit, d.Amount),
		zapAmount("used", d.Budget.Unit, d.Used),
		zapAmount("limit", d.Budget.Unit, d.Limit))
	h.emitDenied(d, c, true)
}

// admit hands an admitted request's body to the next handler, counts it and
// writes its budgets' RateLimit items; a budget's denial gets the items
// too, with the time its Retry-After counts from.
func (h *LLMBudget) admit(w http.ResponseWriter, r *http.Request, res *budget.Reservation, c *call, ref *refusal) {
	var holds []budget.Hold
	switch {
	case ref == nil:
		h.restoreBody(r, c.forward)
		h.countAll(decisionAdmitted)
		holds = res.Holds
	case ref.kind == refusedBudget:
		holds = ref.denial.Holds
	default:
		return
	}
	now := time.Now()
	if ref != nil {
		ref.now = now
	}
	h.setBudgetHeaders(w.Header(), holds, now)
}

// restoreBody hands the body to the next handler and asks the upstream for an
// uncompressed response so its usage can be read (encode, ordered before this
// handler, still compresses for the client).
func (h *LLMBudget) restoreBody(r *http.Request, body []byte) {
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.Header.Set("Content-Length", strconv.Itoa(len(body)))
	r.Header.Del("Accept-Encoding")
}

// setBudgetHeaders writes RateLimit-Policy and RateLimit with one item per
// budget of a shown scope (RateLimitScopes), and nothing when none is shown.
func (h *LLMBudget) setBudgetHeaders(hdr http.Header, holds []budget.Hold, now time.Time) {
	policy := h.policy
	for _, hold := range holds {
		if h.shownScopes.has(hold.Budget.Scope) && hold.Limit != hold.Budget.Limit {
			// The client's own limit, which the config's policy does not say.
			policy = h.policyOf(holds)
			break
		}
	}
	buf := make([]byte, 0, 48*len(holds))
	for _, hold := range holds {
		if h.shownScopes.has(hold.Budget.Scope) {
			buf = appendRateLimitItem(buf, hold.Budget.Name, hold.Limit-hold.Used, hold.WindowEnd.Sub(now))
		}
	}
	if len(buf) == 0 {
		return
	}
	appendRateLimitHeaders(hdr, policy, string(buf))
}

// policyOf is RateLimit-Policy for holds of the shown scopes, each with the
// limit in force for the request's scope value: for a response whose limit
// is the value's own (set at run time, limit_for) or a reload's.
func (h *LLMBudget) policyOf(holds []budget.Hold) string {
	items := make([]string, 0, len(holds))
	for _, hold := range holds {
		if h.shownScopes.has(hold.Budget.Scope) {
			window := hold.Budget.NominalWindow()
			items = append(items, policyItem(hold.Budget.Name, hold.Limit, window))
		}
	}
	return joinItems(items)
}

// scopeSet is a set of budget scopes, a bit each.
type scopeSet uint8

func (s scopeSet) has(sc budget.Scope) bool { return s&(1<<sc) != 0 }

// countAll counts a decision that concerns every budget of the handler.
func (h *LLMBudget) countAll(d decision) {
	for i := range h.decisions {
		h.decisions[i][d].Inc()
	}
}
