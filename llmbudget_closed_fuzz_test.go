package fleetguard

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/fleetguard/fleetguard/internal/fakellm"
)

// relabelled answers with another Content-Type than its upstream wrote: an
// SSE stream labelled JSON, NDJSON or text, as a misconfigured server or
// proxy sends it.
type relabelled struct {
	http.ResponseWriter
	contentType string
}

func (w relabelled) WriteHeader(status int) {
	w.Header().Set("Content-Type", w.contentType)
	w.ResponseWriter.WriteHeader(status)
}

func (w relabelled) Flush() { _ = http.NewResponseController(w.ResponseWriter).Flush() }

// closedWorldExtras are fields a client may add: ones that change nothing
// billed, and ones llmbudget does not know, which the honest upstream below
// bills for at their worst (input the body does not show, output it does
// not stream).
var closedWorldExtras = []string{"", `"user":"u1",`, `"temperature":0.3,`, `"metadata":{"k":"v"},`, `"frobnicate":true,`, `"Max_Tokens":1,`}

var closedWorldLabels = []string{"", "application/json", "application/x-ndjson", "text/plain", "text/event-stream"}

// closedWorldBodies are a streamed request of each API, %s where an extra
// field goes, %d its output cap.
var closedWorldBodies = []struct{ path, body string }{
	{"/v1/chat/completions", `{%s"model":"gpt-4o","stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"write"}]}`},
	{"/v1/messages", `{%s"model":"claude-sonnet-4-5","stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"write"}]}`},
	{"/v1/responses", `{%s"model":"gpt-4o","stream":true,"max_output_tokens":%d,"input":"write"}`},
	{"/api/chat", `{%s"model":"llama3","stream":true,"options":{"num_predict":%d},"messages":[{"role":"user","content":"write"}]}`},
}

// FuzzClosedWorld: whatever extra fields a request carries, however its
// answer is labelled and however long it is, against an upstream that bills
// what it generates (and, for a field llmbudget does not know, input the
// body does not show and output the stream does not show), the counter ends
// at most the limit and at least the bill, less the residual: what the
// upstream generated of the event it was cut in.
func FuzzClosedWorld(f *testing.F) {
	for i := range closedWorldExtras {
		for j := range closedWorldLabels {
			f.Add(uint8(i), uint8(j), uint8(i+j), uint16(600*i+j), uint16(1000*j+300*i))
		}
	}
	f.Fuzz(func(t *testing.T, extra, label, api uint8, words, limit uint16) {
		x, ct, b := closedWorldExtras[int(extra)%len(closedWorldExtras)], closedWorldLabels[int(label)%len(closedWorldLabels)], closedWorldBodies[int(api)%len(closedWorldBodies)]
		lim := 800 + int64(limit%6000)
		h := directHandler(t, func(h *LLMBudget) {
			h.Budgets[0].Limit = float64(lim)
			h.ContextWindow = 4000
			h.OutputLeaseMin = 64
		})
		up := &fakellm.Billed{Text: strings.Repeat("The ledger holds. ", 1+int(words%800)), ChunkBytes: 18}
		unknown := strings.Contains(x, "frobnicate") || strings.Contains(x, "Max_Tokens")
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			if unknown {
				// What a field llmbudget does not know may do: read
				// stored input, and generate output it does not stream.
				r.Header.Set("X-Fake-Input", "1500")
				r.Header.Set("X-Fake-Hidden-Output", "200")
			}
			if ct != "" {
				w = relabelled{w, ct}
			}
			up.ServeHTTP(w, r)
			return nil
		})
		residual := int64(0)
		for i := range 2 {
			body := fmt.Sprintf(b.body, x, 300+int(words%4)*700)
			r := httptest.NewRequest(http.MethodPost, b.path, strings.NewReader(body))
			r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
			rec := httptest.NewRecorder()
			_ = h.ServeHTTP(rec, r, next)
			// A cut stream's upstream bills the event it was cut in,
			// generated before it saw the cancel: a chunk's tokens.
			residual += fakellm.Tokens(strings.Repeat("The ledger holds. ", 2))
			if counter, billed := h.usedForTest(t), up.Billed(); counter > lim || billed > counter+residual {
				t.Fatalf("request %d (%s %s, extra %q, label %q): counter %d of %d, billed %d (residual %d)", i, b.path, body, x, ct, counter, lim, billed, residual)
			}
		}
	})
}
