package budget

import (
	"os"
	"strings"
	"testing"
)

const liteLLMFixture = "testdata/litellm-prices.json"

func loadFixture(t testing.TB) *PriceBook {
	t.Helper()
	data, err := os.ReadFile(liteLLMFixture)
	if err != nil {
		t.Fatal(err)
	}
	pb, err := ParseLiteLLM(data)
	if err != nil {
		t.Fatal(err)
	}
	return pb
}

// TestLiteLLMFixturePricesTheModels: the fixture loads, its per-token prices
// become exact rates, and dated and prefixed names resolve to their entry.
func TestLiteLLMFixturePricesTheModels(t *testing.T) {
	pb := loadFixture(t)
	tests := []struct {
		model, entry string
		want         Price
	}{
		{"gpt-4o", "gpt-4o", Price{
			Rates:          Rates{Input: 2_500_000, CacheRead: 1_250_000, Output: 10_000_000},
			Priority:       Rates{Input: 4_250_000, CacheRead: 2_125_000, Output: 17_000_000},
			Batch:          Rates{Input: 1_250_000, Output: 5_000_000},
			MaxInputTokens: 128_000,
		}},
		{"gpt-4o-2024-08-06", "gpt-4o-2024-08-06", Price{
			Rates:          Rates{Input: 2_500_000, CacheRead: 1_250_000, Output: 10_000_000},
			Batch:          Rates{Input: 1_250_000, Output: 5_000_000},
			MaxInputTokens: 128_000,
		}},
		{"claude-sonnet-4-5-20250929", "claude-sonnet-4-5-20250929", Price{
			Rates:            Rates{Input: 3_000_000, CacheRead: 300_000, CacheWrite: 3_750_000, CacheWrite1h: 6_000_000, Output: 15_000_000},
			LongContextAbove: 200_000,
			LongContext:      Rates{Input: 6_000_000, CacheRead: 600_000, CacheWrite: 7_500_000, CacheWrite1h: 12_000_000, Output: 22_500_000},
			WebSearchCall:    10_000,
			MaxInputTokens:   200_000,
		}},
		{"o4-mini", "o4-mini", Price{
			Rates:          Rates{Input: 1_100_000, CacheRead: 275_000, Output: 4_400_000},
			Flex:           Rates{Input: 550_000, CacheRead: 137_500, Output: 2_200_000},
			Priority:       Rates{Input: 2_000_000, CacheRead: 500_000, Output: 8_000_000},
			MaxInputTokens: 200_000,
		}},
		{"text-embedding-3-small", "text-embedding-3-small", Price{
			Rates: Rates{Input: 20_000}, Batch: Rates{Input: 10_000}, MaxInputTokens: 8191,
		}},
	}
	for _, tt := range tests {
		name, p, ok := pb.Find(tt.model)
		if !ok || name != tt.entry || p != tt.want {
			t.Errorf("Find(%q) = %q %+v %v,\nwant %q %+v", tt.model, name, p, ok, tt.entry, tt.want)
		}
	}
	for model, entry := range map[string]string{
		"claude-opus-4-1-20250805":   "claude-opus-4-1-20250805",
		"claude-sonnet-4-5-20991231": "claude-sonnet-4-5",
		"anthropic/claude-haiku-4-5": "claude-haiku-4-5",
		"openai/gpt-4o-2024-08-06":   "gpt-4o-2024-08-06",
		"gpt-4o-2099-01-01":          "gpt-4o",
		"azure/gpt-4o":               "azure/gpt-4o",
		"gemini-2.5-pro":             "gemini-2.5-pro",
	} {
		if name, _, ok := pb.Find(model); !ok || name != entry {
			t.Errorf("Find(%q) = %q %v, want %q", model, name, ok, entry)
		}
	}
	for _, skipped := range []string{"sample_spec", "dall-e-3", "gpt-image-1", "whisper-1", "tts-1", "o3-pro-2099-01-01x"} {
		if name, _, ok := pb.Find(skipped); ok {
			t.Errorf("Find(%q) = %q: an entry of another mode, or no model, is skipped", skipped, name)
		}
	}
}

