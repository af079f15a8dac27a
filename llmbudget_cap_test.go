package fleetguard

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
)

// TestLLMBudgetCeilingHoldsWithoutACap: a request that names no output cap
// reserves default_max_tokens and is forwarded with it, so an upstream that
// would write 10,000 tokens stops at 4096 and the budget is never passed.
// Forwarded without a cap, two such requests charged 20,060 of 20,000. A
// stream holds an output lease instead, extended as it streams: the one
// whose extension finds no room ends at its lease, within the limit.
func TestLLMBudgetCeilingHoldsWithoutACap(t *testing.T) {
	const (
		limit     = 20000
		defaultMT = 4096
		body      = `{"model":"gpt-4o","messages":[{"role":"user","content":"write a long story"}]}`
	)
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			up := newFakeLLM(t)
			up.Output = 10000 // 10,000 unless told to stop sooner
			// A stream's text is as long as the tokens it reports.
			up.Words, up.Interval = true, 0
			port := freePort(t)
			url := fmt.Sprintf("http://127.0.0.1:%d", port)
			tc := startCaddy(t, llmCaddyfile(port, up.URL, fmt.Sprintf("fleetguard {\n prefix cap%d\n }", port), fmt.Sprintf(`budget g {
			limit %d
			window 1h
			unit tokens
		}
		default_max_tokens %d`, limit, defaultMT)))
			reqBody := body
			if stream {
				reqBody = strings.Replace(body, `"model"`, `"stream":true,"stream_options":{"include_usage":true},"model"`, 1)
			}
			used := func() int64 {
				waitSettles()
				return mustInt(t, budgetWindowAt(t, http.MethodGet, "http://"+tc.admin+"/fleetguard/budgets/g").Used.String())
			}
			prompt := promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", reqBody)
			hold := prompt + defaultMT
			if stream {
				hold = prompt + DefaultOutputLeaseMin
			}
			charge := int64(up.Input + defaultMT)
			// Each request holds about 4,100 and is charged 4,126: four fit,
			// the fifth's hold does not. A stream holds its lease: the fifth
			// is admitted and ends at the limit, the sixth's lease does not fit.
			wantAdmitted := 0
			for u := int64(0); u+hold <= limit; u += charge {
				wantAdmitted++
			}
			var truncated int
			var charged []int64 // by each admitted request
			var bodies []string // as forwarded
			for i := 1; ; i++ {
				before := used()
				resp, got := chat(t, url, reqBody)
				if resp.StatusCode == http.StatusTooManyRequests {
					if i-1 != wantAdmitted || before+hold <= limit {
						t.Fatalf("request %d denied with %d of %d used (it holds %d); want %d admitted first", i, before, limit, hold, wantAdmitted)
					}
					break
				}
				if resp.StatusCode != http.StatusOK || (stream && !strings.Contains(got, "data: [DONE]")) {
					t.Fatalf("request %d: %d %s", i, resp.StatusCode, got)
				}
				after := used()
				if after > limit {
					t.Fatalf("after request %d: %d charged, over the limit of %d", i, after, limit)
				}
				charged, bodies = append(charged, after-before), append(bodies, up.LastBody())
				if after-before < charge {
					if !stream || !strings.Contains(got, `"finish_reason":"length"`) {
						t.Fatalf("request %d charged %d of %d and answered %.300s…, want a stream ended at its lease", i, after-before, charge, got)
					}
					truncated++
				}
			}
			if stream && truncated != 1 {
				t.Errorf("%d streams ended at their lease, want the one that reached the limit", truncated)
			}
			for i := range charged {
				var fw struct {
					MaxCompletionTokens int64 `json:"max_completion_tokens"`
				}
				if err := json.Unmarshal([]byte(bodies[i]), &fw); err != nil || fw.MaxCompletionTokens != defaultMT {
					t.Errorf("request %d was forwarded as %s, want max_completion_tokens %d", i+1, bodies[i], defaultMT)
				}
				if charged[i] != charge && !(stream && i == len(charged)-1) {
					t.Errorf("request %d charged %d, want the %d the upstream reported", i+1, charged[i], charge)
				}
			}
		})
	}
}

// capHandler is directHandler with the options set on its config.
func capHandler(t *testing.T, options func(h *LLMBudget)) *LLMBudget {
	t.Helper()
	return directHandler(t, options)
}

// forwarded is what ServeHTTP did with one request: the body and the hold
// the upstream saw, or the answer when it was not forwarded.
type forwarded struct {
	body   string
	hold   int64
	status int
	answer string
}

func serveCapped(t *testing.T, h *LLMBudget, path, body string) forwarded {
	t.Helper()
	before := h.usedForTest(t)
	var fw forwarded
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		b, _ := io.ReadAll(r.Body)
		fw.body = string(b)
		used, err := h.engines.budgets.Used(context.Background(), h.budgets, budget.Dims{})
		if err != nil {
			t.Fatal(err)
		}
		fw.hold = used[0] - before
		w.WriteHeader(http.StatusInternalServerError) // released
		return nil
	})
	req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
	rec := httptest.NewRecorder()
	if err := h.ServeHTTP(rec, req, next); err != nil {
		t.Fatal(err)
	}
	if fw.body == "" {
		fw.status, fw.answer = rec.Code, rec.Body.String()
	}
	return fw
}

