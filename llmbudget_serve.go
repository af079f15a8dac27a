package fleetguard

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/bpe"
	"github.com/fleetguard/fleetguard/budget/usage"
)

// ServeHTTP budgets a request in phases: screen (method and path), estimate
// (read the body, bound its output, price it), reserve, then forward with the
// response metered. The settle follows the response (llmbudget_settle.go).
// A refusal from any phase goes through refuse (llmbudget_respond.go), which
// applies shadow mode, fail_open, metrics, events and the API's error shape.
func (h *LLMBudget) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	format := h.format
	if format == usage.Unknown {
		format = usage.FormatFromPath(r.URL.Path)
	}
	budgeted, ref := h.screen(r, format)
	if ref != nil {
		return h.refuse(w, r, next, format, ref)
	}
	if !budgeted {
		return next.ServeHTTP(w, r)
	}
	var c call
	if ref := h.estimate(r, format, &c); ref != nil {
		return h.refuse(w, r, next, format, ref)
	}
	res, ref := h.reserve(r, &c)
	if ref != nil {
		return h.refuse(w, r, next, format, ref)
	}
	h.admit(w, res.Holds)
	h.restoreBody(r, c.forward)
	mw := newMeteringWriter(w, format)
	// The client did not ask for the usage chunk (or said no): it still
	// settles the budget, but the client does not see it.
	mw.stripUsage = c.askedUsage
	if c.tokens != nil {
		mw.tokens = c.tokens
		if c.proxy {
			mw.tokens = proxyCounter{c.tokens}
		}
	}
	defer h.finish(r, res, mw, &c)
	if c.lease > 0 {
		// A stream cut at its lease cancels the upstream request, which
		// then stops generating (and billing).
		ctx, cancel := context.WithCancel(r.Context())
		defer cancel()
		mw.lease, mw.cancelUpstream = newLease(h, res, &c), cancel
		mw.clientAskedUsage = c.req.IncludeUsage
		r = r.WithContext(ctx)
		defer endTruncated(mw)
	}
	err := next.ServeHTTP(mw, r)
	if mw.truncated {
		return nil // the client has a finished answer; the upstream's cancel is ours
	}
	return err
}

// endTruncated lets a stream ended at its lease finish cleanly: cancelled,
// the upstream request makes reverse_proxy abort the response
// (http.ErrAbortHandler), which would cut the client's connection after the
// terminal form it already has. Any other panic goes on.
func endTruncated(mw *meteringWriter) {
	if !mw.truncated {
		return
	}
	if v := recover(); v != nil && v != http.ErrAbortHandler {
		panic(v)
	}
}

// call is a request as the budget sees it once estimated.
type call struct {
	req usage.Request
	// body is the request body as the client sent it; forward, as it is
	// forwarded (its output bounded, its stream asked for usage).
	body, forward []byte
	askedUsage    bool
	outputCap     int64 // per output (choice, candidate)
	// lease is the output held for a leased stream (0: the whole cap is
	// held); history, its model's recent answers; learned, the lease was
	// learned from them.
	lease   int64
	learned bool
	history *outputHistory
	// tokens is the model's public tokenizer, once loaded, while its
	// answers have not billed more than it counts; proxy, whether it is
	// another model's, which counts at a scale its answers taught.
	tokens *bpe.Counter
	proxy  bool
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
}

// screen decides from the method and path alone: budgeted (go on), passed
// unbudgeted (a read, or an unknown path with unknown_paths pass), or
// refused. Methods are compared without regard to case: some upstream
// frameworks upper-case the method and serve a "post" like a POST.
func (h *LLMBudget) screen(r *http.Request, format usage.Format) (budgeted bool, ref *refusal) {
	if !strings.EqualFold(r.Method, http.MethodPost) {
		if format == usage.Unknown || isRead(r.Method) {
			return false, nil // not an LLM call: reads are free
		}
		return false, &refusal{kind: refusedRequest, status: http.StatusMethodNotAllowed, code: "method_not_allowed",
			allow: "GET, HEAD, OPTIONS, POST",
			message: fmt.Sprintf("llmbudget budgets %s with POST and passes reads (GET, HEAD, OPTIONS); it does not forward %s",
				usage.NormalizePath(r.URL.Path), r.Method)}
	}
	if format == usage.Unknown {
		if h.UnknownPaths == "pass" {
			return false, nil
		}
		return false, &refusal{kind: refusedRequest, status: http.StatusNotFound, code: "unbudgeted_path",
			message: fmt.Sprintf("llmbudget does not know how to budget POST %s, so it does not forward it (set unknown_paths pass to forward such requests unbudgeted)",
				usage.NormalizePath(r.URL.Path))}
	}
	return true, nil
}

// isRead reports whether method is one that reads (GET, HEAD, OPTIONS, in any
// case): such requests to an API's paths (listing stored completions, say)
// are not billed as generation.
func isRead(method string) bool {
	return strings.EqualFold(method, http.MethodGet) || strings.EqualFold(method, http.MethodHead) || strings.EqualFold(method, http.MethodOptions)
}

