package fleetguard

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// TestAMissingScopeValueIsRefused: a request that names no team under a team
// budget, or no principal under a key budget, is refused with 400 in the
// API's own error shape and not forwarded, unless the budget says
// missing_scope shared, which budgets it as the one empty value as before.
func TestAMissingScopeValueIsRefused(t *testing.T) {
	const anthropicBody = `{"model":"gpt-4o","max_tokens":20,"messages":[{"role":"user","content":"hi"}]}`
	for _, tt := range []struct {
		name, budget   string
		path, body     string
		headers        []string
		status         int
		code, inBody   string
		forwardedAfter bool
	}{
		{name: "no team under a team budget", budget: "scope team", path: "/v1/chat/completions", body: chatBody,
			headers: []string{"Authorization: Bearer alice"}, status: http.StatusBadRequest, code: "missing_team", inBody: `budget \"b\" is kept per team, and this request names no team ({http.request.header.X-Team} is empty)`},
		{name: "no team, in Anthropic's shape", budget: "scope team", path: "/v1/messages", body: anthropicBody,
			headers: []string{"Authorization: Bearer alice"}, status: http.StatusBadRequest, code: "missing_team", inBody: `"type":"error","error":{"type":"invalid_request_error"`},
		{name: "no principal under a key budget", budget: "scope key", path: "/v1/chat/completions", body: chatBody,
			headers: []string{"X-Team: red"}, status: http.StatusBadRequest, code: "missing_principal", inBody: "names no principal"},
		{name: "an empty team header", budget: "scope team", path: "/v1/chat/completions", body: chatBody,
			headers: []string{"X-Team: "}, status: http.StatusBadRequest, code: "missing_team"},
		{name: "missing_scope shared admits it", budget: "scope team\nmissing_scope shared", path: "/v1/chat/completions", body: chatBody,
			headers: []string{"Authorization: Bearer alice"}, status: http.StatusOK, forwardedAfter: true},
		{name: "a team named is admitted", budget: "scope team", path: "/v1/chat/completions", body: chatBody,
			headers: []string{"X-Team: red"}, status: http.StatusOK, forwardedAfter: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			up := newFakeLLM(t)
			port := freePort(t)
			url := fmt.Sprintf("http://127.0.0.1:%d", port)
			startCaddy(t, llmCaddyfile(port, up.URL, "", "budget b {\n"+tt.budget+"\nunit tokens\nlimit 100000\nwindow 1h\n}"))
			headers := append([]string{"Content-Type: application/json", "Anthropic-Version: 2023-06-01"}, tt.headers...)
			resp, body := do(t, http.MethodPost, url+tt.path, tt.body, headers...)
			if resp.StatusCode != tt.status {
				t.Fatalf("%d %s, want %d", resp.StatusCode, body, tt.status)
			}
			if tt.code != "" && !strings.Contains(body, tt.code) {
				t.Errorf("body %s lacks the code %s", body, tt.code)
			}
			if tt.inBody != "" && !strings.Contains(body, tt.inBody) {
				t.Errorf("body %s lacks %s", body, tt.inBody)
			}
			if tt.path == "/v1/chat/completions" && tt.status != http.StatusOK {
				if e := decodeError(t, body); e.Error.Type != "invalid_request_error" {
					t.Errorf("error type %q, want invalid_request_error", e.Error.Type)
				}
			}
			if forwarded := up.Hits() == 1; forwarded != tt.forwardedAfter {
				t.Errorf("forwarded %v, want %v", forwarded, tt.forwardedAfter)
			}
		})
	}
}

