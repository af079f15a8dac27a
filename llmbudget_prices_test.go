package fleetguard

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
)

// pricesFileSite is a site on port whose llmbudget, with lines, prices by
// pricesFile and settles at once, on a memory store of its own (prefix and
// port).
func pricesFileSite(port int, prefix, upstream, pricesFile string, lines ...string) string {
	return testCaddyfile{Port: port, Upstream: upstream,
		Global:    []string{fmt.Sprintf("fleetguard {\n\t\tprefix %s%d\n\t}", prefix, port)},
		LLMBudget: append(lines, "prices_file "+pricesFile, "settle_wait 0")}.String()
}

// TestPricesFileAloneRunsADollarBudget: a Caddyfile with prices_file and no
// price line runs a dollar budget for a dated model name, priced to the
// micro-dollar by LiteLLM's table; an Azure deployment path is priced as
// its deployment's model, whatever the body names.
func TestPricesFileAloneRunsADollarBudget(t *testing.T) {
	prices, err := filepath.Abs("budget/testdata/litellm-prices.json")
	if err != nil {
		t.Fatal(err)
	}
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, pricesFileSite(port, "pf", up.URL, prices, "team {http.request.header.X-Team}",
		"budget team_usd {\n scope team\n unit usd\n limit 0.004\n window 1h\n }",
		"deployment prod-chat gpt-4o-2024-08-06"))
	// gpt-4o-2024-08-06 in the table: $2.50 and $10 per 1M tokens. Each
	// request reserves about 2030 micro-dollars (200 output tokens at $10
	// and the prompt) and settles to 30 x 2.5 + 70 x 10 = 775.
	const dated = `{"model":"gpt-4o-2024-08-06","max_tokens":200,"messages":[{"role":"user","content":"hi"}]}`
	admitted := 0
	var last *http.Response
	var lastBody string
	for range 10 {
		waitSettles()
		last, lastBody = chat(t, url, dated, "X-Team: red")
		if last.StatusCode != http.StatusOK {
			break
		}
		admitted++
	}
	// 4000 micro-dollars: 775k + 2030 <= 4000 admits k = 0, 1, 2.
	if admitted != 3 || last.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("admitted %d then %d %s; want 3 then 429", admitted, last.StatusCode, lastBody)
	}
	if e := decodeError(t, lastBody); e.Error.Code != "insufficient_quota" || !strings.Contains(e.Error.Message, "$0.001675 of $0.004 left") {
		t.Fatalf("denial %+v: want insufficient_quota with $0.001675 of $0.004 left (3 x 775 micro-dollars charged)", e)
	}
	// A deployment named otherwise is priced as the model it maps to, not
	// as the body's (unpriced) model; an unpriced model is still refused.
	for _, tt := range []struct {
		path, model string
		status      int
	}{
		{"/openai/deployments/prod-chat/chat/completions?api-version=2024-10-21", "mystery-1", http.StatusOK},
		{"/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21", "", http.StatusOK},
		{"/openai/deployments/mystery-2/chat/completions", "gpt-4o", http.StatusPaymentRequired},
		{"/v1/chat/completions", "mystery-1", http.StatusPaymentRequired},
	} {
		waitSettles()
		model := ""
		if tt.model != "" {
			model = fmt.Sprintf(`"model":%q,`, tt.model)
		}
		resp, body := do(t, http.MethodPost, url+tt.path, `{`+model+`"max_tokens":20,"messages":[{"role":"user","content":"hi"}]}`,
			"Content-Type: application/json", "X-Team: blue")
		if resp.StatusCode != tt.status {
			t.Errorf("%s (body model %q): %d %s, want %d", tt.path, tt.model, resp.StatusCode, body, tt.status)
		}
	}
}

