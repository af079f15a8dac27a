package fleetguard

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"

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
		return &LLMBudget{Budgets: []BudgetConfig{{Unit: "tokens", Name: "g", Limit: 1_000_000, Window: caddy.Duration(time.Hour)}}, SettleWait: &noWait}
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

// A cold model's first wave holds whole caps; the requests that do not fit
// wait (settle_wait) and, once the first answers settle and prove the
// model, are held as leases: all of the wave is admitted, where holding
// whole caps would refuse those the held answers leave no room for.
func TestAColdModelsFirstWaveIsAdmittedOnceItsFirstAnswersProveIt(t *testing.T) {
	wait := caddy.Duration(3 * time.Second)
	const model = "first-wave-model"
	body := `{"model":"` + model + `","stream":true,"max_tokens":4096,"messages":[{"role":"user","content":"hi"}]}`
	prompt := promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", body)
	h := provisionedHandler(t, &LLMBudget{Budgets: []BudgetConfig{{Unit: "tokens", Name: "g", Limit: float64(3*(prompt+4096) + 100), Window: caddy.Duration(time.Hour)}}, SettleWait: &wait}, nil)
	contentType, events := streamOf(usage.OpenAIChat, 10, "hello ")
	events = append(events[:len(events)-1], `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":20,"total_tokens":25}}`+"\n\n", events[len(events)-1])
	var admitted atomic.Int64
	releaseFirst, releaseRest := make(chan struct{}), make(chan struct{})
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if admitted.Add(1) <= 3 {
			<-releaseFirst
		} else {
			<-releaseRest // held in flight to the end: the room they hold is not freed
		}
		return streaming(contentType, events).ServeHTTP(w, r)
	})
	var wg sync.WaitGroup
	statuses := make(chan int, 8)
	serve := func() {
		defer wg.Done()
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
		r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
		rec := httptest.NewRecorder()
		_ = h.ServeHTTP(rec, r, next)
		statuses <- rec.Code
	}
	for range 3 {
		wg.Add(1)
		go serve()
	}
	eventually(t, 5*time.Second, "the first three admitted", func() bool { return admitted.Load() == 3 })
	waits := testutil.ToFloat64(metrics.llmSettleWaits)
	for range 5 {
		wg.Add(1)
		go serve()
	}
	eventually(t, 5*time.Second, "the five to wait for room", func() bool { return testutil.ToFloat64(metrics.llmSettleWaits)-waits == 5 })
	close(releaseFirst)
	eventually(t, 10*time.Second, "the rest of the wave admitted or refused", func() bool { return admitted.Load()+int64(len(statuses))-3 >= 8 })
	close(releaseRest)
	wg.Wait()
	close(statuses)
	for code := range statuses {
		if code != http.StatusOK {
			t.Errorf("a request of the first wave answered %d: %d of 8 admitted, want all", code, admitted.Load())
		}
	}
}
