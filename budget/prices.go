package budget

import (
	"errors"
	"fmt"
	"math"
	"math/big"
	"math/bits"
	"sort"
	"strings"
)

// Rates are what each kind of token costs in one tier of a model's price,
// in micro-dollars per one million tokens (USD per 1M tokens times
// 1,000,000: $2.50 is 2_500_000), so a cost in micro-dollars is exact
// integer arithmetic. A zero rate other than Input and Output takes its
// default, named on each.
type Rates struct {
	// Input is a prompt token's price, of text and of any kind below
	// without its own rate.
	Input int64
	// CacheRead is a token read from a prompt cache (OpenAI's cached_tokens,
	// Anthropic's cache_read_input_tokens, Gemini's cachedContentTokenCount).
	// Default Input.
	CacheRead int64
	// CacheWrite is a token written to a prompt cache that lives 5 minutes
	// (Anthropic: 1.25x Input). Default Input.
	CacheWrite int64
	// CacheWrite1h is a token written to a cache that lives one hour
	// (Anthropic: 2x Input). Default CacheWrite.
	CacheWrite1h int64
	// AudioInput is an audio prompt token. Default Input.
	AudioInput int64
	// Output is a generated token, reasoning included.
	Output int64
	// Reasoning is a reasoning (thinking) token, part of the output. Default
	// Output, which is what OpenAI, Anthropic and Google bill.
	Reasoning int64
	// AudioOutput is a generated audio token. Default Output.
	AudioOutput int64
}

// Price is what a model costs: the rates of its standard tier, those of its
// long-context tier and of each service tier it has, and the fees it bills
// per call.
type Price struct {
	Rates
	// LongContextAbove is the prompt size, in input tokens of every kind,
	// above which the whole request (not just the excess) is billed at
	// LongContext's rates: 200,000 for Claude Sonnet 4.x and Gemini 2.5 Pro.
	// 0: the model has no long-context tier.
	LongContextAbove int64
	// LongContext is the long-context tier. A zero rate is its standard rate
	// scaled as LongContext's Input (input kinds) or Output (output kinds)
	// is to the standard one.
	LongContext Rates
	// Flex, Priority and Batch are the rates of OpenAI's service tiers (the
	// tier is the one the response says served it). A tier whose Input and
	// Output are 0 is billed at the standard rates; another zero rate is
	// scaled from the standard one as for LongContext.
	Flex, Priority, Batch Rates
	// WebSearchCall is the fee of one server-side web search the usage
	// reports (Anthropic's server_tool_use.web_search_requests), in
	// micro-dollars: $10 per 1,000 is 10_000. Default 0.
	WebSearchCall int64
	// MaxInputTokens is the model's context window as its price table says
	// (prices_file's max_input_tokens); 0 unknown. It does not bound what a
	// request with hidden input holds: a table's window can be below what
	// the provider bills (LiteLLM gives claude-sonnet-4-5 200,000, where
	// Anthropic's 1M-context beta bills up to 1,000,000).
	MaxInputTokens int64
}

// MaxRate is the largest rate accepted, about $1.1 million per 1M tokens:
// far above any model's (a table's typo included), and small enough that no
// request's cost can wrap 128 bits.
const MaxRate = 1 << 40

// ServiceTier is the processing tier that served a request, which OpenAI
// prices apart.
type ServiceTier uint8

const (
	// StandardTier is the default tier ("default", "auto", or none said).
	StandardTier ServiceTier = iota
	// FlexTier is OpenAI's flex processing: about half price.
	FlexTier
	// PriorityTier is OpenAI's priority processing: about twice the price.
	PriorityTier
	// BatchTier is the batch API's half price.
	BatchTier
)

func (t ServiceTier) String() string {
	switch t {
	case FlexTier:
		return "flex"
	case PriorityTier:
		return "priority"
	case BatchTier:
		return "batch"
	}
	return "standard"
}

// ParseServiceTier reads a service_tier as an API says it: "flex",
// "priority" and "batch" name their tiers; any other value ("default",
// "auto", "standard", none) is the standard tier.
func ParseServiceTier(s string) ServiceTier {
	switch s {
	case "flex":
		return FlexTier
	case "priority":
		return PriorityTier
	case "batch":
		return BatchTier
	}
	return StandardTier
}