// TestPricesFileReload: a reload reads the prices file again, and a load
// whose file does not read is refused, naming the entry and field, and
// changes nothing running.
func TestPricesFileReload(t *testing.T) {
	file := filepath.Join(t.TempDir(), "prices.json")
	write := func(input string) {
		t.Helper()
		entry := `{"gpt-4o-2024-08-06": {"mode": "chat", "input_cost_per_token": ` + input + `, "output_cost_per_token": 1e-05}}`
		if err := os.WriteFile(file, []byte(entry), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("2.5e-06")
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	cfg := pricesFileSite(port, "pr", up.URL, file, "budget all_usd {\n unit usd\n limit 1\n window 1h\n }")
	tc := startCaddy(t, cfg)
	const dated = `{"model":"gpt-4o-2024-08-06","max_tokens":200,"messages":[{"role":"user","content":"hi"}]}`
	if resp, body := chat(t, url, dated); resp.StatusCode != http.StatusOK {
		t.Fatalf("first request: %d %s", resp.StatusCode, body)
	}
	write(`"2.5e-06"`)
	if code, body := tc.load("text/caddyfile", cfg); code == http.StatusOK || !strings.Contains(body, `entry "gpt-4o-2024-08-06": field "input_cost_per_token"`) {
		t.Fatalf("a load with a malformed file: %d %s; want it refused naming the entry and field", code, body)
	}
	waitSettles()
	if resp, body := chat(t, url, dated); resp.StatusCode != http.StatusOK {
		t.Fatalf("after the failed load: %d %s; the running config must serve", resp.StatusCode, body)
	}
	// $100,000 per 1M input tokens: the prompt alone no longer fits $1.
	// The config is unchanged, so Caddy reloads it only when forced (caddy
	// reload --force sends Cache-Control: must-revalidate).
	write("0.1")
	req, _ := http.NewRequest(http.MethodPost, "http://"+tc.admin+"/load", strings.NewReader(strings.ReplaceAll(cfg, "{ADMIN}", tc.admin)))
	req.Header.Set("Content-Type", "text/caddyfile")
	req.Header.Set("Cache-Control", "must-revalidate")
	req.Close = true
	reload, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	reload.Body.Close()
	if reload.StatusCode != http.StatusOK {
		t.Fatalf("forced reload: %d", reload.StatusCode)
	}
	waitSettles()
	// The old server may still reset a connection it accepted as it stopped:
	// wait until the new one answers (a GET the budget does not count).
	eventually(t, 5*time.Second, "the reloaded server answering", func() bool {
		req, _ := http.NewRequest(http.MethodGet, url+"/", nil)
		req.Close = true
		r, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		r.Body.Close()
		return true
	})
	resp, body := chat(t, url, dated)
	if resp.StatusCode != http.StatusTooManyRequests || decodeError(t, body).Error.Code != "request_exceeds_budget" {
		t.Fatalf("after the reload: %d %s; want the new price's 429 request_exceeds_budget", resp.StatusCode, body)
	}
}

// TestReserveForTheWorstTier: a request is reserved at the tier it asks
// for and, when its prompt estimate is above the long-context threshold,
// at the long-context tier: what fits at the standard price may not fit
// there.
func TestReserveForTheWorstTier(t *testing.T) {
	prices, err := filepath.Abs("budget/testdata/litellm-prices.json")
	if err != nil {
		t.Fatal(err)
	}
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, pricesFileSite(port, "wt", up.URL, prices, "team {http.request.header.X-Team}",
		"budget team_usd {\n scope team\n unit usd\n limit 1\n window 1h\n }"))
	// gpt-4o: 60,000 output tokens hold $0.60 at $10 per 1M, $1.02 at
	// priority's $17: over the $1 limit.
	// claude-sonnet-4-5: a prompt of 180,000 bytes holds 180,000 tokens at
	// $3 ($0.54); one of 210,000 bytes is above 200,000 and holds the whole
	// request at $6 ($1.26).
	claude := func(n int) string {
		return `{"model":"claude-sonnet-4-5-20250929","max_tokens":10,"messages":[{"role":"user","content":"` + strings.Repeat("a", n) + `"}]}`
	}
	for _, tt := range []struct {
		name, path, body string
		status           int
	}{
		{"standard fits", "/v1/chat/completions", `{"model":"gpt-4o","max_tokens":60000,"messages":[]}`, http.StatusOK},
		{"priority does not", "/v1/chat/completions", `{"model":"gpt-4o","service_tier":"priority","max_tokens":60000,"messages":[]}`, http.StatusTooManyRequests},
		{"a prompt under 200k fits", "/v1/messages", claude(180_000), http.StatusOK},
		{"a prompt over 200k does not", "/v1/messages", claude(210_000), http.StatusTooManyRequests},
	} {
		t.Run(tt.name, func(t *testing.T) {
			waitSettles()
			resp, body := do(t, http.MethodPost, url+tt.path, tt.body, "Content-Type: application/json", "X-Team: "+tt.name)
			if resp.StatusCode != tt.status {
				t.Fatalf("%d %.300s, want %d", resp.StatusCode, body, tt.status)
			}
			if tt.status != http.StatusOK && !strings.Contains(body, "request_exceeds_budget") {
				t.Fatalf("%s: want request_exceeds_budget", body)
			}
		})
	}
}

// TestAzureDeploymentTakesAzurePrice: a deployment is priced by Azure's
// own entry (azure/<model>) where the table has one, the same model
// elsewhere by its own.
func TestAzureDeploymentTakesAzurePrice(t *testing.T) {
	file := filepath.Join(t.TempDir(), "prices.json")
	// gpt-4o at $2.50 per 1M input tokens; Azure's at $100,000, which no
	// prompt fits in $1.
	table := `{"gpt-4o": {"mode": "chat", "input_cost_per_token": 2.5e-06, "output_cost_per_token": 1e-05},
		"azure/gpt-4o": {"mode": "chat", "input_cost_per_token": 0.1, "output_cost_per_token": 1e-05}}`
	if err := os.WriteFile(file, []byte(table), 0o644); err != nil {
		t.Fatal(err)
	}
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, pricesFileSite(port, "az", up.URL, file, "budget all_usd {\n unit usd\n limit 1\n window 1h\n }"))
	const body = `{"model":"gpt-4o","max_tokens":20,"messages":[{"role":"user","content":"hi"}]}`
	for _, tt := range []struct {
		path   string
		status int
	}{
		{"/v1/chat/completions", http.StatusOK},
		{"/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21", http.StatusTooManyRequests},
	} {
		waitSettles()
		resp, got := do(t, http.MethodPost, url+tt.path, body, "Content-Type: application/json")
		if resp.StatusCode != tt.status {
			t.Errorf("%s: %d %.200s, want %d", tt.path, resp.StatusCode, got, tt.status)
		}
	}
}