// estimate reads the body, bounds its output, prices it and names who it is
// budgeted for, into c.
func (h *LLMBudget) estimate(r *http.Request, format usage.Format, c *call) *refusal {
	body, err := h.readBody(r)
	switch {
	case errors.Is(err, errBodyTooLarge):
		return &refusal{kind: refusedRequest, status: http.StatusRequestEntityTooLarge, code: "request_too_large",
			message: fmt.Sprintf("request body exceeds %d bytes", h.maxRequestBody), body: body, bodyStart: true}
	case err != nil:
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "unreadable_body",
			message: "reading the request body failed: " + err.Error(), body: body, bodyStart: true}
	}
	c.body = body
	if c.req, err = usage.ParseRequest(format, r.URL.Path, body); err != nil {
		code := "invalid_request"
		if errors.Is(err, usage.ErrAmbiguous) {
			code = "ambiguous_request"
		}
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: code, message: err.Error(), body: body}
	}
	if model, ok := h.deployments[c.req.Model]; ok && c.req.Deployment {
		c.req.Model = model
	}
	if ref := h.boundOutput(format, c); ref != nil {
		return ref
	}
	if ref := h.boundInput(c); ref != nil {
		return ref
	}
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	c.dims = budget.Dims{Model: c.req.Model}
	if h.Principal != "" {
		c.dims.Principal = repl.ReplaceAll(h.Principal, "")
	} else {
		c.dims.Principal = apiCredential(r, format)
	}
	if h.Team != "" {
		c.dims.Team = repl.ReplaceAll(h.Team, "")
	}
	output := c.outputCap * c.req.N
	if h.leasable(r, format, c) {
		// Only a model proven to bill no output its text does not show
		// leases (llmbudget_lease_history.go).
		c.history = h.store.histories.of(c.req.Model)
		if v, proxy := h.tokenizerOf(c.req.Model); v != 0 && !c.history.tokensRevoked.Load() {
			c.tokens, c.proxy = bpe.Loaded(v), proxy
		}
		if c.history.leases() {
			// Learned from the answers' counts as this stream will be
			// counted: by the tokenizer, or a token a byte.
			learned := c.history.lease.Load()
			if c.tokens != nil && c.history.countsTokens() {
				learned = c.history.tokensLease.Load()
			}
			c.lease = min(max(learned, h.outputLeaseMin), c.outputCap)
			c.learned = learned > 0
			output = c.lease
		}
	}
	// The worst the request can reach: the tier it asks for, and the
	// long-context tier when its prompt estimate is above the threshold.
	estimate := budget.Usage{InputTokens: c.req.PromptTokens, OutputTokens: output, ServiceTier: c.req.ServiceTier}
	c.spend = budget.Spend{Tokens: estimate.Tokens()}
	var priced bool
	priceName := c.req.Model
	if c.req.Deployment {
		// Azure's own price first ("azure/gpt-4o" in a prices_file), then
		// the model's: the name resolves past the provider prefix.
		priceName = "azure/" + priceName
	}
	c.model, c.price, priced = h.prices.Find(priceName)
	if h.hasUSD {
		if !priced {
			return &refusal{kind: refusedUnpriced, status: http.StatusPaymentRequired, errType: "budget_exceeded", code: "model_not_priced",
				noRetry: true, body: body, // waiting never prices it
				message: fmt.Sprintf("model %q has no price in the price book, so a dollar budget cannot admit it", c.req.Model)}
		}
		c.rates = c.price.RatesFor(estimate)
		c.spend.CostMicros = c.price.CostMicros(estimate)
	}
	return nil
}

// reserve charges the estimate to every budget at once. In shadow mode a
// denial is counted and the request reserved over the limit all the same:
// the numbers a real limit would have seen.
func (h *LLMBudget) reserve(r *http.Request, c *call) (*budget.Reservation, *refusal) {
	ctx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
	defer cancel()
	res, denial, err := h.store.budgets.Reserve(ctx, h.budgets, c.dims, c.spend)
	if denial != nil {
		res, denial, err = h.waitForRoom(r, c, denial)
	}
	if denial != nil && h.Shadow {
		h.shadowDenied(r, denial, c.dims)
		res, err = h.store.budgets.ReserveOverLimit(ctx, h.budgets, c.dims, c.spend)
		denial = nil
	}
	if err != nil {
		if !errors.Is(err, budget.ErrStoreDown) {
			metrics.storeErrors.WithLabelValues("reserve").Inc()
		}
		h.store.budgetStoreFailed(h.logger, h.FailOpen || h.Shadow, err)
		return nil, &refusal{kind: refusedStoreDown, status: http.StatusServiceUnavailable, errType: "service_unavailable",
			code: "budget_store_unavailable", message: "the budget store is unavailable; try again shortly", retryAfter: 1, body: c.body}
	}
	h.store.budgetStoreOK(h.logger)
	if denial == nil {
		h.store.inFlight.reserved()
	}
	if denial != nil {
		return nil, &refusal{kind: refusedBudget, denial: denial, dims: c.dims, note: c.holdNote}
	}
	return res, nil
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

func (h *LLMBudget) injectStreamUsage() bool {
	return h.InjectStreamUsage == nil || *h.InjectStreamUsage
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

// restoreBody hands the body to the next handler and asks the upstream for an
// uncompressed response so its usage can be read (encode, ordered before this
// handler, still compresses for the client).
func (h *LLMBudget) restoreBody(r *http.Request, body []byte) {
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.Header.Set("Content-Length", strconv.Itoa(len(body)))
	r.Header.Del("Accept-Encoding")
}

// forwardRest hands the next handler what was read of the body, then the rest
// as it comes: shadow mode forwards a body llmbudget stopped reading.
func forwardRest(r *http.Request, start []byte) {
	r.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(start), r.Body), r.Body}
}
