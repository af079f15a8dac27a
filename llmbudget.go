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
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
)

func init() {
	caddy.RegisterModule(LLMBudget{})
}

const (
	// DefaultMaxTokens is the output cap reserved for a request that gives none.
	DefaultMaxTokens = 4096
	// DefaultMaxRequestBody bounds the request body read to estimate a request.
	DefaultMaxRequestBody = 16 << 20
	// defaultMaxRetryAfter is MaxRetryAfter's default.
	defaultMaxRetryAfter = 60 * time.Second
	// defaultStoreTimeout is StoreTimeout's default.
	defaultStoreTimeout = 100 * time.Millisecond
	// settleTimeout bounds a settle, which runs after the response on a
	// context detached from the request (and from the config, which a reload
	// may have cleaned up meanwhile).
	settleTimeout = 5 * time.Second
)

// LLMBudget is the `http.handlers.llmbudget` handler: hard token and dollar
// budgets in front of an OpenAI- or Anthropic-compatible API. It reserves an
// estimate before forwarding, across the fleet and all or nothing, denies
// what does not fit, and settles the reservation to the usage the upstream
// reports.
type LLMBudget struct {
	// Principal identifies who a `key` budget is kept for, with placeholders,
	// e.g. {http.request.header.X-User}. Default: the credential of the API
	// being called (Authorization; Anthropic's x-api-key; Gemini's
	// x-goog-api-key or key query parameter). It is hashed before it reaches
	// a store key or a log. Requests where it resolves to "" share one budget.
	Principal string `json:"principal,omitempty"`
	// Team identifies the team of a `team` budget, with placeholders.
	Team string `json:"team,omitempty"`
	// Budgets are checked and charged together: a request must fit all.
	Budgets []BudgetConfig `json:"budgets,omitempty"`
	// Prices by model, USD per 1M tokens. A name ending in * matches by prefix.
	Prices map[string]PriceConfig `json:"prices,omitempty"`
	// DefaultMaxTokens is reserved for the output of a request that sets no
	// max_tokens / max_completion_tokens / max_output_tokens. Default 4096.
	DefaultMaxTokens int64 `json:"default_max_tokens,omitempty"`
	// MaxRequestBody is the largest request body accepted, in bytes (413
	// above). Default 16 MiB.
	MaxRequestBody int64 `json:"max_request_body,omitempty"`
	// FailOpen admits requests unbudgeted when the store fails. Default: deny
	// with 503.
	FailOpen bool `json:"fail_open,omitempty"`
	// MaxRetryAfter is the longest Retry-After a denial leaves SDKs to wait
	// out on their own: a longer one (a budget whose window ends in an hour)
	// also carries x-should-retry: false, which the OpenAI and Anthropic SDKs
	// honour, so the call fails at once instead of sleeping. Default 60s.
	MaxRetryAfter caddy.Duration `json:"max_retry_after,omitempty"`
	// UnknownPaths says what happens to a POST whose path llmbudget does not
	// recognise as an API it budgets: "deny" (404 with a reason, not
	// forwarded) or "pass" (forwarded unbudgeted). Default "deny": a budget is
	// a hard ceiling, so nothing the upstream might bill passes unbudgeted
	// unless the config says so. Paths are recognised on their normalized form
	// (case, trailing "/.", spaces and ";parameters" do not matter). Reads
	// (GET, HEAD, OPTIONS: GET /v1/models…) always pass; POST is matched in
	// any case ("post" is budgeted too); any other method to a path llmbudget
	// budgets is refused with 405.
	UnknownPaths string `json:"unknown_paths,omitempty"`
	// StoreTimeout bounds how long a request waits for its reservation. A
	// reserve that times out is answered 503 (or admitted with fail_open) and
	// released by id in the background, so it never charges; the store is then
	// taken as down and requests are answered at once until a probe reaches
	// it. Default 100ms.
	StoreTimeout caddy.Duration `json:"store_timeout,omitempty"`
	// Format forces the API format (openai_chat, openai_responses,
	// anthropic, gemini, ollama) for gateways that rewrite paths. Default:
	// from the path.
	Format string `json:"format,omitempty"`
	// Shadow evaluates, counts and logs every decision but enforces none: a
	// request a budget would deny is forwarded and still charged (past the
	// limit), a request llmbudget would refuse (unknown path, bad or
	// ambiguous body, unpriced model, store down) is forwarded unbudgeted.
	// Decisions show as requests_total{decision="shadow_denied"} and
	// "shadow_rejected", Info logs and llmbudget_denied events with shadow
	// true. For rolling out a new budget safely. Default false.
	Shadow bool `json:"shadow,omitempty"`
	// InjectStreamUsage rewrites an OpenAI chat stream request that lacks
	// stream_options.include_usage to ask for it, so the stream reports its
	// usage. Default true.
	InjectStreamUsage *bool `json:"inject_stream_usage,omitempty"`
	// ChatCapField is the field an OpenAI chat request that names no output
	// cap is forwarded with, holding the cap it reserved:
	// "max_completion_tokens" (OpenAI's current field; its reasoning models
	// refuse max_tokens) or "max_tokens", for OpenAI-compatible servers that
	// read only that one (Ollama's OpenAI-compatible API, llama.cpp's server
	// before February 2026, llamafile): there a request that gives only
	// max_completion_tokens is given max_tokens too. Every other API gets its
	// own field (legacy completions max_tokens, Responses max_output_tokens,
	// Gemini generationConfig.maxOutputTokens, Ollama options.num_predict).
	// Default "max_completion_tokens".
	ChatCapField string `json:"chat_cap_field,omitempty"`
	// MaxOutputTokens is the largest output cap (per output) forwarded: a
	// request that asks for more is lowered to it, in its own cap field, and
	// reserves that (or is refused, see OverMaxOutputTokens); one that names
	// no cap gets the smaller of this and DefaultMaxTokens. Default 0: no
	// ceiling beyond the 1,000,000 a request may ask for.
	MaxOutputTokens int64 `json:"max_output_tokens,omitempty"`
	// OverMaxOutputTokens is what happens to a request whose own cap is over
	// MaxOutputTokens: "lower" forwards it with MaxOutputTokens; "refuse"
	// answers 400 (code output_cap_too_large) in the API's error shape and
	// forwards nothing. Default "lower".
	OverMaxOutputTokens string `json:"over_max_output_tokens,omitempty"`

	budgets       []budget.Budget
	storeTimeout  time.Duration
	maxRetryAfter time.Duration
	prices        *budget.PriceBook
	hasUSD        bool
	format        usage.Format
	chatCapField  usage.ChatCapField
	policy        string
	store         *store
	logger        *zap.Logger
	events        emitter
	registered    bool // its budgets are in the engine's registry (budget_registry.go)

	// requests_total by budget (the index in budgets) and decision.
	decisions      [][numDecisions]prometheus.Counter
	firstUSD       int // the budget an unpriced model is denied by
	rejected       prometheus.Counter
	shadowRejected prometheus.Counter
}