// A model is priced as its provider bills it, from a prices_file alone: the
// provider of the route (the provider option, or the API's own) qualifies
// the name, so the most-used models of OpenAI, Anthropic, Gemini, Groq,
// Mistral, DeepSeek and an OpenRouter route take their entry's price, to
// the micro-dollar.
func TestModelsArePricedAsTheirProviderBillsThem(t *testing.T) {
	table, err := os.ReadFile("budget/testdata/litellm-prices.json")
	if err != nil {
		t.Fatal(err)
	}
	var entries map[string]struct {
		Input  float64 `json:"input_cost_per_token"`
		Output float64 `json:"output_cost_per_token"`
	}
	if err := json.Unmarshal(table, &entries); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		provider string       // the provider option ("": the API's own)
		format   usage.Format // the route's API
		model    string       // as the request names it
		entry    string       // the table's entry that prices it
	}{
		{"", usage.OpenAIChat, "gpt-4o", "gpt-4o"},
		{"", usage.OpenAIChat, "gpt-4o-mini", "gpt-4o-mini"},
		{"", usage.OpenAIChat, "gpt-4.1", "gpt-4.1"},
		{"", usage.OpenAIChat, "gpt-4.1-mini", "gpt-4.1-mini"},
		{"", usage.OpenAIResponses, "o3", "o3"},
		{"", usage.OpenAIResponses, "o4-mini", "o4-mini"},
		{"", usage.OpenAIResponses, "gpt-5", "gpt-5"},
		{"", usage.OpenAIChat, "gpt-5-mini", "gpt-5-mini"},
		{"", usage.Anthropic, "claude-sonnet-4-5", "claude-sonnet-4-5"},
		{"", usage.Anthropic, "claude-opus-4-1", "claude-opus-4-1"},
		{"", usage.Anthropic, "claude-haiku-4-5", "claude-haiku-4-5"},
		{"", usage.Gemini, "gemini-2.5-pro", "gemini/gemini-2.5-pro"},
		{"", usage.Gemini, "gemini-2.5-flash", "gemini/gemini-2.5-flash"},
		{"", usage.Gemini, "gemini-2.0-flash", "gemini/gemini-2.0-flash"},
		{"groq", usage.OpenAIChat, "llama-3.3-70b-versatile", "groq/llama-3.3-70b-versatile"},
		{"groq", usage.OpenAIChat, "llama-3.1-8b-instant", "groq/llama-3.1-8b-instant"},
		{"mistral", usage.OpenAIChat, "mistral-large-latest", "mistral/mistral-large-latest"},
		{"mistral", usage.OpenAIChat, "mistral-small-latest", "mistral/mistral-small-latest"},
		{"deepseek", usage.OpenAIChat, "deepseek-chat", "deepseek/deepseek-chat"},
		{"deepseek", usage.OpenAIChat, "deepseek-reasoner", "deepseek/deepseek-reasoner"},
		{"openrouter", usage.OpenAIChat, "anthropic/claude-sonnet-4.5", "openrouter/anthropic/claude-sonnet-4.5"},
		{"groq", usage.OpenAIChat, "groq/llama-3.3-70b-versatile", "groq/llama-3.3-70b-versatile"}, // named with its prefix already
	} {
		h, err := unmarshalLLMBudget(t, "budget d {\nunit usd\nlimit 10\nwindow 1h\n}\nprices_file budget/testdata/litellm-prices.json"+
			map[bool]string{true: "\nprovider " + tt.provider}[tt.provider != ""])
		if err != nil {
			t.Fatal(err)
		}
		c := &call{format: tt.format, req: usage.Request{Model: tt.model}}
		name, p, ok := h.prices.Find(h.priceName(c))
		e := entries[tt.entry]
		want := budget.Rates{Input: int64(math.Round(e.Input * 1e12)), Output: int64(math.Round(e.Output * 1e12))}
		if !ok || name != tt.entry || p.Input != want.Input || p.Output != want.Output {
			t.Errorf("%s %s (provider %q): priced by %q at %d/%d micro-dollars per 1M, want %q at %d/%d",
				tt.format, tt.model, tt.provider, name, p.Input, p.Output, tt.entry, want.Input, want.Output)
		}
	}
}