// Usage is what one request used, as the upstream reports it: the billed
// dimensions the providers break out. The kinds of input are parts of
// InputTokens, those of output parts of OutputTokens; the token budgets
// count InputTokens plus OutputTokens.
type Usage struct {
	// InputTokens is every input token: cached, written to a cache, audio
	// and tool-use prompt tokens included.
	InputTokens int64
	// CachedInputTokens is the part of InputTokens read from a prompt cache.
	CachedInputTokens int64
	// CacheWriteTokens is the part of InputTokens written to a prompt cache
	// that lives 5 minutes.
	CacheWriteTokens int64
	// CacheWrite1hTokens is the part of InputTokens written to a prompt
	// cache that lives one hour.
	CacheWrite1hTokens int64
	// AudioInputTokens is the part of InputTokens that is audio.
	AudioInputTokens int64
	// OutputTokens is every output token, reasoning and audio included.
	OutputTokens int64
	// ReasoningTokens is the part of OutputTokens spent reasoning.
	ReasoningTokens int64
	// AudioOutputTokens is the part of OutputTokens that is audio.
	AudioOutputTokens int64
	// WebSearchCalls is how many server-side web searches the request made.
	WebSearchCalls int64
	// ServiceTier is the tier that served the request.
	ServiceTier ServiceTier
}

// Tokens is input plus output.
func (u Usage) Tokens() int64 { return u.InputTokens + u.OutputTokens }

// WithInputOf is u with the input counts of in: its total and every kind.
func (u Usage) WithInputOf(in Usage) Usage {
	u.InputTokens, u.CachedInputTokens, u.AudioInputTokens = in.InputTokens, in.CachedInputTokens, in.AudioInputTokens
	u.CacheWriteTokens, u.CacheWrite1hTokens = in.CacheWriteTokens, in.CacheWrite1hTokens
	return u
}

// Ranges of what a settle accepts from an upstream: no request reads or
// writes 2^40 (about 10^12) tokens, and no request costs 2^53 micro-dollars
// (about 9 billion dollars). Counters stay far from int64's end, so no sum
// of settled amounts can wrap, in Go or in a Redis INCRBY.
const (
	MaxUsageTokens = 1 << 40
	MaxSpendMicros = 1 << 53
)

// ErrUsageOutOfRange is the error of a usage report no upstream can truly
// send: a negative count, or one past MaxUsageTokens or MaxSpendMicros. Such
// a report is usage unknown, never a charge of 0 or a wrapped-around one.
var ErrUsageOutOfRange = errors.New("usage out of range")

// AddCounts sums token counts as an upstream reported them. A negative count,
// or a sum past int64, gives -1: out of range for SpendOf, never a count that
// wrapped around or was floored to a free request.
func AddCounts(counts ...int64) int64 {
	var sum int64
	for _, c := range counts {
		if c < 0 || sum > math.MaxInt64-c {
			return -1
		}
		sum += c
	}
	return sum
}

// SpendOf is what u costs in both units, checked: a count that is negative
// or out of range, or a cost past MaxSpendMicros, fails with
// ErrUsageOutOfRange.
func (p Price) SpendOf(u Usage) (Spend, error) {
	for _, c := range [...]struct {
		name string
		v    int64
	}{
		{"input", u.InputTokens}, {"cached input", u.CachedInputTokens},
		{"cache write", u.CacheWriteTokens}, {"1-hour cache write", u.CacheWrite1hTokens},
		{"audio input", u.AudioInputTokens}, {"output", u.OutputTokens},
		{"reasoning", u.ReasoningTokens}, {"audio output", u.AudioOutputTokens},
		{"web search", u.WebSearchCalls},
	} {
		if c.v < 0 || c.v > MaxUsageTokens {
			return Spend{}, fmt.Errorf("%w: %s tokens %d", ErrUsageOutOfRange, c.name, c.v)
		}
	}
	cost := p.CostMicros(u)
	if cost < 0 || cost > MaxSpendMicros {
		return Spend{}, fmt.Errorf("%w: cost of %d input and %d output tokens", ErrUsageOutOfRange, u.InputTokens, u.OutputTokens)
	}
	return Spend{Tokens: u.Tokens(), CostMicros: cost}, nil
}

