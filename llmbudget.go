package fleetguard

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/bpe"
	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/keyhash"
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
	// a store key or a log. A request where it resolves to "" is refused
	// by a key budget, or shares one budget with the others like it (the
	// budget's MissingScope).
	Principal string `json:"principal,omitempty"`
	// Team identifies the team of a `team` budget, with placeholders:
	// {http.request.header.X-Team} lets the client name any team; a team
	// set on the server (a `map` from the key, an auth layer's header) is
	// one the client cannot choose. A request where it resolves to "" is
	// refused by a team budget, or budgeted as one shared empty team (the
	// budget's MissingScope). Required by a team budget.
	Team string `json:"team,omitempty"`
	// Budgets are checked and charged together: a request must fit all.
	Budgets []BudgetConfig `json:"budgets,omitempty"`
	// Prices by model, USD per 1M tokens. A name ending in * matches by
	// prefix; a dated or provider-prefixed name resolves to its entry
	// (budget.ResolveModel). They win over PricesFile's.
	Prices map[string]PriceConfig `json:"prices,omitempty"`
	// PricesFile is the path of a price table in LiteLLM's
	// model_prices_and_context_window.json format, read at each load (a
	// reload reads it again); Prices win over its entries. A file that does
	// not read refuses the config, naming the entry and field. Default: none.
	PricesFile string `json:"prices_file,omitempty"`
	// Provider is the upstream's provider as LiteLLM's price table names it
	// in its keys ("groq", "mistral", "deepseek", "openrouter",
	// "together_ai", "fireworks_ai", "xai", "gemini", ...): a model is priced
	// as "<provider>/<model>" first, then by its bare name, so a prices_file
	// prices "llama-3.3-70b-versatile" behind a Groq route at Groq's price.
	// A model already named with the prefix is priced as named; a price
	// line of the bare name still wins over the file. Default: by the API,
	// "gemini" for Gemini's, "anthropic" for Anthropic's, "ollama" for
	// Ollama's, none for OpenAI's (LiteLLM keys OpenAI's models bare); an
	// Azure deployment path is always "azure".
	Provider string `json:"provider,omitempty"`
	// Deployments maps an Azure OpenAI deployment, the <name> of a path
	// /openai/deployments/<name>/..., to the model it serves, for a
	// deployment named otherwise than its model. The model of such a path
	// is its deployment, never the body's model. Names are matched in lower
	// case. Default: none (the deployment's name is its model).
	Deployments map[string]string `json:"deployments,omitempty"`
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
	// PassUpgrades are path patterns (* matches any run of characters;
	// matched on the normalized path) whose protocol upgrades llmbudget
	// forwards unbudgeted. A WebSocket session of the Responses API's
	// WebSocket mode (GET /v1/responses, HTTP/1.1) is budgeted one
	// response at a time; any other upgrade (OpenAI Realtime, Gemini Live,
	// a CONNECT) on this handler is refused with 403 (code
	// unbudgeted_upgrade): a session generates whatever its events ask
	// for, which llmbudget does not meter for those. Default none.
	PassUpgrades []string `json:"pass_upgrades,omitempty"`
	// UnknownFields is what happens to a request whose body has a
	// top-level field llmbudget does not know for its API (a field newer
	// than this release, a server's own extension), which may make the
	// upstream bill more than the estimate: "hold" holds its worst case,
	// ContextWindow tokens of input and its whole output cap (no lease), so
	// a budget smaller than that refuses it as never fitting and the field
	// cannot bill past what is held; "refuse" answers 400 (code
	// unknown_field) naming the field. Default "hold", as HiddenInput: a
	// client whose SDK sends a new field keeps working wherever a budget
	// has room for the worst case. docs/llmbudget.md lists the fields known
	// per API.
	UnknownFields string `json:"unknown_fields,omitempty"`
	// NeutralFields are top-level body fields the operator knows change
	// nothing billed (a server's own sampling option, say): they are not
	// unknown. Default none.
	NeutralFields []string `json:"neutral_fields,omitempty"`
	// StoreTimeout bounds how long a request waits for its reservation, and
	// each try of a lease's extension. A reserve that times out is answered
	// 503 (or admitted with fail_open) and released by id in the background,
	// so it never charges. A failed call starts a probe; if the store does
	// not answer it within 1 s either, it is taken as down and requests
	// are answered at once until a probe reaches it. Default 100ms.
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
	// OutputLeases holds a streamed request to its prompt and an output
	// lease, learned from recent answers of its model (their 90th percentile,
	// within OutputLeaseMin and the request's cap), instead of its whole cap;
	// the lease is extended as the stream needs, atomically across every
	// budget, and a stream whose extension is refused ends at its lease in
	// the API's own terminal form (finish_reason "length", stop_reason
	// "max_tokens", ...) with the upstream request cancelled. Requests whose
	// output cannot be seen as it streams hold their whole cap: non-streamed
	// ones, those asking for several outputs (n > 1), those carrying
	// reasoning parameters and those to ReasoningModels. Default true.
	OutputLeases *bool `json:"output_leases,omitempty"`
	// OutputLeaseMin is the smallest output lease, in tokens, and the first
	// one of a model with no history; extensions are at least a quarter of
	// it. Default 256.
	OutputLeaseMin int64 `json:"output_lease_min,omitempty"`
	// ReasoningModels are model patterns (* matches any run of characters;
	// a pattern matches the model or its part after the last "/") whose
	// requests hold their whole output cap, because the model bills
	// reasoning tokens it does not stream. Setting it replaces the default:
	// o1*, o3*, o4*, gpt-5*, codex-*, gemini-2.5-*, gemini-3*, grok-3-mini*,
	// grok-4*, *thinking*.
	ReasoningModels []string `json:"reasoning_models,omitempty"`
	// Tokenizers are the models whose streams are counted by their own
	// public tokenizer, by vocabulary ("o200k_base", "cl100k_base"): model
	// patterns as in ReasoningModels. A leased stream of such a model
	// counts each output value's tokens, where a model of another counts a
	// token a byte, once an answer of the model has billed no more than
	// that count, and until one bills more. Setting it replaces the
	// default, and an empty object turns it off: o200k_base for gpt-4o*,
	// chatgpt-4o*, gpt-4.1*, gpt-4.5*, gpt-5*, o1*, o3*, o4* and their
	// ft: fine-tunes; cl100k_base for gpt-4, gpt-4-*, gpt-3.5-turbo*,
	// gpt-35-turbo* and text-embedding-3*. A vocabulary is loaded in the
	// background on the first request that names one of its models
	// (o200k_base: about 0.1 s of a core and 11 MB of heap), which is
	// counted a token a byte meanwhile.
	Tokenizers map[string][]string `json:"tokenizers,omitzero"`
	// ProxyTokenizers are the models counted by another model's public
	// tokenizer, by vocabulary, with model patterns as in Tokenizers (a
	// model Tokenizers names is counted by its own): for a model whose
	// tokenizer is not public (Anthropic's, Google's, a model served by an
	// OpenAI-compatible server), the proxy's count is scaled to what the
	// model bills. Its first 4 answers teach the scale (1.1 times the most
	// any billed per proxy token) and the density up to which it holds
	// (proxy tokens a byte); until then, for text denser than that, and for
	// good once an answer within it bills more, its streams count a token
	// a byte. Setting it replaces the default, and an empty object turns
	// it off: o200k_base for every model ("*").
	ProxyTokenizers map[string][]string `json:"proxy_tokenizers,omitzero"`
	// HiddenInput is what happens to a request that makes the upstream bill
	// input its body does not show: a Responses request with
	// previous_response_id, conversation or a stored prompt; a file,
	// document or audio part by id or URL; a server tool (web search, file
	// search, code execution, MCP) whose results the upstream reads. "hold"
	// holds ContextWindow tokens for its prompt (the most it can bill), so
	// a budget smaller than that refuses it as never fitting; "refuse"
	// answers 400 (code hidden_input) and forwards nothing. Default "hold".
	HiddenInput string `json:"hidden_input,omitempty"`
	// ContextWindow is the input, in tokens, held for a request with hidden
	// input: set it to the largest context window of the models behind this
	// handler. Default 1,000,000.
	ContextWindow int64 `json:"context_window,omitempty"`
	// USDDenialStatus is the status of a dollar budget's denial: 429
	// (insufficient_quota in OpenAI's shape, rate_limit_error in
	// Anthropic's, RESOURCE_EXHAUSTED in Gemini's), which each SDK raises
	// as its rate-limit error as it does for the provider's own exhausted
	// quota, so code written against the provider handles it; or 402
	// (usd_budget_exceeded), which the SDKs raise as a plain API error.
	// Default 429.
	USDDenialStatus int `json:"usd_denial_status,omitempty"`
	// SettleWait is how long a request a budget refuses, but that fits its
	// limit, waits for requests in flight to settle before it is answered
	// 429 (or 402): streams in flight hold up to a token a byte of their
	// text, several times what they will be charged, so room often comes
	// back within an answer's length. It tries again at each settle of this
	// instance and every 100ms. 0 turns it off. Default 2s.
	SettleWait *caddy.Duration `json:"settle_wait,omitempty"`
	// RateLimitScopes are the scopes whose budgets a response's RateLimit
	// and RateLimit-Policy items name: of "key", "team", "model" and
	// "global". A client reads its own budgets' room; the global and model
	// budgets' items would show it every other tenant's traffic, so they
	// are named only when listed here. An empty list names none (and the
	// headers are left out). Default ["key", "team"].
	//
	// An item's quota (q) and remaining (r) are in the budget's counting
	// unit, which the headers' integer fields can carry exactly: tokens for
	// a token budget, micro-dollars for a usd budget ("team_usd";q=250000000
	// is $250, r=1500000 is $1.50 left). The denial's message and the admin
	// API say dollars; t and w are seconds.
	RateLimitScopes []string `json:"ratelimit_scopes,omitzero"`

	budgets          []budget.Budget
	defaultMaxTokens int64
	maxRequestBody   int64
	storeTimeout     time.Duration
	maxRetryAfter    time.Duration
	prices           *budget.PriceBook
	deployments      map[string]string // lower-case deployment -> model
	hasUSD           bool
	format           usage.Format
	chatCapField     usage.ChatCapField
	policy           string   // RateLimit-Policy of the shown budgets
	shownScopes      scopeSet // the scopes whose budgets RateLimit names
	outputLeases     bool
	outputLeaseMin   int64
	reasoningModels  []string
	tokenizers       []tokenizerPatterns
	proxyTokenizers  []tokenizerPatterns
	contextWindow    int64
	neutralFields    map[string]bool
	settleWait       time.Duration
	engines          *engines
	logger           *zap.Logger
	events           emitter
	registered       bool // its budgets are in the store's registry (admin_registry.go)
	// required are the scopes a request must name a value of, each with
	// the first budget that requires it (missing_scope refuse).
	required []requiredScope

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
	// Unit is what the budget counts: tokens or usd. Required: a limit
	// read in the wrong unit (`limit 5` meant as dollars, counted as
	// tokens) would refuse every request, so there is no default.
	Unit string `json:"unit,omitempty"`
	// Limit in tokens (an integer) or dollars.
	Limit float64 `json:"limit,omitempty"`
	// Window is the length of the fixed window, aligned to the Unix epoch.
	// Required unless Calendar is set.
	Window caddy.Duration `json:"window,omitempty"`
	// Calendar makes the window a calendar "day", "week" (ISO, from Monday)
	// or "month" in Timezone instead: it resets at local midnight (on
	// Monday, on the 1st). Default: none (Window).
	Calendar string `json:"calendar,omitempty"`
	// Timezone is the IANA time zone of a calendar window
	// ("America/New_York"). Default UTC.
	Timezone string `json:"timezone,omitempty"`
	// LimitFor are the limits of single scope values known ahead (a team's
	// own budget), which win over Limit for their value; a limit set at run
	// time through the admin API wins over them. Not for a global budget.
	// Default: none.
	LimitFor []LimitForConfig `json:"limit_for,omitempty"`
	// AlertAt are percentages of the limit (1 to 100, ascending) at which
	// each scope value is reported once per window across the whole fleet:
	// the llmbudget_threshold event and
	// fleetguard_llmbudget_threshold_crossings_total. Default: none.
	AlertAt []int `json:"alert_at,omitempty"`
	// MissingScope is what happens to a request whose scope value for this
	// budget is missing: a key budget's principal, or a team budget's team,
	// that resolves to "" (the team header the request lacks, say).
	// "refuse" answers 400 in the API's error shape (code missing_team or
	// missing_principal) and forwards nothing; "shared" budgets every such
	// request as one scope value, the empty one, with its own limit. Not for
	// a global or model budget (a request always names its model). Default
	// "refuse": a request must not escape its team's budget by leaving the
	// team out.
	MissingScope string `json:"missing_scope,omitempty"`
}