// The Caddyfile of the issue: prices_file alone prices gemini-2.5-pro on the
// Gemini API, and llama-3.3-70b-versatile behind a Groq route, to the
// micro-dollar of the table's price.
func TestAPricesFileAlonePricesGeminiAndAGroqRoute(t *testing.T) {
	prices, err := filepath.Abs("budget/testdata/litellm-prices.json")
	if err != nil {
		t.Fatal(err)
	}
	up := newFakeLLM(t) // reports 30 input and 70 output tokens
	for _, tt := range []struct {
		name, extra, path, body string
		want                    string // what 10 answers cost, in dollars as the admin API shows it
	}{
		// gemini/gemini-2.5-pro: $1.25 and $10 per 1M: 30 x 1.25 + 70 x 10 = 737.5, rounded up: 738 micro-dollars an answer.
		{"gemini", "", "/v1beta/models/gemini-2.5-pro:generateContent", `{"contents":[{"role":"user","parts":[{"text":"hi"}]}],"generationConfig":{"maxOutputTokens":100}}`, "0.00738"},
		// groq/llama-3.3-70b-versatile: $0.59 and $0.79: 30 x 0.59 + 70 x 0.79 = 73 micro-dollars an answer.
		{"groq", "provider groq", "/openai/v1/chat/completions", `{"model":"llama-3.3-70b-versatile","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`, "0.00073"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			port := freePort(t)
			tc := startCaddy(t, pricesFileSite(port, "pq"+tt.name, up.URL, prices, tt.extra, "budget all_usd {\n unit usd\n limit 1\n window 1h\n }"))
			for range 10 {
				resp, body := do(t, http.MethodPost, fmt.Sprintf("http://127.0.0.1:%d%s", port, tt.path), tt.body, "Content-Type: application/json")
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("%d %s", resp.StatusCode, body)
				}
			}
			waitSettles()
			if used := budgetWindowAt(t, http.MethodGet, "http://"+tc.admin+"/fleetguard/budgets/all_usd").Used.String(); used != tt.want {
				t.Fatalf("10 answers charged $%s, want $%s", used, tt.want)
			}
		})
	}
}