// CostMicros is the cost of usage in micro-dollars, rounded up once for the
// whole request: a budget never undercharges by rounding. The result of
// counts past MaxUsageTokens is undefined: use SpendOf for counts an
// upstream reported.
func (p Price) CostMicros(u Usage) int64 {
	cost := p.RatesFor(u).CostMicros(u)
	if calls := max(u.WebSearchCalls, 0); calls > 0 && p.WebSearchCall > 0 {
		hi, lo := bits.Mul64(uint64(calls), uint64(p.WebSearchCall))
		if hi != 0 || lo > math.MaxInt64-uint64(cost) {
			return math.MaxInt64
		}
		cost += int64(lo)
	}
	return cost
}

// RatesFor is the rates u is billed at: its service tier's, above the
// long-context threshold the long-context tier's (of that service tier,
// scaled), every default filled in.
func (p Price) RatesFor(u Usage) Rates {
	std := p.Rates.withDefaults()
	r := std
	switch u.ServiceTier {
	case FlexTier:
		r = p.Flex.scaledFrom(std)
	case PriorityTier:
		r = p.Priority.scaledFrom(std)
	case BatchTier:
		r = p.Batch.scaledFrom(std)
	}
	if p.LongContextAbove > 0 && u.InputTokens > p.LongContextAbove {
		long := p.LongContext.scaledFrom(std)
		if r != std {
			// A service tier's long context: the long-context rates, as the
			// tier's are to the standard ones.
			in := func(v int64) int64 { return scale(v, r.Input, std.Input) }
			out := func(v int64) int64 { return scale(v, r.Output, std.Output) }
			long = Rates{
				Input: in(long.Input), CacheRead: in(long.CacheRead), CacheWrite: in(long.CacheWrite),
				CacheWrite1h: in(long.CacheWrite1h), AudioInput: in(long.AudioInput),
				Output: out(long.Output), Reasoning: out(long.Reasoning), AudioOutput: out(long.AudioOutput),
			}
		}
		r = long
	}
	return r
}

// withDefaults fills in the rates that default to another.
func (r Rates) withDefaults() Rates {
	r.CacheRead = cmpOr(r.CacheRead, r.Input)
	r.CacheWrite = cmpOr(r.CacheWrite, r.Input)
	r.CacheWrite1h = cmpOr(r.CacheWrite1h, r.CacheWrite)
	r.AudioInput = cmpOr(r.AudioInput, r.Input)
	r.Reasoning = cmpOr(r.Reasoning, r.Output)
	r.AudioOutput = cmpOr(r.AudioOutput, r.Output)
	return r
}

// scaledFrom is the rates of a tier whose zero rates are base's, scaled as
// the tier's Input or Output is to base's; base when the tier has neither.
func (r Rates) scaledFrom(base Rates) Rates {
	if r.Input == 0 && r.Output == 0 {
		return base
	}
	r.Input = cmpOr(r.Input, base.Input)
	r.Output = cmpOr(r.Output, base.Output)
	in := func(v, b int64) int64 { return cmpOr(v, scale(b, r.Input, base.Input)) }
	out := func(v, b int64) int64 { return cmpOr(v, scale(b, r.Output, base.Output)) }
	r.CacheRead = in(r.CacheRead, base.CacheRead)
	r.CacheWrite = in(r.CacheWrite, base.CacheWrite)
	r.CacheWrite1h = in(r.CacheWrite1h, base.CacheWrite1h)
	r.AudioInput = in(r.AudioInput, base.AudioInput)
	r.Reasoning = out(r.Reasoning, base.Reasoning)
	r.AudioOutput = out(r.AudioOutput, base.AudioOutput)
	return r
}

// scale is v*num/den rounded up (v when den is 0 or num equals den).
func scale(v, num, den int64) int64 {
	if den <= 0 || num == den || v <= 0 {
		return v
	}
	hi, lo := bits.Mul64(uint64(v), uint64(max(num, 0)))
	if hi >= uint64(den) {
		return MaxRate
	}
	q, rem := bits.Div64(hi, lo, uint64(den))
	if rem != 0 {
		q++
	}
	return int64(min(q, MaxRate))
}

