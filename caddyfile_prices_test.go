package fleetguard

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/fleetguard/fleetguard/budget"
)

// unmarshalLLMBudget reads an llmbudget block's body (its lines) as the
// Caddyfile adapter does, compile included.
func unmarshalLLMBudget(t *testing.T, body string) (*LLMBudget, error) {
	t.Helper()
	h := new(LLMBudget)
	err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("llmbudget {\n" + body + "\n}"))
	return h, err
}

// TestPriceLineDimensions: a price line says every billed dimension with a
// keyword, the old 3- and 4-number forms as before, and the book holds them
// as exact rates.
func TestPriceLineDimensions(t *testing.T) {
	const usd = "budget d {\nunit usd\nlimit 10\nwindow 1h\n}\n"
	tests := []struct {
		name, line, model string
		want              budget.Price
	}{
		{"three numbers", "price m 2.5 10", "m", budget.Price{Rates: budget.Rates{Input: 2_500_000, Output: 10_000_000}}},
		{"four numbers", "price m 2.5 10 1.25", "m", budget.Price{Rates: budget.Rates{Input: 2_500_000, Output: 10_000_000, CacheRead: 1_250_000}}},
		{"every keyword", "price claude-sonnet-4-5 3 15 0.3 cache_write 3.75 cache_write_1h 6 long_context 200000 6 22.5 web_search 0.01 audio 4 20 priority 5 25 flex 1.5 7.5 batch 1.5 7.5",
			"claude-sonnet-4-5-20250929", budget.Price{
				Rates:            budget.Rates{Input: 3_000_000, Output: 15_000_000, CacheRead: 300_000, CacheWrite: 3_750_000, CacheWrite1h: 6_000_000, AudioInput: 4_000_000, AudioOutput: 20_000_000},
				LongContextAbove: 200_000, LongContext: budget.Rates{Input: 6_000_000, Output: 22_500_000},
				Priority: budget.Rates{Input: 5_000_000, Output: 25_000_000}, Flex: budget.Rates{Input: 1_500_000, Output: 7_500_000},
				Batch: budget.Rates{Input: 1_500_000, Output: 7_500_000}, WebSearchCall: 10_000,
			}},
		{"keywords without cached input", "price m 1 2 cache_write 1.25", "m", budget.Price{Rates: budget.Rates{Input: 1_000_000, Output: 2_000_000, CacheWrite: 1_250_000}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h, err := unmarshalLLMBudget(t, usd+tt.line)
			if err != nil {
				t.Fatal(err)
			}
			if _, p, ok := h.prices.Find(tt.model); !ok || p != tt.want {
				t.Errorf("Find(%q) = %+v %v,\nwant %+v", tt.model, p, ok, tt.want)
			}
		})
	}
}

// TestPriceCaddyfileErrorsNameTheField: a bad price line, prices_file or
// deployment is refused, naming what is wrong.
func TestPriceCaddyfileErrorsNameTheField(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte(`{"gpt-4o": {"mode": "chat", "input_cost_per_token": "2.5e-06", "output_cost_per_token": 1e-05}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	const usd = "budget d {\nunit usd\nlimit 10\nwindow 1h\n}\n"
	tests := []struct{ name, body, want string }{
		{"an unknown word", usd + "price m 1 2 cache_writes 3", `unknown word "cache_writes"`},
		{"a word twice", usd + "price m 1 2 flex 1 1 flex 1 1", "flex is set twice"},
		{"a word short of values", usd + "price m 1 2 priority 1", "priority takes 2 values"},
		{"a negative price", usd + "price m 1 2 audio 1 -2", `audio: "-2" is not a price`},
		{"a bad threshold", usd + "price m 1 2 long_context 2e5 2 4", `long_context: "2e5" is not a token count`},
		{"too few numbers", usd + "price m 1", "price takes"},
		{"prices_file twice", usd + "prices_file budget/testdata/litellm-prices.json\nprices_file budget/testdata/litellm-prices.json", "prices_file is set twice"},
		{"prices_file with no path", usd + "prices_file", "prices_file takes one path"},
		{"a missing prices_file", usd + "prices_file " + filepath.Join(dir, "none.json"), "prices_file: open"},
		{"a malformed prices_file", usd + "prices_file " + bad, `prices_file: ` + bad + `: entry "gpt-4o": field "input_cost_per_token"`},
		{"a deployment twice", "deployment prod gpt-4o\ndeployment PROD gpt-4o-mini", `deployment "PROD" is defined twice`},
		{"a deployment without a model", "deployment prod", "deployment takes <name> <model>"},
		{"a usd budget without prices", usd, "prices_file <path>"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := unmarshalLLMBudget(t, tt.body)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one with %q", err, tt.want)
			}
		})
	}
}

// TestDeploymentsJSONRefusesACaseTwin: in JSON, two deployments that
// differ only in case are one deployment given twice.
func TestDeploymentsJSONRefusesACaseTwin(t *testing.T) {
	for _, tt := range []struct {
		deployments map[string]string
		want        string
	}{
		{map[string]string{"Prod": "gpt-4o", "prod": "gpt-4o-mini"}, "defined twice"},
		{map[string]string{"a/b": "gpt-4o"}, "no slash"},
		{map[string]string{"prod": ""}, "a model are required"},
	} {
		h := &LLMBudget{Budgets: []BudgetConfig{{Unit: "tokens", Name: "b", Limit: 10, Window: caddy.Duration(time.Hour)}}, Deployments: tt.deployments}
		if err := h.compile(); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%v: %v, want an error with %q", tt.deployments, err, tt.want)
		}
	}
}

// TestPricesFileAndDeploymentsAdaptToJSON: the adapted JSON carries
// prices_file and deployments as written.
func TestPricesFileAndDeploymentsAdaptToJSON(t *testing.T) {
	src := []byte(":0 {\n\tllmbudget {\n\t\tbudget d {\n\t\t\tunit usd\n\t\t\tlimit 10\n\t\t\twindow 1h\n\t\t}\n\t\tprices_file budget/testdata/litellm-prices.json\n\t\tdeployment prod-chat gpt-4o\n\t}\n}\n")
	cfg, _, err := adaptCaddyfileFile(src, "Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"prices_file":"budget/testdata/litellm-prices.json"`, `"deployments":{"prod-chat":"gpt-4o"}`} {
		if !strings.Contains(string(cfg), want) {
			t.Errorf("adapted JSON lacks %s: %s", want, cfg)
		}
	}
}
