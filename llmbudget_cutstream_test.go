package fleetguard

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
)

// A legacy completions stream (/v1/completions) cut before its usage is
// charged the prompt and the text it delivered, which it streams in
// choices[].text: not the prompt alone.
func TestLegacyCompletionsCutStreamChargesItsText(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, llmCaddyfile(port, up.URL, "fleetguard {\n prefix cutstream\n }", `budget cutstream {
			limit 1000000
			window 1h
			unit tokens
		}`))
	const body = `{"model":"gpt-3.5-turbo-instruct","prompt":"Count to five","stream":true,"max_tokens":200}`
	before := settles("estimated")
	resp, got := do(t, http.MethodPost, url+"/v1/completions", body, "Content-Type: application/json", "X-Fake-Cut: 3")
	if resp.StatusCode != http.StatusOK || strings.Count(got, `"text":"tok`) != 3 || strings.Contains(got, "[DONE]") {
		t.Fatalf("the client gets the 3 chunks the upstream sent: %d %q", resp.StatusCode, got)
	}
	if !strings.Contains(up.LastBody(), `"include_usage":true`) {
		t.Fatalf("the upstream was not asked for usage: %s", up.LastBody())
	}

	waitSettles()
	eng, b, err := lookupBudget("cutstream")
	if err != nil {
		t.Fatal(err)
	}
	used, err := eng.budgets.Used(context.Background(), []budget.Budget{b}, budget.Dims{})
	if err != nil {
		t.Fatal(err)
	}
	// 3 chunks of "tokNN " = 18 bytes of text, charged by the strict bound,
	// plus the prompt.
	prompt := promptEstimate(t, usage.OpenAICompletions, "/v1/completions", body)
	if want := prompt + usage.OutputTokenBound(18); used[0] != want {
		t.Fatalf("charged %d, want the prompt %d plus the bound of 18 bytes of text (%d)", used[0], prompt, want)
	}
	if settles("estimated") != before+1 {
		t.Fatal("a stream cut before its usage settles as usage_source=estimated")
	}
}