// BudgetConfig is one budget.
type BudgetConfig struct {
	Name string `json:"name,omitempty"`
	// Scope: global (default), key (per principal), model or team.
	Scope string `json:"scope,omitempty"`
	// Unit: tokens (default) or usd.
	Unit string `json:"unit,omitempty"`
	// Limit in tokens (an integer) or dollars.
	Limit float64 `json:"limit,omitempty"`
	// Window is the length of the fixed window, aligned to the Unix epoch.
	Window caddy.Duration `json:"window,omitempty"`
}

// PriceConfig is a model's price in USD per one million tokens.
type PriceConfig struct {
	Input  float64 `json:"input"`
	Output float64 `json:"output"`
	// CachedInput prices cached input tokens; 0 means the input price.
	CachedInput float64 `json:"cached_input,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (LLMBudget) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.llmbudget",
		New: func() caddy.Module { return new(LLMBudget) },
	}
}

var (
	_ caddy.Provisioner           = (*LLMBudget)(nil)
	_ caddy.CleanerUpper          = (*LLMBudget)(nil)
	_ caddyhttp.MiddlewareHandler = (*LLMBudget)(nil)
)

// Provision checks the config (errors name the field) and binds the engine.
func (h *LLMBudget) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if err := h.compile(); err != nil {
		return err
	}
	eng, err := storeFrom(ctx)
	if err != nil {
		return fmt.Errorf("llmbudget: %w", err)
	}
	h.store = eng
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return fmt.Errorf("llmbudget: metrics: %w", err)
	}
	h.bindCounters()
	if h.events, err = newEmitter(ctx); err != nil {
		return fmt.Errorf("llmbudget: %w", err)
	}
	if err := h.registerBudgets(ctx); err != nil {
		return fmt.Errorf("llmbudget: %w", err)
	}
	return nil
}

// Cleanup takes the handler's budgets out of the admin API's registry.
func (h *LLMBudget) Cleanup() error {
	h.unregisterBudgets()
	return nil
}

// compile turns the JSON config into the engine's values.
func (h *LLMBudget) compile() error {
	if len(h.Budgets) == 0 {
		return errors.New("llmbudget: budgets: at least one budget is required")
	}
	if h.DefaultMaxTokens < 0 || h.DefaultMaxTokens > usage.MaxOutputCap {
		return fmt.Errorf("llmbudget: default_max_tokens: must be between 1 and %d", usage.MaxOutputCap)
	}
	if h.DefaultMaxTokens == 0 {
		h.DefaultMaxTokens = DefaultMaxTokens
	}
	if err := h.compileOutputCap(); err != nil {
		return err
	}
	if h.MaxRequestBody < 0 {
		return errors.New("llmbudget: max_request_body: must be > 0")
	}
	if h.UnknownPaths != "" && h.UnknownPaths != "pass" && h.UnknownPaths != "deny" {
		return fmt.Errorf("llmbudget: unknown_paths %q: want pass or deny", h.UnknownPaths)
	}
	if h.StoreTimeout < 0 {
		return errors.New("llmbudget: store_timeout: must be > 0")
	}
	h.storeTimeout = cmp.Or(time.Duration(h.StoreTimeout), defaultStoreTimeout)
	if h.MaxRetryAfter < 0 {
		return errors.New("llmbudget: max_retry_after: must be > 0")
	}
	h.maxRetryAfter = cmp.Or(time.Duration(h.MaxRetryAfter), defaultMaxRetryAfter)
	if h.MaxRequestBody == 0 {
		h.MaxRequestBody = DefaultMaxRequestBody
	}
	h.format = usage.Unknown
	if h.Format != "" {
		f, err := usage.ParseFormat(h.Format)
		if err != nil {
			return fmt.Errorf("llmbudget: %w", err)
		}
		h.format = f
	}
	seen := make(map[string]bool)
	h.budgets = h.budgets[:0]
	h.hasUSD = false
	policies := make([]string, 0, len(h.Budgets))
	for _, bc := range h.Budgets {
		b, err := bc.compile()
		if err != nil {
			return err
		}
		if seen[b.Name] {
			return fmt.Errorf("llmbudget: budget %q: defined twice", b.Name)
		}
		seen[b.Name] = true
		if b.Scope == budget.PerTeam && h.Team == "" {
			// Without it every request would share one team's budget.
			return fmt.Errorf("llmbudget: budget %q: scope team needs the handler's team option, e.g. team {http.request.header.X-Team}", b.Name)
		}
		h.hasUSD = h.hasUSD || b.Unit == budget.USD
		h.budgets = append(h.budgets, b)
		policies = append(policies, policyItem(b.Name, b.Limit, b.Window))
	}
	h.policy = joinItems(policies)
	if h.hasUSD && len(h.Prices) == 0 {
		// Every request would be refused as unpriced.
		return errors.New("llmbudget: price: a usd budget needs the price of each model it admits (price <model>[*] <input> <output> [<cached_input>], USD per 1M tokens)")
	}
	prices := make(map[string]budget.Price, len(h.Prices))
	for model, p := range h.Prices {
		prices[model] = budget.Price{Input: p.Input, Output: p.Output, CachedInput: p.CachedInput}
	}
	pb, err := budget.NewPriceBook(prices)
	if err != nil {
		return fmt.Errorf("llmbudget: %w", err)
	}
	h.prices = pb
	return nil
}

func (bc *BudgetConfig) compile() (budget.Budget, error) {
	b := budget.Budget{Name: bc.Name, Window: time.Duration(bc.Window)}
	var err error
	if bc.Scope != "" {
		if b.Scope, err = budget.ParseScope(bc.Scope); err != nil {
			return b, fmt.Errorf("llmbudget: budget %q: %w", bc.Name, err)
		}
	}
	if bc.Unit != "" {
		if b.Unit, err = budget.ParseUnit(bc.Unit); err != nil {
			return b, fmt.Errorf("llmbudget: budget %q: %w", bc.Name, err)
		}
	}
	switch {
	case bc.Limit == 0:
		return b, fmt.Errorf("llmbudget: budget %q: limit is required (a number > 0)", bc.Name)
	case bc.Limit < 0 || bc.Limit != bc.Limit:
		return b, fmt.Errorf("llmbudget: budget %q: limit must be > 0", bc.Name)
	case b.Unit == budget.Tokens && bc.Limit != float64(int64(bc.Limit)):
		return b, fmt.Errorf("llmbudget: budget %q: a token limit must be a whole number", bc.Name)
	case b.Unit == budget.USD:
		b.Limit = budget.USDToMicros(bc.Limit)
	default:
		b.Limit = int64(bc.Limit)
	}
	if bc.Window == 0 {
		return b, fmt.Errorf("llmbudget: budget %q: window is required", bc.Name)
	}
	if err := b.Validate(); err != nil {
		return b, fmt.Errorf("llmbudget: %w", err)
	}
	return b, nil
}

// ServeHTTP reserves, forwards, and settles.
func (h *LLMBudget) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	format := h.format
	if format == usage.Unknown {
		format = usage.FormatFromPath(r.URL.Path)
	}
	// Methods are compared without regard to case: some upstream frameworks
	// upper-case the method and serve a "post" like a POST.
	if !strings.EqualFold(r.Method, http.MethodPost) {
		if format == usage.Unknown || isRead(r.Method) {
			return next.ServeHTTP(w, r) // not an LLM call: reads are free
		}
		if !h.Shadow {
			w.Header().Set("Allow", "GET, HEAD, OPTIONS, POST")
		}
		return h.refuse(w, r, next, format, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed",
			fmt.Sprintf("llmbudget budgets %s with POST and passes reads (GET, HEAD, OPTIONS); it does not forward %s", usage.NormalizePath(r.URL.Path), r.Method))
	}
	if format == usage.Unknown {
		if h.UnknownPaths == "pass" {
			return next.ServeHTTP(w, r)
		}
		return h.refuse(w, r, next, format, http.StatusNotFound, "invalid_request_error", "unbudgeted_path",
			fmt.Sprintf("llmbudget does not know how to budget POST %s, so it does not forward it (set unknown_paths pass to forward such requests unbudgeted)", usage.NormalizePath(r.URL.Path)))
	}

	body, err := h.readBody(r)
	if err != nil {
		if errors.Is(err, errBodyTooLarge) {
			if h.Shadow {
				// Forward what was read, then the rest as it comes.
				r.Body = struct {
					io.Reader
					io.Closer
				}{io.MultiReader(bytes.NewReader(body), r.Body), r.Body}
			}
			return h.refuse(w, r, next, format, http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large",
				fmt.Sprintf("request body exceeds %d bytes", h.MaxRequestBody))
		}
		return caddyhttp.Error(http.StatusBadRequest, fmt.Errorf("llmbudget: reading the request body: %w", err))
	}
	req, err := usage.ParseRequest(format, r.URL.Path, body)
	if err != nil {
		code := "invalid_request"
		if errors.Is(err, usage.ErrAmbiguous) {
			code = "ambiguous_request"
		}
		h.restoreBody(r, body)
		return h.refuse(w, r, next, format, http.StatusBadRequest, "invalid_request_error", code, err.Error())
	}
	outputCap, err := h.outputCap(req)
	if err != nil {
		h.restoreBody(r, body)
		return h.refuse(w, r, next, format, http.StatusBadRequest, "invalid_request_error", "output_cap_too_large", err.Error())
	}
	forward, askedUsage, err := h.forwardBody(format, req, body, outputCap)
	if err != nil {
		h.restoreBody(r, body)
		return h.refuse(w, r, next, format, http.StatusBadRequest, "invalid_request_error", "invalid_request", err.Error())
	}

	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	dims := budget.Dims{Model: req.Model}
	if h.Principal != "" {
		dims.Principal = repl.ReplaceAll(h.Principal, "")
	} else {
		dims.Principal = apiCredential(r, format)
	}
	if h.Team != "" {
		dims.Team = repl.ReplaceAll(h.Team, "")
	}
	estimate := budget.Usage{InputTokens: req.PromptTokens, OutputTokens: outputCap * req.N}
	spend := budget.Spend{Tokens: estimate.Tokens()}
	model, price, priced := h.prices.Find(req.Model)
	if h.hasUSD {
		if !priced {
			h.decisions[h.firstUSD][denied].Inc()
			if h.Shadow {
				h.logger.Info("shadow: request would be refused: its model has no price", zap.String("model", req.Model))
				h.restoreBody(r, body)
				return next.ServeHTTP(w, r)
			}
			w.Header().Set("X-Should-Retry", "false") // waiting never prices it
			return h.reject(w, format, http.StatusPaymentRequired, "budget_exceeded", "model_not_priced",
				fmt.Sprintf("model %q has no price in the price book, so a dollar budget cannot admit it", req.Model))
		}
		spend.CostMicros = price.CostMicros(estimate)
	}

	reserveCtx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
	res, denial, err := h.store.budgets.Reserve(reserveCtx, h.budgets, dims, spend)
	if denial != nil && h.Shadow {
		h.shadowDenied(r, denial, dims)
		// Record what it uses all the same: the numbers a real limit would
		// have seen.
		res, err = h.store.budgets.ReserveOverLimit(reserveCtx, h.budgets, dims, spend)
		denial = nil
	}
	cancel()
	if err != nil {
		if !errors.Is(err, budget.ErrStoreDown) {
			metrics.storeErrors.WithLabelValues("reserve").Inc()
		}
		h.store.budgetStoreFailed(h.logger, h.FailOpen || h.Shadow, err)
	} else {
		h.store.budgetStoreOK(h.logger)
	}
	switch {
	case err != nil && (h.FailOpen || h.Shadow):
		h.countAll(failOpen)
		h.restoreBody(r, body)
		return next.ServeHTTP(w, r)
	case err != nil:
		h.countAll(storeError)
		w.Header().Set("Retry-After", "1")
		return h.reject(w, format, http.StatusServiceUnavailable, "service_unavailable", "budget_store_unavailable",
			"the budget store is unavailable; try again shortly")
	case denial != nil:
		h.decisions[h.budgetIndex(denial.Budget)][denied].Inc()
		return h.deny(w, r, format, repl, denial, dims)
	}
	h.countAll(admitted)
	h.setRateLimitHeaders(w.Header(), res.Holds, time.Now())
	h.restoreBody(r, forward)

	mw := newMeteringWriter(w, format)
	// The client did not ask for the usage chunk (or said no): it still
	// settles the budget, but the client does not see it.
	mw.stripUsage = askedUsage
	defer h.finish(r, res, mw, req.PromptTokens, outputCap*req.N, price, model)
	return next.ServeHTTP(mw, r)
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

// isRead reports whether method is one that reads (GET, HEAD, OPTIONS, in any
// case): such requests to an API's paths (listing stored completions, say)
// are not billed as generation.
func isRead(method string) bool {
	return strings.EqualFold(method, http.MethodGet) || strings.EqualFold(method, http.MethodHead) || strings.EqualFold(method, http.MethodOptions)
}

func (h *LLMBudget) injectStreamUsage() bool {
	return h.InjectStreamUsage == nil || *h.InjectStreamUsage
}

var errBodyTooLarge = errors.New("request body too large")

// readBody reads at most MaxRequestBody bytes. Past that it returns
// errBodyTooLarge with what it read (the start of the body: shadow mode
// forwards it, then the rest).
func (h *LLMBudget) readBody(r *http.Request) ([]byte, error) {
	if r.ContentLength > h.MaxRequestBody {
		return nil, errBodyTooLarge
	}
	if r.Body == nil {
		return nil, nil
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, h.MaxRequestBody+1))
	if err != nil {
		return nil, err
	}
	if int64(len(body)) > h.MaxRequestBody {
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