// Values of BudgetConfig.MissingScope.
const (
	missingScopeRefuse = "refuse"
	missingScopeShared = "shared"
)

// LimitForConfig is the limit of one scope value of a budget.
type LimitForConfig struct {
	// Value is the scope value as the handler resolves it: a team, a model,
	// a principal. One of Value and ValueHash is required.
	Value string `json:"value,omitempty"`
	// ValueHash is the value's hash instead (32 hex digits, the scope_hash
	// of the admin API and the principal_hash of the logs), so an API key
	// need not be written in a config.
	ValueHash string `json:"value_hash,omitempty"`
	// Limit is in the budget's unit: tokens (a whole number) or dollars.
	// Required, > 0.
	Limit float64 `json:"limit,omitempty"`
}

// PriceConfig is a model's price in USD per one million tokens (per call
// for WebSearch). A zero price other than Input and Output takes its default.
type PriceConfig struct {
	// Input and Output are the standard prices. Required (0 is free).
	Input  float64 `json:"input"`
	Output float64 `json:"output"`
	// CachedInput prices input read from a prompt cache. Default Input.
	CachedInput float64 `json:"cached_input,omitempty"`
	// CacheWrite prices input written to a 5-minute prompt cache (Anthropic's
	// cache_creation_input_tokens). Default Input.
	CacheWrite float64 `json:"cache_write,omitempty"`
	// CacheWrite1h prices input written to a 1-hour prompt cache. Default
	// CacheWrite.
	CacheWrite1h float64 `json:"cache_write_1h,omitempty"`
	// AudioInput and AudioOutput price audio tokens. Default Input, Output.
	AudioInput  float64 `json:"audio_input,omitempty"`
	AudioOutput float64 `json:"audio_output,omitempty"`
	// LongContextAbove is the prompt size, in tokens, above which the whole
	// request is billed at LongContext. Default 0: no long-context tier.
	LongContextAbove int64 `json:"long_context_above,omitempty"`
	// LongContext, Flex, Priority and Batch are the input and output prices
	// of the long-context tier and of the service tiers; their other prices
	// scale with their input (output) price. Default: none (standard).
	LongContext *TierPriceConfig `json:"long_context,omitempty"`
	Flex        *TierPriceConfig `json:"flex,omitempty"`
	Priority    *TierPriceConfig `json:"priority,omitempty"`
	Batch       *TierPriceConfig `json:"batch,omitempty"`
	// WebSearch is the fee of one server-side web search, in USD per call
	// (Anthropic: 0.01). Default 0.
	WebSearch float64 `json:"web_search,omitempty"`
}

