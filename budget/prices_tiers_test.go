package budget

import "testing"

// TestCostOfEachDimension: every kind of token is billed at its own rate,
// and each kind is a part of its total, never on top of it.
func TestCostOfEachDimension(t *testing.T) {
	sonnet := Price{
		Rates:            Rates{Input: 3_000_000, CacheRead: 300_000, CacheWrite: 3_750_000, CacheWrite1h: 6_000_000, Output: 15_000_000},
		LongContextAbove: 200_000,
		LongContext:      Rates{Input: 6_000_000, CacheRead: 600_000, CacheWrite: 7_500_000, Output: 22_500_000},
		WebSearchCall:    10_000,
	}
	gpt4o := Price{
		Rates:    Rates{Input: 2_500_000, CacheRead: 1_250_000, Output: 10_000_000},
		Priority: Rates{Input: 4_250_000, CacheRead: 2_125_000, Output: 17_000_000},
		Flex:     Rates{Input: 1_250_000, Output: 5_000_000},
	}
	audio := Price{Rates: Rates{Input: 2_500_000, AudioInput: 40_000_000, Output: 10_000_000, AudioOutput: 80_000_000}}
	tests := []struct {
		name  string
		price Price
		u     Usage
		want  int64
	}{
		// 1000*3 + 2000*0.3 = 3600
		{"cache read", sonnet, Usage{InputTokens: 3000, CachedInputTokens: 2000}, 3600},
		// 1000*3 + 1000*3.75 + 1000*6 + 100*15 = 14250
		{"5-minute and 1-hour cache writes", sonnet, Usage{InputTokens: 3000, CacheWriteTokens: 1000, CacheWrite1hTokens: 1000, OutputTokens: 100}, 14_250},
		// the whole request at the long tier: 250000*6 + 1000*22.5 = 1522500
		{"above the long-context threshold", sonnet, Usage{InputTokens: 250_000, OutputTokens: 1000}, 1_522_500},
		// at the threshold, the standard rates: 200000*3 = 600000
		{"at the threshold", sonnet, Usage{InputTokens: 200_000}, 600_000},
		// 1h writes above 200k scale with the input: 210000*6 + ... 10000 1h at 12 = 200000*6 + 10000*12
		{"1-hour writes above the threshold", sonnet, Usage{InputTokens: 210_000, CacheWrite1hTokens: 10_000}, 1_320_000},
		// 2 searches at $0.01 = 20000, plus 10*3 = 30
		{"web search calls", sonnet, Usage{InputTokens: 10, WebSearchCalls: 2}, 20_030},
		// 1000*4.25 + 100*17 = 5950
		{"priority", gpt4o, Usage{InputTokens: 1000, OutputTokens: 100, ServiceTier: PriorityTier}, 5950},
		// flex cache reads scale as flex input does: 500*1.25 + 500*0.625 + 100*5 = 1437.5 -> 1438
		{"flex, cache read scaled", gpt4o, Usage{InputTokens: 1000, CachedInputTokens: 500, OutputTokens: 100, ServiceTier: FlexTier}, 1438},
		// a tier without rates is standard: 1000*2.5 = 2500
		{"batch unpriced is standard", gpt4o, Usage{InputTokens: 1000, ServiceTier: BatchTier}, 2500},
		// 100*2.5 + 900*40 + 50*10 + 50*80 = 250+36000+500+4000
		{"audio in and out", audio, Usage{InputTokens: 1000, AudioInputTokens: 900, OutputTokens: 100, AudioOutputTokens: 50}, 40_750},
		// reasoning is output at the output rate: 100*10
		{"reasoning inside output", gpt4o, Usage{OutputTokens: 100, ReasoningTokens: 80}, 1000},
		// parts above their total are clamped: 10 cached of 10
		{"a part above its total", gpt4o, Usage{InputTokens: 10, CachedInputTokens: 50, AudioInputTokens: 50}, 13},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.price.CostMicros(tt.u); got != tt.want {
				t.Errorf("CostMicros(%+v) = %d, want %d", tt.u, got, tt.want)
			}
		})
	}
}

// TestPriorityLongContextScales: a service tier above the long-context
// threshold pays the long-context rates as the tier's are to the standard.
func TestPriorityLongContextScales(t *testing.T) {
	p := Price{
		Rates:            Rates{Input: 1_000_000, Output: 2_000_000},
		LongContextAbove: 100,
		LongContext:      Rates{Input: 2_000_000, Output: 3_000_000},
		Priority:         Rates{Input: 2_000_000, Output: 4_000_000},
	}
	// 1000*2*2 + 1000*3*2 = 10000
	if got := p.CostMicros(Usage{InputTokens: 1000, OutputTokens: 1000, ServiceTier: PriorityTier}); got != 10_000 {
		t.Errorf("priority above the threshold: %d, want 10000", got)
	}
}