// TestLiteLLMRefusesAMalformedTable: a field read that is wrong refuses
// the whole table, the error naming the entry and the field; fields not
// read, and entries skipped, are not checked.
func TestLiteLLMRefusesAMalformedTable(t *testing.T) {
	tests := []struct {
		name, table, want string
	}{
		{"a price as a string", `{"m": {"mode": "chat", "input_cost_per_token": "1e-6", "output_cost_per_token": 1e-6}}`, `entry "m": field "input_cost_per_token"`},
		{"a negative price", `{"m": {"mode": "chat", "input_cost_per_token": 1e-6, "output_cost_per_token": -1e-6}}`, `entry "m": field "output_cost_per_token"`},
		{"a tier price", `{"m": {"mode": "chat", "input_cost_per_token": 1e-6, "output_cost_per_token": 1e-6, "input_cost_per_token_priority": true}}`, `field "input_cost_per_token_priority"`},
		{"a long-context price", `{"m": {"mode": "chat", "input_cost_per_token": 1e-6, "output_cost_per_token": 1e-6, "input_cost_per_token_above_200k_tokens": "x"}}`, `field "input_cost_per_token_above_200k_tokens"`},
		{"a search fee", `{"m": {"mode": "chat", "input_cost_per_token": 1e-6, "output_cost_per_token": 1e-6, "search_context_cost_per_query": 0.01}}`, `field "search_context_cost_per_query"`},
		{"a search fee's size", `{"m": {"mode": "chat", "input_cost_per_token": 1e-6, "output_cost_per_token": 1e-6, "search_context_cost_per_query": {"search_context_size_high": "a"}}}`, `field "search_context_cost_per_query.search_context_size_high"`},
		{"a context window", `{"m": {"mode": "chat", "input_cost_per_token": 1e-6, "output_cost_per_token": 1e-6, "max_input_tokens": 1.5}}`, `field "max_input_tokens"`},
		{"a mode", `{"m": {"mode": 3}}`, `entry "m": field "mode"`},
		{"bad syntax", `{"m": {"mode": "chat",}}`, `not a LiteLLM price table`},
		{"not a table", `[1, 2]`, `not a LiteLLM price table`},
		{"a price too large", `{"m": {"mode": "chat", "input_cost_per_token": 2, "output_cost_per_token": 1}}`, `field "input_cost_per_token"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseLiteLLM([]byte(tt.table))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("ParseLiteLLM = %v, want an error with %q", err, tt.want)
			}
		})
	}
	ok := `{"sample_spec": {"input_cost_per_token": "text"}, "last_updated": "2026-07-24",
		"img": {"mode": "image_generation", "input_cost_per_token": "x"},
		"unpriced": {"mode": "chat", "output_cost_per_token": 1e-6},
		"m": {"mode": "chat", "input_cost_per_token": 1.25e-07, "output_cost_per_token": 1e-05, "max_input_tokens": 2000000.0, "tpm": "x", "supports_vision": true, "input_cost_per_token_above_200k_tokens_priority": "x"}}`
	pb, err := ParseLiteLLM([]byte(ok))
	if err != nil {
		t.Fatal(err)
	}
	if pb.Len() != 1 {
		t.Errorf("kept %d entries, want 1 (m)", pb.Len())
	}
	if _, p, _ := pb.Find("m"); p.Input != 125_000 || p.Output != 10_000_000 || p.MaxInputTokens != 2_000_000 {
		t.Errorf("m = %+v", p)
	}
}

// TestLiteLLMLowestThreshold: of several long-context thresholds, the
// lowest and its prices count.
func TestLiteLLMLowestThreshold(t *testing.T) {
	pb, err := ParseLiteLLM([]byte(`{"m": {"mode": "chat", "input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6,
		"input_cost_per_token_above_272k_tokens": 3e-6, "input_cost_per_token_above_128k_tokens": 2e-6, "output_cost_per_token_above_128k_tokens": 4e-6}}`))
	if err != nil {
		t.Fatal(err)
	}
	_, p, _ := pb.Find("m")
	if p.LongContextAbove != 128_000 || p.LongContext != (Rates{Input: 2_000_000, Output: 4_000_000}) {
		t.Errorf("long context %d %+v", p.LongContextAbove, p.LongContext)
	}
}

// BenchmarkLoadLiteLLMFixture is what a load (or reload) of the fixture
// costs: reading and parsing the file into a price book.
func BenchmarkLoadLiteLLMFixture(b *testing.B) {
	for b.Loop() {
		data, err := os.ReadFile(liteLLMFixture)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := ParseLiteLLM(data); err != nil {
			b.Fatal(err)
		}
	}
}
