package fleetguard

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/fleetguard/fleetguard/budget/bpe"
	"github.com/fleetguard/fleetguard/budget/usage"
)

// BenchmarkStreamThroughLLMBudget is one streamed chat answer of 300 chunks
// (a token each, with the usage chunk the client did not ask for) through
// the handler on the memory store: admitted, metered, settled. "lease"
// holds an output lease and extends it as the stream runs, its model
// (gpt-4o) counted by its tokenizer from the second answer on; "cap" holds
// the whole cap (output_leases off).
func BenchmarkStreamThroughLLMBudget(b *testing.B) {
	bpe.Load(bpe.O200k)
	_, events := streamOf(usage.OpenAIChat, 300, " word")
	events = append(events[:len(events)-1], `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":300,"total_tokens":305}}`+"\n\n", events[len(events)-1])
	chunks := make([][]byte, len(events))
	for i, ev := range events {
		chunks[i] = []byte(ev)
	}
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		for _, c := range chunks {
			if _, err := w.Write(c); err != nil {
				return err
			}
		}
		return nil
	})
	for _, tc := range []struct {
		name, model string
		leases      bool
	}{
		{"lease", "gpt-4o", true},
		{"cap", "gpt-4o", false},
		// Counted by o200k as a proxy (from its fifth answer on).
		{"lease-proxy", "claude-sonnet-4-5", true},
	} {
		body := `{"model":"` + tc.model + `","stream":true,"max_tokens":4096,"messages":[{"role":"user","content":"go"}]}`
		leases := tc.leases
		b.Run(tc.name, func(b *testing.B) {
			h := directHandler(b, func(h *LLMBudget) {
				h.Budgets[0].Limit = 1e12 // more than any run spends; limits stop near 9.2e12 (MaxInt64 micro-units)
				h.OutputLeases = &leases
			})
			ctx := context.WithValue(context.Background(), caddy.ReplacerCtxKey, caddy.NewReplacer())
			b.ReportAllocs()
			for b.Loop() {
				r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body)).WithContext(ctx)
				if err := h.ServeHTTP(discard{http.Header{}}, r, next); err != nil {
					b.Fatal(err)
				}
			}
			h.engines.waitSettles(0)
		})
	}
}

// discard is a ResponseWriter that keeps nothing but its header.
type discard struct{ header http.Header }

func (d discard) Header() http.Header       { return d.header }
func (discard) Write(p []byte) (int, error) { return len(p), nil }
func (discard) WriteHeader(int)             {}
func (discard) Flush()                      {}