// TestResolveModel: dated and provider-prefixed names resolve to their
// entry; a variant never resolves to its base.
func TestResolveModel(t *testing.T) {
	pb, err := NewPriceBook(map[string]Price{
		"gpt-4o":            {Rates: Rates{Input: 1}},
		"gpt-4o-2024-08-06": {Rates: Rates{Input: 2}},
		"claude-sonnet-4-5": {Rates: Rates{Input: 3}},
		"gemini-2.5-pro":    {Rates: Rates{Input: 4}},
		"o3":                {Rates: Rates{Input: 5}},
	})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		model, want string
	}{
		{"gpt-4o-2024-08-06", "gpt-4o-2024-08-06"},
		{"gpt-4o-2024-11-20", "gpt-4o"},
		{"openai/gpt-4o", "gpt-4o"},
		{"azure/gpt-4o-2024-05-13", "gpt-4o"},
		{"claude-sonnet-4-5-20250929", "claude-sonnet-4-5"},
		{"anthropic/claude-sonnet-4-5-20250929", "claude-sonnet-4-5"},
		{"gemini-2.5-pro-preview-06-05", "gemini-2.5-pro"},
		{"gemini-2.5-pro-exp-03-25", "gemini-2.5-pro"},
		{"o3-pro", ""},
		{"o3-pro-2025-06-10", ""},
		{"gpt-4o-mini-2024-07-18", ""},
		{"gpt-4o-audio-preview", ""},
		{"-2024", ""},
		{"openai/", ""},
	}
	for _, tt := range tests {
		name, _, ok := pb.Find(tt.model)
		if name != tt.want || ok != (tt.want != "") {
			t.Errorf("Find(%q) = %q %v, want %q", tt.model, name, ok, tt.want)
		}
	}
}

// TestPriceLinesWinOverTheFile: a book's entries that resolve a name win
// over its fallback's exact entry.
func TestPriceLinesWinOverTheFile(t *testing.T) {
	file, _ := NewPriceBook(map[string]Price{
		"gpt-4o-2024-08-06": {Rates: Rates{Input: 1}}, "gpt-5": {Rates: Rates{Input: 7}},
		"gpt-4o-mini": {Rates: Rates{Input: 8}}, "azure/gpt-4o-mini-2024-07-18": {Rates: Rates{Input: 9}},
	})
	lines, _ := NewPriceBook(map[string]Price{"gpt-4o": {Rates: Rates{Input: 2}}, "gpt-4o-mini*": {Rates: Rates{Input: 3}}})
	pb := lines.Under(file)
	for _, tt := range []struct {
		model, entry string
		input        int64
	}{
		{"gpt-4o-2024-08-06", "gpt-4o", 2},                  // a line resolved beats the file's exact entry
		{"openai/gpt-4o-mini", "gpt-4o-mini*", 3},           // a line's prefix, past a provider prefix
		{"azure/gpt-4o-mini-2024-07-18", "gpt-4o-mini*", 3}, // likewise
		{"gpt-5", "gpt-5", 7},                               // the file where no line prices it
	} {
		if name, p, _ := pb.Find(tt.model); name != tt.entry || p.Input != tt.input {
			t.Errorf("Find(%q) = %q %d, want %q %d", tt.model, name, p.Input, tt.entry, tt.input)
		}
	}
	if pb.Len() != 6 {
		t.Errorf("Len = %d, want 6", pb.Len())
	}
}

// TestDecimalsAreReadExactly: a price in USD per 1M tokens becomes its
// rate exactly, never through a float, rounded up past the micro-dollar.
func TestDecimalsAreReadExactly(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"2.5", 2_500_000, true},
		{"0.3", 300_000, true},
		{"0.075", 75_000, true},
		{"1.25e-1", 125_000, true},
		{"0.0000001", 1, true}, // rounded up
		{"-1", 0, false},
		{"1/3", 0, false},
		{"abc", 0, false},
		{"1e30", 0, false},
	} {
		got, err := decimalTimes(tt.in, 1_000_000)
		if got != tt.want || (err == nil) != tt.ok {
			t.Errorf("decimalTimes(%q) = %d, %v; want %d ok %v", tt.in, got, err, tt.want, tt.ok)
		}
	}
}