func cmpOr(v, def int64) int64 {
	if v != 0 {
		return v
	}
	return def
}

// CostMicros is what u costs at these rates (defaults already filled in),
// in micro-dollars rounded up, without per-call fees. Each kind is a part
// of its total, clamped to what is left: cache reads, 1-hour and 5-minute
// cache writes, then audio, of the input; reasoning, then audio, of the
// output.
func (r Rates) CostMicros(u Usage) int64 {
	in := max(u.InputTokens, 0)
	part := func(n int64) int64 {
		n = min(max(n, 0), in)
		in -= n
		return n
	}
	cached, w1h, w5m, audioIn := part(u.CachedInputTokens), part(u.CacheWrite1hTokens), part(u.CacheWriteTokens), part(u.AudioInputTokens)
	out := max(u.OutputTokens, 0)
	outPart := func(n int64) int64 {
		n = min(max(n, 0), out)
		out -= n
		return n
	}
	reasoning, audioOut := outPart(u.ReasoningTokens), outPart(u.AudioOutputTokens)
	var hi, lo uint64
	add := func(n, rate int64) {
		if n <= 0 || rate <= 0 {
			return
		}
		h, l := bits.Mul64(uint64(n), uint64(rate))
		var c uint64
		lo, c = bits.Add64(lo, l, 0)
		hi += h + c
	}
	add(in, r.Input)
	add(cached, r.CacheRead)
	add(w1h, r.CacheWrite1h)
	add(w5m, r.CacheWrite)
	add(audioIn, r.AudioInput)
	add(out, r.Output)
	add(reasoning, r.Reasoning)
	add(audioOut, r.AudioOutput)
	const perMillion = 1_000_000
	if hi >= perMillion {
		return math.MaxInt64
	}
	q, rem := bits.Div64(hi, lo, perMillion)
	if rem != 0 {
		q++
	}
	if q > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(q)
}

// validate checks every rate is within [0, MaxRate].
func (p Price) validate() error {
	for _, r := range []Rates{p.Rates, p.LongContext, p.Flex, p.Priority, p.Batch} {
		for _, v := range []int64{r.Input, r.CacheRead, r.CacheWrite, r.CacheWrite1h, r.AudioInput, r.Output, r.Reasoning, r.AudioOutput} {
			if v < 0 || v > MaxRate {
				return fmt.Errorf("prices must be >= 0 and at most %d micro-dollars per 1M tokens", int64(MaxRate))
			}
		}
	}
	switch {
	case p.WebSearchCall < 0 || p.WebSearchCall > MaxRate:
		return errors.New("a per-call fee must be >= 0 and at most 1,099,511 USD")
	case p.LongContextAbove < 0:
		return errors.New("a long-context threshold must be >= 0")
	case p.LongContextAbove == 0 && p.LongContext != Rates{}:
		return errors.New("long-context rates need a threshold")
	}
	return nil
}

// decimalTimes is the decimal s times mul, rounded up, exactly: s is read
// as a rational, never a float.
func decimalTimes(s string, mul int64) (int64, error) {
	r, ok := new(big.Rat).SetString(s)
	if !ok || strings.ContainsAny(s, "/xXpP_") {
		return 0, fmt.Errorf("%q is not a decimal number", s)
	}
	if r.Sign() < 0 {
		return 0, fmt.Errorf("%q is below 0", s)
	}
	r.Mul(r, new(big.Rat).SetInt64(mul))
	q, rem := new(big.Int).QuoRem(r.Num(), r.Denom(), new(big.Int))
	if rem.Sign() != 0 {
		q.Add(q, big.NewInt(1))
	}
	if !q.IsInt64() || q.Int64() > MaxRate {
		return 0, fmt.Errorf("%q is too large", s)
	}
	return q.Int64(), nil
}

// PriceBook maps models to prices. A model name ending in * matches every
// model it is a prefix of, so "gpt-4o*" prices "gpt-4o-2024-08-06"; an exact
// name wins over a prefix, and a longer prefix over a shorter one. A name
// no entry matches as given resolves as ResolveModel says (each name tried
// exact, then by prefix), first in the book's own entries, then in its
// fallback (a prices_file's book), so every entry of the book wins over the
// fallback's.
type PriceBook struct {
	exact    map[string]Price
	prefixes []prefixPrice // longest first
	fallback *PriceBook
}

