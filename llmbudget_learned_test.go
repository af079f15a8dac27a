package fleetguard

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// learnedStream is a stream of model through h whose upstream answers with
// usage: it reports what h held when the answer began.
func learnedStream(t *testing.T, h *LLMBudget, body string) (held int64) {
	t.Helper()
	contentType, events := streamOf(usage.OpenAIChat, 10, "hello ")
	events = append(events[:len(events)-1], `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":20,"total_tokens":25}}`+"\n\n", events[len(events)-1])
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		held = h.usedForTest(t)
		return streaming(contentType, events).ServeHTTP(w, r)
	})
	before := h.usedForTest(t)
	serveStream(t, h, "/v1/chat/completions", body, next)
	return held - before
}

// A model its answers proved through one instance is proven on every
// instance of the store, and still after they all restart: the first
// stream of it after a restart holds a lease, not its whole cap. What the
// fleet learned is a union: a model found hidden anywhere holds its whole
// cap everywhere at the next merge.
func TestWhatTheFleetLearnedSurvivesARestart(t *testing.T) {
	srv := redistest.Start(t)
	cfg := func() *LLMBudget {
		noWait := caddy.Duration(0)
		return &LLMBudget{Budgets: []BudgetConfig{{Name: "g", Limit: 1_000_000, Window: caddy.Duration(time.Hour)}}, SettleWait: &noWait}
	}
	app := func() *App { return &App{Redis: srv.URL(), Prefix: "learned"} }
	const model = "fleet-learned-model"
	body := `{"model":"` + model + `","stream":true,"max_tokens":4096,"messages":[{"role":"user","content":"hi"}]}`
	prompt := promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", body)
	t.Run("a cold model is proven by its answer", func(t *testing.T) {
		h := provisionedHandler(t, cfg(), app())
		if held := learnedStream(t, h, body); held != prompt+4096 {
			t.Fatalf("a cold model held %d, want its whole cap (%d)", held, prompt+4096)
		}
		if held := learnedStream(t, h, body); held != prompt+DefaultOutputLeaseMin {
			t.Fatalf("once proven it held %d, want a lease (%d)", held, prompt+DefaultOutputLeaseMin)
		}
		// The stop at this subtest's end merges what it learned.
	})
	t.Run("after a restart", func(t *testing.T) {
		h := provisionedHandler(t, cfg(), app())
		if held := learnedStream(t, h, body); held != prompt+DefaultOutputLeaseMin {
			t.Fatalf("after a restart the model held %d, want the lease it had (%d): the fleet's learning was lost", held, prompt+DefaultOutputLeaseMin)
		}
		// Another instance finds the model hidden: at the next merge this
		// one holds the whole cap too.
		if _, err := h.engines.budgets.MergeLearned(context.Background(), model, budget.Learned{Flags: budget.LearnedHidden}); err != nil {
			t.Fatal(err)
		}
		h.engines.mergeLearned(context.Background())
		if held := learnedStream(t, h, body); held != prompt+4096 {
			t.Fatalf("a model found hidden elsewhere held %d, want its whole cap (%d)", held, prompt+4096)
		}
	})
}
