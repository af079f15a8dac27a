package budget

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"
)

// Price is what a model costs, in USD per one million tokens.
type Price struct {
	Input       float64
	Output      float64
	CachedInput float64 // cached input tokens; 0 means the input price
}

// Usage is what one request used, as the upstream reports it.
type Usage struct {
	// InputTokens is every input token, cached ones included.
	InputTokens int64
	// CachedInputTokens is the part of InputTokens read from a prompt cache.
	CachedInputTokens int64
	OutputTokens      int64
}

// Tokens is input plus output.
func (u Usage) Tokens() int64 { return u.InputTokens + u.OutputTokens }

// PriceBook maps models to prices. A model name ending in * matches every
// model it is a prefix of, so "gpt-4o*" prices "gpt-4o-2024-08-06"; an exact
// name wins over a prefix, and a longer prefix over a shorter one.
type PriceBook struct {
	exact    map[string]Price
	prefixes []prefixPrice // longest first
}

type prefixPrice struct {
	prefix string
	name   string // prefix + "*", as configured
	price  Price
}

// NewPriceBook validates prices given by model name.
func NewPriceBook(prices map[string]Price) (*PriceBook, error) {
	pb := &PriceBook{exact: make(map[string]Price)}
	for model, p := range prices {
		if model == "" || model == "*" {
			return nil, fmt.Errorf("price %q: a model name is required", model)
		}
		for _, v := range []float64{p.Input, p.Output, p.CachedInput} {
			if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) {
				return nil, fmt.Errorf("price %q: prices must be finite and >= 0", model)
			}
		}
		if p.CachedInput == 0 {
			p.CachedInput = p.Input
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

// Find returns the price of model and the price book's name for the entry
// that priced it: the model itself, or a prefix entry such as "gpt-4o*". The
// names are a bounded set, fit for a metric label.
func (pb *PriceBook) Find(model string) (name string, p Price, ok bool) {
	if pb == nil {
		return "", Price{}, false
	}
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
	}{{"input", u.InputTokens}, {"cached input", u.CachedInputTokens}, {"output", u.OutputTokens}} {
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

// CostMicros is the cost of usage in micro-dollars, rounded up: a budget never
// undercharges by rounding. (USD per 1M tokens equals micro-USD per token.)
// The result of counts past MaxUsageTokens is undefined: use SpendOf for
// counts an upstream reported.
func (p Price) CostMicros(u Usage) int64 {
	cached := min(max(u.CachedInputTokens, 0), u.InputTokens)
	uncached := u.InputTokens - cached
	c := float64(uncached)*p.Input + float64(cached)*p.CachedInput + float64(u.OutputTokens)*p.Output
	if c >= math.MaxInt64 {
		return math.MaxInt64 // converting it would give an implementation-defined value
	}
	return int64(math.Ceil(c - 1e-9))
}