type prefixPrice struct {
	prefix string
	name   string // prefix + "*", as configured
	price  Price
}

// NewPriceBook validates prices given by model name.
func NewPriceBook(prices map[string]Price) (*PriceBook, error) {
	pb := &PriceBook{exact: make(map[string]Price, len(prices))}
	for model, p := range prices {
		if model == "" || model == "*" {
			return nil, fmt.Errorf("price %q: a model name is required", model)
		}
		if err := p.validate(); err != nil {
			return nil, fmt.Errorf("price %q: %w", model, err)
		}
		if prefix, ok := strings.CutSuffix(model, "*"); ok {
			pb.prefixes = append(pb.prefixes, prefixPrice{prefix, model, p})
		} else {
			pb.exact[model] = p
		}
	}
	sort.Slice(pb.prefixes, func(i, j int) bool { return len(pb.prefixes[i].prefix) > len(pb.prefixes[j].prefix) })
	return pb, nil
}

// Under returns a book of pb's prices that falls back to under's for a model
// none of pb's entries resolves: pb's win. pb is not changed.
func (pb *PriceBook) Under(under *PriceBook) *PriceBook {
	if pb == nil {
		return under
	}
	out := *pb
	out.fallback = under
	return &out
}

// Len is how many entries the book holds, its fallback's included.
func (pb *PriceBook) Len() int {
	if pb == nil {
		return 0
	}
	return len(pb.exact) + len(pb.prefixes) + pb.fallback.Len()
}

// Find returns the price of model and the price book's name for the entry
// that priced it: the model itself, a prefix entry such as "gpt-4o*", or
// the entry the name resolves to (ResolveModel). The names are a bounded
// set, fit for a metric label.
func (pb *PriceBook) Find(model string) (name string, p Price, ok bool) {
	if pb == nil || model == "" {
		return "", Price{}, false
	}
	if name, p, ok = pb.findOwn(model); ok {
		return name, p, true
	}
	return pb.fallback.Find(model)
}

func (pb *PriceBook) findOwn(model string) (name string, p Price, ok bool) {
	if name, p, ok = pb.match(model); ok {
		return name, p, true
	}
	ResolveModel(model, func(n string) bool {
		name, p, ok = pb.match(n)
		return ok
	})
	return name, p, ok
}

// match is the book's own entry for model as given: exact, else the
// longest prefix.
func (pb *PriceBook) match(model string) (name string, p Price, ok bool) {
	if p, ok := pb.exact[model]; ok {
		return model, p, true
	}
	for _, pp := range pb.prefixes {
		if strings.HasPrefix(model, pp.prefix) {
			return pp.name, pp.price, true
		}
	}
	return "", Price{}, false
}

// ResolveModel tries the names model may be priced by, in order, until has
// reports one is known:
//
//  1. the name as given (has is asked for it by the caller first);
//  2. without a provider prefix: what follows the last "/"
//     ("openai/gpt-4o" is "gpt-4o");
//  3. without its trailing version segments, one "-" segment at a time,
//     the longest first: a segment of digits (a date, "-2024-08-06" or
//     "-20250929", or a build "-001"), "latest", "preview" or "exp"
//     ("claude-sonnet-4-5-20250929" is "claude-sonnet-4-5",
//     "gemini-2.5-pro-preview-06-05" is "gemini-2.5-pro").
//
// A segment that names a variant ("-mini", "-pro", "-audio") is never
// dropped: a variant priced as its base could cost a tenth of its bill,
// while an unpriced model is refused by a dollar budget.
func ResolveModel(model string, has func(name string) bool) {
	name := model
	if i := strings.LastIndexByte(name, '/'); i >= 0 && i < len(name)-1 {
		name = name[i+1:]
		if has(name) {
			return
		}
	}
	for {
		i := strings.LastIndexByte(name, '-')
		if i <= 0 || !versionSegment(name[i+1:]) {
			return
		}
		name = name[:i]
		if has(name) {
			return
		}
	}
}

// versionSegment reports whether s is a segment of a model name that names
// a version, not a variant.
func versionSegment(s string) bool {
	switch s {
	case "":
		return false
	case "latest", "preview", "exp":
		return true
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