// jsonAt is the JSON value at the dotted path of body, "" when absent.
func jsonAt(t *testing.T, body, path string) string {
	t.Helper()
	raw := json.RawMessage(body)
	for _, key := range strings.Split(path, ".") {
		var obj map[string]json.RawMessage
		if err := json.Unmarshal(raw, &obj); err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		if raw = obj[key]; raw == nil {
			return ""
		}
	}
	return string(raw)
}

// sameExcept fails unless the top-level members of got are those of want,
// with the same bytes, but for the member named changed.
func sameExcept(t *testing.T, want, got, changed string) {
	t.Helper()
	var w, g map[string]json.RawMessage
	if json.Unmarshal([]byte(want), &w) != nil || json.Unmarshal([]byte(got), &g) != nil {
		t.Fatalf("%s or %s is not a JSON object", want, got)
	}
	for k, v := range w {
		if k != changed && string(g[k]) != string(v) {
			t.Fatalf("%s: %s became %s", k, v, g[k])
		}
	}
	for k := range g {
		if _, ok := w[k]; !ok && k != changed {
			t.Fatalf("%s gained %s", got, k)
		}
	}
}

// TestLLMBudgetForwardsTheReservedCap: the upstream receives the cap it was
// held to in its API's own field, and every other field as written.
func TestLLMBudgetForwardsTheReservedCap(t *testing.T) {
	const gemini = "/v1beta/models/gemini-2.5-flash:generateContent"
	tests := []struct {
		name      string
		chatField string
		path      string
		body      string
		at        string // where the cap is, dotted
		want      string // "" when the body is forwarded as written
	}{
		{"chat", "", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.2}`, "max_completion_tokens", "4096"},
		{"chat, servers that read max_tokens", "max_tokens", "/v1/chat/completions", `{"model":"m","messages":[]}`, "max_tokens", "4096"},
		{"chat with its own cap", "", "/v1/chat/completions", `{"model":"m","max_tokens":100,"messages":[]}`, "max_tokens", ""},
		{"legacy completions", "", "/v1/completions", `{"model":"m","prompt":"hi"}`, "max_tokens", "4096"},
		{"responses", "", "/v1/responses", `{"model":"m","input":"hi","store":false}`, "max_output_tokens", "4096"},
		{"gemini", "", gemini, `{"contents":[{"parts":[{"text":"hi"}]}]}`, "generationConfig", `{"maxOutputTokens":4096}`},
		{"gemini generation_config", "", gemini, `{"contents":[],"generation_config":{"temperature":1}}`, "generation_config", `{"temperature":1,"max_output_tokens":4096}`},
		{"ollama", "", "/api/chat", `{"model":"m","messages":[],"stream":false}`, "options", `{"num_predict":4096}`},
		{"ollama unbounded", "", "/api/generate", `{"model":"m","prompt":"hi","options":{"num_predict":-1,"seed":7}}`, "options", `{"num_predict":4096,"seed":7}`},
		{"anthropic has its own", "", "/v1/messages", `{"model":"m","max_tokens":100,"messages":[]}`, "max_tokens", ""},
		{"embeddings have no output", "", "/v1/embeddings", `{"model":"m","input":"hi"}`, "max_tokens", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := capHandler(t, func(h *LLMBudget) { h.ChatCapField = tt.chatField })
			fw := serveCapped(t, h, tt.path, tt.body)
			req, err := usage.ParseRequest(usage.FormatFromPath(tt.path), tt.path, []byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if tt.want == "" {
				if fw.body != tt.body {
					t.Fatalf("forwarded %s, want it as written", fw.body)
				}
				return
			}
			if got := jsonAt(t, fw.body, tt.at); got != tt.want {
				t.Fatalf("forwarded %s: %s is %s, want %s", fw.body, tt.at, got, tt.want)
			}
			sameExcept(t, tt.body, fw.body, tt.at)
			want := req.PromptTokens + DefaultMaxTokens
			if req.Stream {
				want = req.PromptTokens + DefaultOutputLeaseMin // a stream holds a lease
			}
			if fw.hold != want {
				t.Fatalf("held %d while forwarded, want the prompt plus the cap it was given (or its lease), %d", fw.hold, want)
			}
		})
	}
}

// TestLLMBudgetMaxOutputTokens: a cap above max_output_tokens is lowered
// where the client wrote it and held at the ceiling, or refused in the API's
// own error shape; a request without a cap gets the smaller of the default
// and the ceiling.
func TestLLMBudgetMaxOutputTokens(t *testing.T) {
	const gemini = "/v1beta/models/gemini-2.5-flash:generateContent"
	tests := []struct {
		name     string
		over     string
		defaultC int64
		path     string
		body     string
		at, want string // the forwarded cap; "" for the body as written
		hold     int64  // the held output
		refusal  string // the error body's code-bearing part, when refused
	}{
		{"lowered", "", 0, "/v1/chat/completions", `{"model":"m","max_tokens":50000,"messages":[]}`, "max_tokens", "8192", 8192, ""},
		{"both chat caps lowered", "lower", 0, "/v1/chat/completions", `{"model":"m","max_tokens":9000,"max_completion_tokens":50000}`, "max_completion_tokens", "8192", 8192, ""},
		{"gemini lowered", "", 0, gemini, `{"generation_config":{"max_output_tokens":65536}}`, "generation_config", `{"max_output_tokens":8192}`, 8192, ""},
		{"under the ceiling", "refuse", 0, "/v1/messages", `{"model":"m","max_tokens":8192,"messages":[]}`, "", "", 8192, ""},
		{"no cap: the default, under the ceiling", "", 0, "/v1/responses", `{"model":"m","input":"x"}`, "max_output_tokens", "4096", 4096, ""},
		{"no cap: the ceiling, under the default", "", 20000, "/v1/responses", `{"model":"m","input":"x"}`, "max_output_tokens", "8192", 8192, ""},
		{"refused, OpenAI shape", "refuse", 0, "/v1/chat/completions", `{"model":"m","max_tokens":50000}`, "", "", 0, `"code":"output_cap_too_large"`},
		{"refused, Anthropic shape", "refuse", 0, "/v1/messages", `{"model":"m","max_tokens":50000,"messages":[]}`, "", "", 0, `{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens is 50000`},
		{"refused, Gemini shape", "refuse", 0, gemini, `{"generationConfig":{"maxOutputTokens":50000}}`, "", "", 0, `{"error":{"code":400,"status":"INVALID_ARGUMENT","message":"generationConfig.maxOutputTokens is 50000`},
		{"refused, Ollama", "refuse", 0, "/api/chat", `{"model":"m","options":{"num_predict":9000}}`, "", "", 0, `options.num_predict is 9000`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := capHandler(t, func(h *LLMBudget) {
				h.MaxOutputTokens, h.OverMaxOutputTokens = 8192, tt.over
				if tt.defaultC > 0 {
					h.DefaultMaxTokens = tt.defaultC
				}
			})
			fw := serveCapped(t, h, tt.path, tt.body)
			if tt.refusal != "" {
				if fw.body != "" || fw.status != http.StatusBadRequest || !strings.Contains(fw.answer, tt.refusal) {
					t.Fatalf("forwarded %q; answered %d %s, want 400 with %s", fw.body, fw.status, fw.answer, tt.refusal)
				}
				return
			}
			req, err := usage.ParseRequest(usage.FormatFromPath(tt.path), tt.path, []byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if fw.hold != req.PromptTokens+tt.hold {
				t.Fatalf("held %d, want the prompt and %d", fw.hold, tt.hold)
			}
			if tt.at == "" {
				if fw.body != tt.body {
					t.Fatalf("forwarded %s, want it as written", fw.body)
				}
				return
			}
			if got := jsonAt(t, fw.body, tt.at); got != tt.want {
				t.Fatalf("forwarded %s: %s is %s, want %s", fw.body, tt.at, got, tt.want)
			}
		})
	}
}

// Shadow mode enforces nothing: the request goes out as the client wrote it.
func TestLLMBudgetShadowForwardsTheCapAsWritten(t *testing.T) {
	h := capHandler(t, func(h *LLMBudget) { h.Shadow, h.MaxOutputTokens = true, 100 })
	for _, body := range []string{`{"model":"m","messages":[]}`, `{"model":"m","max_tokens":5000,"messages":[]}`} {
		if fw := serveCapped(t, h, "/v1/chat/completions", body); fw.body != body {
			t.Fatalf("shadow forwarded %s, want %s", fw.body, body)
		}
	}
}

func TestLLMBudgetCapJSONConfigErrors(t *testing.T) {
	tests := []struct {
		name    string
		options func(h *LLMBudget)
		want    string
	}{
		{"unknown chat_cap_field", func(h *LLMBudget) { h.ChatCapField = "MAX_TOKENS" }, "chat_cap_field"},
		{"negative max_output_tokens", func(h *LLMBudget) { h.MaxOutputTokens = -1 }, "max_output_tokens: must be between"},
		{"unknown over_max_output_tokens", func(h *LLMBudget) { h.MaxOutputTokens, h.OverMaxOutputTokens = 5, "cut" }, `over_max_output_tokens "cut"`},
		{"over_max_output_tokens alone", func(h *LLMBudget) { h.OverMaxOutputTokens = "refuse" }, "needs max_output_tokens"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := &LLMBudget{Budgets: []BudgetConfig{{Unit: "tokens", Name: "g", Limit: 10, Window: caddy.Duration(time.Hour)}}}
			tt.options(h)
			if err := h.compile(); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
		})
	}
}