// TierPriceConfig is the price of a tier in USD per one million tokens.
type TierPriceConfig struct {
	// Input is the tier's input price. Default (0): the standard one.
	Input float64 `json:"input"`
	// Output is the tier's output price. Default (0): the standard one.
	Output float64 `json:"output"`
}

// price is the config as the price book keeps it; the error names the field.
func (pc PriceConfig) price() (budget.Price, error) {
	p := budget.Price{LongContextAbove: pc.LongContextAbove}
	var err error
	rate := func(field string, usd float64) int64 {
		if err == nil && (usd < 0 || usd != usd || usd > float64(budget.MaxRate)/budget.MicrosPerUSD) {
			err = fmt.Errorf("%s: %v is not a price >= 0", field, usd)
		}
		return budget.USDToMicros(usd)
	}
	p.Rates = budget.Rates{
		Input: rate("input", pc.Input), Output: rate("output", pc.Output),
		CacheRead: rate("cached_input", pc.CachedInput), CacheWrite: rate("cache_write", pc.CacheWrite),
		CacheWrite1h: rate("cache_write_1h", pc.CacheWrite1h),
		AudioInput:   rate("audio_input", pc.AudioInput), AudioOutput: rate("audio_output", pc.AudioOutput),
	}
	for _, t := range []struct {
		name string
		cfg  *TierPriceConfig
		to   *budget.Rates
	}{{"long_context", pc.LongContext, &p.LongContext}, {"flex", pc.Flex, &p.Flex}, {"priority", pc.Priority, &p.Priority}, {"batch", pc.Batch, &p.Batch}} {
		if t.cfg != nil {
			*t.to = budget.Rates{Input: rate(t.name+".input", t.cfg.Input), Output: rate(t.name+".output", t.cfg.Output)}
		}
	}
	p.WebSearchCall = rate("web_search", pc.WebSearch)
	if err == nil && (pc.LongContextAbove < 0 || pc.LongContextAbove > 0 != (pc.LongContext != nil)) {
		err = errors.New("long_context_above and long_context go together (a threshold > 0 and its prices)")
	}
	return p, err
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

// Provision checks the config (errors name the field) and binds the store.
func (h *LLMBudget) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if err := h.compile(); err != nil {
		return err
	}
	if h.PricesFile != "" {
		h.logger.Info("prices_file read", zap.String("path", h.PricesFile), zap.Int("models_priced", h.prices.Len()))
	}
	e, err := enginesFrom(ctx)
	if err != nil {
		return fmt.Errorf("llmbudget: %w", err)
	}
	h.engines = e
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

// compile turns the JSON config into the budget engine's values.
func (h *LLMBudget) compile() error {
	if len(h.Budgets) == 0 {
		return errors.New("llmbudget: budgets: at least one budget is required")
	}
	if h.DefaultMaxTokens < 0 || h.DefaultMaxTokens > usage.MaxOutputCap {
		return fmt.Errorf("llmbudget: default_max_tokens: must be between 1 and %d", usage.MaxOutputCap)
	}
	h.defaultMaxTokens = cmp.Or(h.DefaultMaxTokens, DefaultMaxTokens)
	if err := h.compileOutputCap(); err != nil {
		return err
	}
	if h.MaxRequestBody < 0 {
		return errors.New("llmbudget: max_request_body: must be > 0")
	}
	if err := h.compileLeases(); err != nil {
		return err
	}
	if err := h.compileUnknown(); err != nil {
		return err
	}
	if err := h.compileInput(); err != nil {
		return err
	}
	if err := h.compileAnswers(); err != nil {
		return err
	}
	h.maxRequestBody = cmp.Or(h.MaxRequestBody, DefaultMaxRequestBody)
	h.format = usage.Unknown
	if h.Format != "" {
		f, err := usage.ParseFormat(h.Format)
		if err != nil {
			return fmt.Errorf("llmbudget: %w", err)
		}
		h.format = f
	}
	if err := h.compileRateLimitScopes(); err != nil {
		return err
	}
	if err := h.compileBudgets(); err != nil {
		return err
	}
	if err := h.compilePrices(); err != nil {
		return err
	}
	if h.Provider != "" && (strings.Trim(h.Provider, "abcdefghijklmnopqrstuvwxyz0123456789_-.") != "" || strings.Contains(h.Provider, "/")) {
		return fmt.Errorf("llmbudget: provider %q: want a provider as LiteLLM's price table names it, in lower case (groq, mistral, openrouter, ...)", h.Provider)
	}
	return h.compileDeployments()
}

// compileAnswers checks the options of how requests are answered: denial
// status, settle wait, unknown paths, store timeout and Retry-After.
func (h *LLMBudget) compileAnswers() error {
	if h.USDDenialStatus != 0 && h.USDDenialStatus != http.StatusTooManyRequests && h.USDDenialStatus != http.StatusPaymentRequired {
		return fmt.Errorf("llmbudget: usd_denial_status %d: want 429 or 402", h.USDDenialStatus)
	}
	h.settleWait = DefaultSettleWait
	if h.SettleWait != nil {
		if *h.SettleWait < 0 {
			return errors.New("llmbudget: settle_wait: must be 0 or more")
		}
		h.settleWait = time.Duration(*h.SettleWait)
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
	return nil
}

// compileBudgets turns Budgets into the engine's budgets and the
// RateLimit-Policy of those a response shows.
func (h *LLMBudget) compileBudgets() error {
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
		h.budgets = append(h.budgets, nameModels(b, h.Prices))
		if h.shownScopes.has(b.Scope) {
			policies = append(policies, policyItem(b.Name, b.Limit, b.NominalWindow()))
		}
	}
	h.policy = joinItems(policies)
	h.required = requiredScopes(h.Budgets, h.budgets)
	if h.hasUSD && len(h.Prices) == 0 && h.PricesFile == "" {
		// Every request would be refused as unpriced.
		return errors.New("llmbudget: price: a usd budget needs the price of each model it admits (price <model>[*] <input> <output> [<cached_input>], USD per 1M tokens, or prices_file <path>)")
	}
	return nil
}

// requiredScope is a scope whose value a request must name, and the first
// budget that requires it.
type requiredScope struct {
	scope  budget.Scope
	budget string
}

// requiredScopes are the key and team scopes whose budgets refuse a
// request without a value (missing_scope refuse, the default), once each.
func requiredScopes(configs []BudgetConfig, budgets []budget.Budget) []requiredScope {
	var req []requiredScope
	var seen scopeSet
	for i, b := range budgets {
		if (b.Scope != budget.PerKey && b.Scope != budget.PerTeam) || configs[i].MissingScope == missingScopeShared || seen.has(b.Scope) {
			continue
		}
		seen |= 1 << b.Scope
		req = append(req, requiredScope{b.Scope, b.Name})
	}
	return req
}

// compilePrices builds the price book: Prices over PricesFile's.
func (h *LLMBudget) compilePrices() error {
	prices := make(map[string]budget.Price, len(h.Prices))
	for model, pc := range h.Prices {
		p, err := pc.price()
		if err != nil {
			return fmt.Errorf("llmbudget: price %q: %w", model, err)
		}
		prices[model] = p
	}
	pb, err := budget.NewPriceBook(prices)
	if err != nil {
		return fmt.Errorf("llmbudget: %w", err)
	}
	if h.PricesFile != "" {
		file, err := loadPricesFile(h.PricesFile)
		if err != nil {
			return fmt.Errorf("llmbudget: prices_file: %w", err)
		}
		pb = pb.Under(file)
	}
	h.prices = pb
	return nil
}

// compileDeployments reads Deployments, by lower-case name.
func (h *LLMBudget) compileDeployments() error {
	h.deployments = make(map[string]string, len(h.Deployments))
	for name, model := range h.Deployments {
		if name == "" || model == "" || strings.ContainsAny(name, "/") {
			return fmt.Errorf("llmbudget: deployment %q: a deployment name (no slash) and a model are required", name)
		}
		key := strings.ToLower(name)
		if _, dup := h.deployments[key]; dup {
			return fmt.Errorf("llmbudget: deployment %q: defined twice (names are matched in lower case)", name)
		}
		h.deployments[key] = model
	}
	return nil
}

// loadPricesFile reads a LiteLLM price table.
func loadPricesFile(path string) (*budget.PriceBook, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pb, err := budget.ParseLiteLLM(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return pb, nil
}

func (bc *BudgetConfig) compile() (budget.Budget, error) {
	b := budget.Budget{Name: bc.Name, Window: time.Duration(bc.Window), AlertAt: bc.AlertAt}
	var err error
	if bc.Scope != "" {
		if b.Scope, err = budget.ParseScope(bc.Scope); err != nil {
			return b, fmt.Errorf("llmbudget: budget %q: %w", bc.Name, err)
		}
	}
	if bc.Unit == "" {
		return b, fmt.Errorf("llmbudget: budget %q: %s", bc.Name, errUnitRequired)
	}
	if b.Unit, err = budget.ParseUnit(bc.Unit); err != nil {
		return b, fmt.Errorf("llmbudget: budget %q: %w", bc.Name, err)
	}
	if bc.Limit == 0 {
		return b, fmt.Errorf("llmbudget: budget %q: limit is required (a number > 0)", bc.Name)
	}
	if b.Limit, err = limitIn(b.Unit, bc.Limit); err != nil {
		return b, fmt.Errorf("llmbudget: budget %q: limit %w", bc.Name, err)
	}
	if b.Fixed, b.Names, err = bc.compileLimitFor(&b); err != nil {
		return b, fmt.Errorf("llmbudget: budget %q: %w", bc.Name, err)
	}
	switch {
	case bc.Calendar != "" && bc.Window != 0:
		return b, fmt.Errorf("llmbudget: budget %q: window and calendar are both set: a budget has one window", bc.Name)
	case bc.Calendar != "":
		if b.Calendar, err = budget.ParseCalendar(bc.Calendar); err != nil {
			return b, fmt.Errorf("llmbudget: budget %q: %w", bc.Name, err)
		}
		if b.Location, err = time.LoadLocation(cmp.Or(bc.Timezone, "UTC")); err != nil {
			return b, fmt.Errorf("llmbudget: budget %q: timezone %q: %w", bc.Name, bc.Timezone, err)
		}
	case bc.Timezone != "":
		return b, fmt.Errorf("llmbudget: budget %q: timezone applies to a calendar window (window day, week or month)", bc.Name)
	case bc.Window == 0:
		return b, fmt.Errorf("llmbudget: budget %q: window is required", bc.Name)
	}
	switch {
	case bc.MissingScope != "" && bc.MissingScope != missingScopeRefuse && bc.MissingScope != missingScopeShared:
		return b, fmt.Errorf("llmbudget: budget %q: missing_scope %q: want refuse or shared", bc.Name, bc.MissingScope)
	case bc.MissingScope != "" && b.Scope != budget.PerKey && b.Scope != budget.PerTeam:
		return b, fmt.Errorf("llmbudget: budget %q: missing_scope applies to a key or team budget (a %s budget's value is never missing)", bc.Name, b.Scope)
	}
	if err := b.Validate(); err != nil {
		return b, fmt.Errorf("llmbudget: %w", err)
	}
	return b, nil
}

// errUnitRequired is the error of a budget that says no unit.
const errUnitRequired = "unit is required: tokens or usd (a limit counted in the wrong unit refuses every request, so there is no default)"

// limitIn is a limit of the config in the store's unit u: tokens, or
// micro-dollars for dollars. Its error completes "limit ...".
func limitIn(u budget.Unit, v float64) (int64, error) {
	// The store counts in int64 micro-units for either unit, so both stop
	// where a dollar limit would overflow.
	most := float64(math.MaxInt64) / budget.MicrosPerUSD
	switch {
	case !(v > 0):
		return 0, errors.New("must be > 0")
	case v > most:
		return 0, fmt.Errorf("must be at most %d", int64(most))
	case u == budget.Tokens && v != float64(int64(v)):
		return 0, errors.New("must be a whole number of tokens (a token limit)")
	case u == budget.USD:
		return budget.USDToMicros(v), nil
	}
	return int64(v), nil
}

// limitForError is an error of the limit_for entry at index i, so the
// Caddyfile reader can name that entry's line.
type limitForError struct {
	i   int
	err error
}

func (e *limitForError) Error() string { return fmt.Sprintf("limit_for[%d]: %v", e.i, e.err) }
func (e *limitForError) Unwrap() error { return e.err }

// compileLimitFor turns LimitFor into b's Fixed limits and the Names of the
// values it names (a key's is not kept: it is a secret), by scope id. An
// error about one entry is a *limitForError.
func (bc *BudgetConfig) compileLimitFor(b *budget.Budget) (map[string]int64, map[string]string, error) {
	if len(bc.LimitFor) == 0 {
		return nil, nil, nil
	}
	if b.Scope == budget.Global {
		return nil, nil, errors.New("limit_for: a global budget has no scope value; its limit is limit")
	}
	fixed, names := make(map[string]int64, len(bc.LimitFor)), make(map[string]string)
	for i, lf := range bc.LimitFor {
		hash := lf.ValueHash
		if (lf.Value == "") == (hash == "") {
			return nil, nil, &limitForError{i, errors.New("give value or value_hash, one of them")}
		}
		if lf.Value != "" {
			hash = keyhash.Of(lf.Value).String()
		}
		id, err := budget.HashedScopeID(b.Scope, hash)
		if err != nil {
			return nil, nil, &limitForError{i, fmt.Errorf("value_hash: %w", err)}
		}
		if _, dup := fixed[id]; dup {
			return nil, nil, &limitForError{i, errors.New("the value is given a limit twice")}
		}
		if fixed[id], err = limitIn(b.Unit, lf.Limit); err != nil {
			return nil, nil, &limitForError{i, fmt.Errorf("limit %w", err)}
		}
		if lf.Value != "" && b.Scope != budget.PerKey {
			names[id] = lf.Value
		}
	}
	return fixed, names, nil
}

// nameModels adds to a model budget's Names the models the price table
// names exactly (a pattern with * names none): the bounded set of values
// its metrics show. Other budgets are returned as they are.
func nameModels(b budget.Budget, prices map[string]PriceConfig) budget.Budget {
	if b.Scope != budget.PerModel {
		return b
	}
	names := maps.Clone(b.Names)
	if names == nil {
		names = make(map[string]string)
	}
	for model := range prices {
		if !strings.Contains(model, "*") {
			names[budget.ScopeID(&b, budget.Dims{Model: model})] = model
		}
	}
	b.Names = names
	return b
}

// Values of OverMaxOutputTokens.
const (
	overMaxOutputLower  = "lower"
	overMaxOutputRefuse = "refuse"
)

// compileOutputCap checks the cap options.
func (h *LLMBudget) compileOutputCap() error {
	h.chatCapField = usage.MaxCompletionTokens
	if h.ChatCapField != "" {
		c, err := usage.ParseChatCapField(h.ChatCapField)
		if err != nil {
			return fmt.Errorf("llmbudget: chat_cap_field: %w", err)
		}
		h.chatCapField = c
	}
	if h.MaxOutputTokens < 0 || h.MaxOutputTokens > usage.MaxOutputCap {
		return fmt.Errorf("llmbudget: max_output_tokens: must be between 1 and %d", usage.MaxOutputCap)
	}
	switch h.OverMaxOutputTokens {
	case "", overMaxOutputLower, overMaxOutputRefuse:
	default:
		return fmt.Errorf("llmbudget: over_max_output_tokens %q: want lower or refuse", h.OverMaxOutputTokens)
	}
	if h.OverMaxOutputTokens != "" && h.MaxOutputTokens == 0 {
		return fmt.Errorf("llmbudget: over_max_output_tokens needs max_output_tokens")
	}
	return nil
}

// Input the body does not show (a Responses request continuing a stored
// conversation, a file by reference, a server tool that fetches pages) is
// billed by the upstream all the same, up to the model's context window. A
// budget that is a ceiling holds that much for such a request, or refuses
// it, by HiddenInput.
const (
	// DefaultContextWindow is ContextWindow's default: the largest input
	// the common models take (GPT-4.1, Gemini 2.x, Claude with its 1M
	// window).
	DefaultContextWindow = 1_000_000

	hiddenInputHold   = "hold"
	hiddenInputRefuse = "refuse"
)

// compileInput checks the input options.
func (h *LLMBudget) compileInput() error {
	switch h.HiddenInput {
	case "", hiddenInputHold, hiddenInputRefuse:
	default:
		return fmt.Errorf("llmbudget: hidden_input %q: want hold or refuse", h.HiddenInput)
	}
	if h.ContextWindow < 0 || h.ContextWindow > 1<<40 {
		return fmt.Errorf("llmbudget: context_window: must be between 1 and %d", int64(1)<<40)
	}
	h.contextWindow = h.ContextWindow
	if h.contextWindow == 0 {
		h.contextWindow = DefaultContextWindow
	}
	return nil
}

// DefaultOutputLeaseMin is the smallest output lease, and the first one of a
// model with no history.
const DefaultOutputLeaseMin = 256

// DefaultReasoningModels are the model patterns that reason by default and
// bill reasoning tokens they do not stream: OpenAI's o-series and GPT-5,
// Gemini 2.5 and 3 (thinking on by default), xAI's Grok 3 mini and Grok 4, and
// any "thinking" model. A * matches any run of characters; a pattern matches
// the model as named or after its last "/" (openai/o3 via a router).
var DefaultReasoningModels = []string{"o1*", "o3*", "o4*", "gpt-5*", "codex-*", "gemini-2.5-*", "gemini-3*", "grok-3-mini*", "grok-4*", "*thinking*"}

// DefaultTokenizers are the models counted by their own public tokenizer
// by default, by vocabulary: OpenAI's, whose tokenizers are published
// (tiktoken). Anthropic's and Google's are not: their models count a token
// a byte.
var DefaultTokenizers = map[string][]string{
	"o200k_base": {"gpt-4o*", "chatgpt-4o*", "gpt-4.1*", "gpt-4.5*", "gpt-5*", "o1*", "o3*", "o4*",
		"ft:gpt-4o*", "ft:gpt-4.1*"},
	"cl100k_base": {"gpt-4", "gpt-4-*", "gpt-3.5-turbo*", "gpt-35-turbo*", "text-embedding-3*",
		"ft:gpt-4-*", "ft:gpt-3.5-turbo*"},
}

// DefaultProxyTokenizers are the models counted by another model's
// tokenizer, scaled to what they bill, by default: every model not counted
// by its own.
var DefaultProxyTokenizers = map[string][]string{"o200k_base": {"*"}}

// tokenizerPatterns are the model patterns of one vocabulary.
type tokenizerPatterns struct {
	vocab    bpe.Vocabulary
	patterns []string
}

// compileTokenizers checks the tokenizers and proxy_tokenizers options.
func (h *LLMBudget) compileTokenizers() (err error) {
	if h.tokenizers, err = compileTokenizerTable("tokenizers", h.Tokenizers, DefaultTokenizers); err != nil {
		return err
	}
	h.proxyTokenizers, err = compileTokenizerTable("proxy_tokenizers", h.ProxyTokenizers, DefaultProxyTokenizers)
	return err
}

// compileTokenizerTable checks a table of vocabularies' model patterns
// (def when m is nil).
func compileTokenizerTable(field string, m, def map[string][]string) ([]tokenizerPatterns, error) {
	if m == nil {
		m = def
	}
	var table []tokenizerPatterns
	for name, patterns := range m {
		v, ok := bpe.ParseVocabulary(name)
		if !ok {
			return nil, fmt.Errorf("llmbudget: %s: unknown vocabulary %q (want o200k_base or cl100k_base)", field, name)
		}
		tp := tokenizerPatterns{vocab: v}
		for _, p := range patterns {
			if strings.TrimSpace(p) == "" {
				return nil, fmt.Errorf("llmbudget: %s: %s: a pattern is empty", field, name)
			}
			tp.patterns = append(tp.patterns, strings.ToLower(p))
		}
		table = append(table, tp)
	}
	// o200k_base first, whatever the map's order.
	slices.SortFunc(table, func(a, b tokenizerPatterns) int { return cmp.Compare(a.vocab, b.vocab) })
	return table, nil
}

// compileLeases checks the lease options.
func (h *LLMBudget) compileLeases() error {
	h.outputLeases = h.OutputLeases == nil || *h.OutputLeases
	if h.OutputLeaseMin < 0 || h.OutputLeaseMin > usage.MaxOutputCap {
		return fmt.Errorf("llmbudget: output_lease_min: must be between 1 and %d", usage.MaxOutputCap)
	}
	h.outputLeaseMin = cmp.Or(h.OutputLeaseMin, DefaultOutputLeaseMin)
	h.reasoningModels = DefaultReasoningModels
	if h.ReasoningModels != nil {
		h.reasoningModels = make([]string, len(h.ReasoningModels))
		for i, p := range h.ReasoningModels {
			if strings.TrimSpace(p) == "" {
				return errors.New("llmbudget: reasoning_models: a pattern is empty")
			}
			h.reasoningModels[i] = strings.ToLower(p)
		}
	}
	return h.compileTokenizers()
}

// defaultRateLimitScopes are RateLimitScopes' default: a client's own.
var defaultRateLimitScopes = []string{"key", "team"}

// compileRateLimitScopes reads RateLimitScopes; the error names the field.
func (h *LLMBudget) compileRateLimitScopes() error {
	names := h.RateLimitScopes
	if names == nil {
		names = defaultRateLimitScopes
	}
	h.shownScopes = 0
	for _, name := range names {
		sc, err := budget.ParseScope(name)
		if err != nil {
			return fmt.Errorf("llmbudget: ratelimit_scopes: %w", err)
		}
		if h.shownScopes.has(sc) {
			return fmt.Errorf("llmbudget: ratelimit_scopes: %s is listed twice", name)
		}
		h.shownScopes |= 1 << sc
	}
	return nil
}

// bindCounters looks up the handler's requests_total series once, off the
// request path.
func (h *LLMBudget) bindCounters() {
	h.decisions = make([][numDecisions]prometheus.Counter, len(h.budgets))
	h.firstUSD = 0
	for i, b := range h.budgets {
		for d := range numDecisions {
			h.decisions[i][d] = metrics.llmRequests.WithLabelValues(b.Name, decisionNames[d])
		}
		if b.Unit == budget.USD && h.budgets[h.firstUSD].Unit != budget.USD {
			h.firstUSD = i
		}
	}
	h.rejected = metrics.llmRequests.WithLabelValues("", "rejected")
	h.shadowRejected = metrics.llmRequests.WithLabelValues("", "shadow_rejected")
	// The series a dashboard queries, at 0 until the first settle.
	for _, b := range h.budgets {
		metrics.llmCharged.WithLabelValues(b.Name, b.Unit.String())
		if b.Unit == budget.USD {
			metrics.llmChargedUSD.WithLabelValues(b.Name)
		}
		if b.Scope == budget.PerKey {
			metrics.llmKeysDenied.WithLabelValues(b.Name)
		}
		for _, pct := range b.AlertAt {
			metrics.llmThresholds.WithLabelValues(b.Name, strconv.Itoa(pct))
		}
	}
	for model := range h.Prices {
		metrics.llmCost.WithLabelValues(model)
		for _, kind := range []string{"input", "cached_input", "output"} {
			metrics.llmTokens.WithLabelValues(model, kind)
		}
	}
}

// decision is what llmbudget did with a request, a label of requests_total.
type decision int

const (
	decisionAdmitted decision = iota
	decisionDenied
	decisionShadowDenied
	decisionStoreError
	decisionFailOpen
	numDecisions
)

var decisionNames = [numDecisions]string{"admitted", "denied", "shadow_denied", "store_error", "fail_open"}

// DefaultSettleWait is SettleWait's default.
const DefaultSettleWait = 2 * time.Second