// TestMissingScopeConfig: missing_scope in the Caddyfile adapts to its JSON
// field, and a bad value, or one on a budget whose value is never missing,
// is refused at its line (in JSON: naming the budget).
func TestMissingScopeConfig(t *testing.T) {
	cfg, _, err := adaptCaddyfile(":0 {\nllmbudget {\nteam {http.request.header.X-Team}\nbudget b {\nscope team\nunit tokens\nlimit 10\nwindow 1h\nmissing_scope shared\n}\n}\n}")
	if err != nil || !strings.Contains(string(cfg), `"missing_scope":"shared"`) {
		t.Fatalf("adapted: %v %s, want missing_scope shared in the JSON", err, cfg)
	}
	for _, tt := range []struct{ name, block, want, at string }{
		{"an unknown value", "budget b {\nscope team\nunit tokens\nlimit 10\nwindow 1h\nmissing_scope allow\n}", "missing_scope takes refuse or shared", "Caddyfile:9"},
		{"on a global budget", "budget b {\nunit tokens\nlimit 10\nwindow 1h\nmissing_scope shared\n}", "missing_scope applies to a key or team budget", "Caddyfile:4"},
		{"on a model budget", "budget b {\nscope model\nunit tokens\nlimit 10\nwindow 1h\nmissing_scope refuse\n}", "missing_scope applies to a key or team budget", "Caddyfile:4"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := adaptCaddyfile(":0 {\nllmbudget {\nteam {http.request.header.X-Team}\n" + tt.block + "\n}\n}")
			if err == nil || !strings.Contains(err.Error(), tt.want) || strings.Count(err.Error(), tt.at) != 1 {
				t.Fatalf("error %v, want %q at %s", err, tt.want, tt.at)
			}
		})
	}
	raw, _ := json.Marshal(BudgetConfig{Name: "b", Scope: "global", Unit: "tokens", Limit: 10, MissingScope: "shared"})
	var bc BudgetConfig
	_ = json.Unmarshal(raw, &bc)
	bc.Window = 3600e9
	if _, err := provisionHandler(t, &LLMBudget{Budgets: []BudgetConfig{bc}}, nil); err == nil || !strings.Contains(err.Error(), `budget "b": missing_scope applies`) {
		t.Fatalf("JSON missing_scope on a global budget: %v", err)
	}
}

// TestASocketWithoutItsTeamIsRefusedAtTheHandshake: a Responses WebSocket
// session under a team budget whose handshake names no team is refused
// before the upgrade, with 400 missing_team, and never reaches the upstream.
func TestASocketWithoutItsTeamIsRefusedAtTheHandshake(t *testing.T) {
	up := newSocketUpstream(t, 50)
	port := freePort(t)
	startCaddy(t, llmCaddyfile(port, up.url, "", "budget b {\n scope team\n unit tokens\n limit 10000\n window 1h\n }"))
	resp, body := handshake(t, fmt.Sprintf("http://127.0.0.1:%d", port), "/v1/responses")
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, `"code":"missing_team"`) {
		t.Fatalf("handshake without a team: %s %s, want 400 missing_team", resp.Status, body)
	}
	if up.Events() != 0 {
		t.Fatalf("the upstream received %d events", up.Events())
	}
}

// TestATeamSetServerSideByMap: a team the server sets from the client's key
// (Caddy's map) is the one budgeted, whatever X-Team the client sends, and
// a key the map does not know has no team: it is refused.
func TestATeamSetServerSideByMap(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	tc := startCaddy(t, testCaddyfile{Port: port, Upstream: up.URL,
		Directives: []string{"map {http.request.header.Authorization} {team} {\n\t\t\"Bearer sk-research-1\" research\n\t}"},
		LLMBudget:  []string{"team {team}", "budget per_team {\n scope team\n unit tokens\n limit 100000\n window 1h\n }", "settle_wait 0"},
	}.String())
	if resp, body := chat(t, url, chatBody, "Authorization: Bearer sk-research-1", "X-Team: marketing"); resp.StatusCode != http.StatusOK {
		t.Fatalf("a known key: %d %s", resp.StatusCode, body)
	}
	resp, body := chat(t, url, chatBody, "Authorization: Bearer sk-unknown", "X-Team: research")
	if resp.StatusCode != http.StatusBadRequest || decodeError(t, body).Error.Code != "missing_team" {
		t.Fatalf("a key the map does not know: %d %s, want 400 missing_team", resp.StatusCode, body)
	}
	waitSettles()
	if w := budgetWindowAt(t, http.MethodGet, "http://"+tc.admin+budgetsPath+"per_team?team=research"); w.Used.String() != "100" {
		t.Fatalf("research used %s, want the 100 tokens of the known key's request", w.Used)
	}
}
