package budget

import (
	"errors"
	"math"
	"testing"
	"time"
)

func TestPriceBookLookup(t *testing.T) {
	pb, err := NewPriceBook(map[string]Price{
		"gpt-4o":       {Rates: Rates{Input: 2_500_000, Output: 10_000_000, CacheRead: 1_250_000}},
		"gpt-4o*":      {Rates: Rates{Input: 3_000_000, Output: 12_000_000}},
		"gpt-4o-mini*": {Rates: Rates{Input: 150_000, Output: 600_000}},
		"claude-*":     {Rates: Rates{Input: 3_000_000, Output: 15_000_000}},
	})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		model string
		want  int64 // input price
		found bool
	}{
		{"gpt-4o", 2500000, true},                // exact wins over a prefix
		{"gpt-4o-2024-08-06", 3000000, true},     // prefix
		{"gpt-4o-mini-2024-07-18", 150000, true}, // the longer prefix wins
		{"claude-sonnet-4-5", 3000000, true},
		{"gpt-5", 0, false},
		{"", 0, false},
	}
	for _, tt := range tests {
		_, p, ok := pb.Find(tt.model)
		if ok != tt.found || p.Input != tt.want {
			t.Errorf("Find(%q) = %v %v, want input %v found %v", tt.model, p, ok, tt.want, tt.found)
		}
	}
}

func TestPriceBookRejectsBadPrices(t *testing.T) {
	for _, bad := range []map[string]Price{
		{"m": {Rates: Rates{Input: -1}}},
		{"m": {Rates: Rates{Output: MaxRate + 1}}},
		{"m": {LongContext: Rates{Input: 1}}},
		{"": {Rates: Rates{Input: 1}}},
		{"*": {Rates: Rates{Input: 1}}},
	} {
		if _, err := NewPriceBook(bad); err == nil {
			t.Errorf("NewPriceBook(%v) must fail", bad)
		}
	}
}

func TestCostMicros(t *testing.T) {
	p := Price{Rates: Rates{Input: 2_500_000, Output: 10_000_000, CacheRead: 1_250_000}}
	tests := []struct {
		name string
		u    Usage
		want int64
	}{
		{"one million input tokens cost the input price", Usage{InputTokens: 1_000_000}, 2_500_000},
		{"output", Usage{OutputTokens: 1000}, 10_000},
		{"cached input is cheaper", Usage{InputTokens: 1000, CachedInputTokens: 1000}, 1250},
		{"mixed", Usage{InputTokens: 1000, CachedInputTokens: 400, OutputTokens: 100}, 600*2.5 + 400*1.25 + 100*10},
		{"rounds up", Usage{InputTokens: 1}, 3},
		{"cached above input is clamped", Usage{InputTokens: 10, CachedInputTokens: 50}, 13},
	}
	for _, tt := range tests {
		if got := p.CostMicros(tt.u); got != tt.want {
			t.Errorf("%s: %d, want %d", tt.name, got, tt.want)
		}
	}
}

func TestBudgetValidateAndWindows(t *testing.T) {
	bad := []Budget{
		{Name: "", Limit: 1, Window: time.Hour},
		{Name: "x", Limit: 0, Window: time.Hour},
		{Name: "x", Limit: 1, Window: 500 * time.Millisecond},
		{Name: "x", Limit: 1, Window: 1500 * time.Millisecond},
		{Name: "a:b", Limit: 1, Window: time.Hour},
	}
	for _, b := range bad {
		if err := b.Validate(); err == nil {
			t.Errorf("%+v must not validate", b)
		}
	}
	b := Budget{Name: "d", Limit: 1, Window: time.Hour}
	now := time.Unix(3600*10+5, 0)
	if b.WindowIndex(now) != 10 || !b.WindowEnd(now).Equal(time.Unix(3600*11, 0)) {
		t.Fatalf("window %d ends %v", b.WindowIndex(now), b.WindowEnd(now))
	}
	if _, err := ParseUnit("bananas"); err == nil {
		t.Error("unknown unit")
	}
	if _, err := ParseScope("galaxy"); err == nil {
		t.Error("unknown scope")
	}
	if USDToMicros(250.00) != 250_000_000 {
		t.Error("USDToMicros")
	}
}

func TestSpendOfRefusesWhatNoUpstreamReports(t *testing.T) {
	p := Price{Rates: Rates{Input: 10_000_000, Output: 10_000_000}}
	tests := []struct {
		name string
		u    Usage
		ok   bool
	}{
		{"an ordinary report", Usage{InputTokens: 1000, OutputTokens: 500}, true},
		{"nothing used", Usage{}, true},
		{"the largest count", Usage{InputTokens: MaxUsageTokens}, true},
		{"past the largest count", Usage{OutputTokens: MaxUsageTokens + 1}, false},
		{"a sum that overflows int64", Usage{InputTokens: 5e18, OutputTokens: 5e18}, false},
		{"a negative output", Usage{InputTokens: 10, OutputTokens: -5}, false},
		{"a negative input", Usage{InputTokens: -10}, false},
		{"a negative cached input", Usage{InputTokens: 10, CachedInputTokens: -1}, false},
		{"a cost that overflows", Usage{OutputTokens: 1e18}, false},
	}
	for _, tt := range tests {
		spend, err := p.SpendOf(tt.u)
		if tt.ok != (err == nil) {
			t.Errorf("%s: SpendOf(%+v) = %+v, %v; want ok %v", tt.name, tt.u, spend, err, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrUsageOutOfRange) {
			t.Errorf("%s: error %v does not wrap ErrUsageOutOfRange", tt.name, err)
		}
		if err == nil && (spend.Tokens < 0 || spend.CostMicros < 0) {
			t.Errorf("%s: negative spend %+v", tt.name, spend)
		}
	}
	// Tokens alone in range, at a price of 0: within both bounds.
	if _, err := (Price{}).SpendOf(Usage{InputTokens: MaxUsageTokens, OutputTokens: MaxUsageTokens}); err != nil {
		t.Errorf("free model at the largest counts: %v", err)
	}
}

func TestAddCountsRefusesNegativesAndOverflow(t *testing.T) {
	for _, tt := range []struct {
		counts []int64
		want   int64
	}{
		{[]int64{1, 2, 3}, 6},
		{nil, 0},
		{[]int64{10, -1}, -1},
		{[]int64{math.MaxInt64, 1}, -1},
		{[]int64{math.MaxInt64 - 1, 1}, math.MaxInt64},
	} {
		if got := AddCounts(tt.counts...); got != tt.want {
			t.Errorf("AddCounts(%v) = %d, want %d", tt.counts, got, tt.want)
		}
	}
}
