package fleetguard

import (
	"flag"
	"fmt"
	"github.com/fleetguard/fleetguard/budget/usage"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/budget/bpe"
	"github.com/fleetguard/fleetguard/internal/fakellm"
)

// The ceiling: for any text an upstream streams, in every API, with or
// without a model's history, concurrent streams never take a budget past its
// limit, and the upstream never bills more than the budget charged. The
// upstream here bills o200k counts (fakellm.Billed) and streams several
// tokens an event.

// ceilingTexts are answers of every density (fakellm.Texts).
func ceilingTexts(size int) map[string]string { return fakellm.Texts(size) }

// ceilingAPIs are the APIs a stream is asked for in: a path and a body for a
// model that caps its output at 2000.
var ceilingAPIs = []struct {
	name string
	path func(model string) string
	body func(model string) string
}{
	{"openai_chat", func(string) string { return "/v1/chat/completions" },
		func(m string) string {
			return `{"model":"` + m + `","stream":true,"stream_options":{"include_usage":true},"max_tokens":2000,"messages":[{"role":"user","content":"go"}]}`
		}},
	{"openai_responses", func(string) string { return "/v1/responses" },
		func(m string) string {
			return `{"model":"` + m + `","stream":true,"max_output_tokens":2000,"input":"go"}`
		}},
	{"openai_completions", func(string) string { return "/v1/completions" },
		func(m string) string {
			return `{"model":"` + m + `","stream":true,"stream_options":{"include_usage":true},"max_tokens":2000,"prompt":"go"}`
		}},
	{"anthropic", func(string) string { return "/v1/messages" },
		func(m string) string {
			return `{"model":"` + m + `","stream":true,"max_tokens":2000,"messages":[{"role":"user","content":"go"}]}`
		}},
	{"gemini", func(m string) string { return "/v1beta/models/" + m + ":streamGenerateContent?alt=sse" },
		func(string) string {
			return `{"contents":[{"role":"user","parts":[{"text":"go"}]}],"generationConfig":{"maxOutputTokens":2000}}`
		}},
	{"ollama", func(string) string { return "/api/chat" },
		func(m string) string {
			return `{"model":"` + m + `","messages":[{"role":"user","content":"go"}],"options":{"num_predict":2000}}`
		}},
}

// ceilingSetup is one Caddy with a per-model budget in front of a Billed
// upstream: each case names its own model, so its counter and its history
// are its own.
type ceilingSetup struct {
	t          *testing.T
	tc         *testCaddy
	port       int
	url, admin string
	upstream   string
	up         *fakellm.Billed
	limit      int64
}

// ceilingTextBytes is the length of each text of the suite; the budget of
// TestTheCeilingHoldsForAnyTextInEveryAPI is twice it.
var ceilingTextBytes = flag.Int("ceiling.bytes", 1500, "the length of each text of the ceiling suite")

func newCeilingSetup(t *testing.T, limit int64, options string) *ceilingSetup {
	up := &fakellm.Billed{Texts: ceilingTexts(*ceilingTextBytes), ChunkBytes: 24, Interval: 2 * time.Millisecond,
		Tokenizers: map[string]func(string) int64{"claude-": fakellm.CL100kTokens}}
	srv := httptest.NewServer(up)
	t.Cleanup(srv.Close)
	s := &ceilingSetup{t: t, port: freePort(t), upstream: srv.URL, up: up, limit: limit}
	s.url = fmt.Sprintf("http://127.0.0.1:%d", s.port)
	s.tc = startCaddy(t, s.caddyfile(limit, options))
	s.admin = s.tc.admin
	return s
}

// caddyfile is the setup's config with a limit.
func (s *ceilingSetup) caddyfile(limit int64, options string) string {
	return testCaddyfile{Port: s.port, Upstream: s.upstream,
		Global: []string{fmt.Sprintf("fleetguard {\n\t\tprefix ceiling%d\n\t}", s.port)},
		LLMBudget: []string{
			// 30 days: a fixed window resets on its boundary (a 1h one on
			// the hour), and a case that spans one reads a fresh counter.
			fmt.Sprintf("budget ceiling {\n\t\t\tscope model\n\t\t\tlimit %d\n\t\t\twindow 720h\n\t\tunit tokens\n\t\t}", limit),
			"max_request_body 4MiB",
			options,
		}}.String()
}

// reload loads the config with another limit.
func (s *ceilingSetup) reload(limit int64) {
	s.t.Helper()
	if code, body := s.tc.load("application/json", string(s.tc.adapt(s.caddyfile(limit, "settle_wait 0")))); code != http.StatusOK {
		s.t.Fatalf("reload: %d %s", code, body)
	}
	s.limit = limit
}

// stream asks for one answer of text from model and reads it whole.
func (s *ceilingSetup) stream(api int, model, text string) int {
	s.t.Helper()
	a := ceilingAPIs[api]
	req, _ := http.NewRequest(http.MethodPost, s.url+a.path(model), strings.NewReader(a.body(model)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Fake-Text", text)
	req.Close = true
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.t.Error(err)
		return 0
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

// settled waits until the upstream and the budget are done with every
// answer, and returns model's counter and what the upstream billed for it.
func (s *ceilingSetup) settled(model string) (counter, billed int64) {
	eventually(s.t, 10*time.Second, "the upstream's answers ended", func() bool { return s.up.InFlight() == 0 })
	waitSettles()
	w := budgetWindowAt(s.t, http.MethodGet, "http://"+s.admin+"/fleetguard/budgets/ceiling?model="+model)
	return mustInt(s.t, w.Used.String()), s.up.BilledFor(model)
}

// TestTheCeilingHoldsForAnyTextInEveryAPI: eight concurrent streams of 1,500
// bytes (up to 1,000 tokens each) under a 3,000-token budget, for every API,
// every density of text, a model with no history, one proven by an English
// answer, an OpenAI model (gpt-4o-…) proven by one, which is counted by its
// tokenizer (o200k_base), and a model billed by cl100k (claude-…) that four
// English answers taught to count by o200k at a scale: the counter never
// passes the limit, and the upstream never bills more than the counter.
func TestTheCeilingHoldsForAnyTextInEveryAPI(t *testing.T) {
	bpe.Load(bpe.O200k) // (loaded in the background otherwise)
	s := newCeilingSetup(t, int64(2**ceilingTextBytes), "settle_wait 0")
	texts := ceilingTexts(*ceilingTextBytes)
	for api, a := range ceilingAPIs {
		for text := range texts {
			for _, history := range []string{"none", "english", "tokenized", "proxied"} {
				model, proofs := fmt.Sprintf("m-%s-%s-%s", a.name, text, history), 1
				switch history {
				case "none":
					proofs = 0
				case "tokenized":
					model = fmt.Sprintf("gpt-4o-%s-%s", a.name, text)
				case "proxied":
					// Billed by cl100k, counted by o200k at a scale.
					model, proofs = fmt.Sprintf("claude-%s-%s", a.name, text), proxyProofs
				}
				t.Run(model, func(t *testing.T) {
					for range proofs {
						if got := s.stream(api, model, "english"); got != http.StatusOK {
							t.Fatalf("an English answer: %d", got)
						}
						waitSettles()
					}
					if history == "proxied" && !historyOf(model).countsTokens() {
						t.Fatal("the model is not counted by its proxy after its English answers")
					}
					var wg sync.WaitGroup
					statuses := make([]int, 8)
					for i := range statuses {
						wg.Go(func() { statuses[i] = s.stream(api, model, text) })
					}
					wg.Wait()
					counter, billed := s.settled(model)
					if counter > s.limit || billed > counter {
						t.Fatalf("counter %d of %d, the upstream billed %d (statuses %v)", counter, s.limit, billed, statuses)
					}
					if history == "tokenized" && !historyOf(model).countsTokens() {
						t.Fatal("the model is not counted by its tokenizer")
					}
					t.Logf("counter %d of %d, billed %d, statuses %v", counter, s.limit, billed, statuses)
				})
			}
		}
	}
}

// concurrently sends n requests of body to path (with headers) and returns
// their statuses and bodies.
func (s *ceilingSetup) concurrently(n int, path, body string, headers ...string) (statuses []int, bodies []string) {
	statuses, bodies = make([]int, n), make([]string, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			resp, got := do(s.t, http.MethodPost, s.url+path, body, append([]string{"Content-Type: application/json"}, headers...)...)
			statuses[i], bodies[i] = resp.StatusCode, got
		})
	}
	wg.Wait()
	return statuses, bodies
}

// within fails unless model's counter is within the limit and the upstream
// billed no more than it.
func (s *ceilingSetup) within(model string) (counter, billed int64) {
	s.t.Helper()
	counter, billed = s.settled(model)
	if counter > s.limit || billed > counter {
		s.t.Fatalf("counter %d of %d, the upstream billed %d", counter, s.limit, billed)
	}
	return counter, billed
}

// historyOf is the output history of model in the store of the tests'
// Caddy.
func historyOf(model string) *outputHistory {
	var o *outputHistory
	enginePool.Range(func(_, v any) bool {
		if h, ok := v.(*engines).histories.models.Load(model); ok {
			o = h.(*outputHistory)
		}
		return true
	})
	if o == nil {
		return new(outputHistory)
	}
	return o
}

// A model counted by its tokenizer whose upstream then bills more than the
// tokenizer counts (30 tokens of output it does not show) loses that trust
// at its first such answer, for good, and is counted a token a byte again:
// dense answers of it then end within the limit and its bill within the
// counter, as a model's with no tokenizer.
func TestATokenizerThatUndercountsLosesTrust(t *testing.T) {
	bpe.Load(bpe.O200k)
	s := newCeilingSetup(t, 3000, "settle_wait 0")
	const model = "gpt-4o-drifting"
	if got := s.stream(0, model, "english"); got != http.StatusOK || !historyOf(model).countsTokens() {
		t.Fatalf("the English answer: %d, counted by the tokenizer: %v", got, historyOf(model).countsTokens())
	}
	api := ceilingAPIs[0]
	if statuses, _ := s.concurrently(1, api.path(model), api.body(model), "X-Fake-Text: english", "X-Fake-Hidden-Output: 30"); statuses[0] != http.StatusOK {
		t.Fatalf("the answer billing 30 more: %d", statuses[0])
	}
	s.within(model)
	if o := historyOf(model); o.countsTokens() || !o.tokensRevoked.Load() || !o.leases() {
		t.Fatalf("after an answer billed 30 tokens more than the tokenizer counts: counted by it %v, leases %v", o.countsTokens(), o.leases())
	}
	for _, text := range []string{"csv", "base64"} {
		s.concurrently(8, api.path(model), api.body(model), "X-Fake-Text: "+text, "X-Fake-Hidden-Output: 30")
	}
	counter, billed := s.within(model)
	t.Logf("counter %d of %d, billed %d", counter, s.limit, billed)
}

// A model on no reasoning list whose upstream bills 4,000 tokens of output
// the stream does not show: its first streams hold their cap (it is not
// proven), and once it billed more than its text it holds its cap for good.
func TestAModelWithHiddenOutputHoldsItsCap(t *testing.T) {
	s := newCeilingSetup(t, 20000, "settle_wait 0")
	s.up.HiddenOutput, s.up.Text = 4000, "Done."
	body := `{"model":"quiet-thinker","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"go"}]}`
	for range 3 {
		s.concurrently(6, "/v1/chat/completions", body)
	}
	s.within("quiet-thinker")
	hidden := false
	enginePool.Range(func(_, v any) bool {
		if h, ok := v.(*engines).histories.models.Load("quiet-thinker"); ok {
			hidden = h.(*outputHistory).hidden.Load() && !h.(*outputHistory).leases()
		}
		return true
	})
	if !hidden {
		t.Fatal("a model that billed 4,000 tokens for 5 bytes of text still leases")
	}
}

// Anthropic reports the input in message_start: input beyond the estimate
// (a server-side system prompt) comes out of the lease before more output
// passes, so streams cut at the ceiling still end within it. (Input beyond
// the estimate by more than the lease held is billed before any output: it
// is charged, past the limit if it must be; see README, "The ceiling".)
func TestInputReportedAboveTheEstimateComesOutOfTheLease(t *testing.T) {
	s := newCeilingSetup(t, 3000, "settle_wait 0")
	s.up.Input = 200 // 187 beyond the estimate, within the first lease of 256
	proveModels(nil, "claude-input")
	body := `{"model":"claude-input","stream":true,"max_tokens":2000,"messages":[{"role":"user","content":"go"}]}`
	s.concurrently(6, "/v1/messages", body, "X-Fake-Text: english")
	s.within("claude-input")
}

// A prompt is held at a token a byte of its text: dense prompts (base64,
// numbers) never take a budget past its limit, and one larger than the
// limit is refused before it is forwarded.
func TestDensePromptsAreHeldAtTheirBound(t *testing.T) {
	s := newCeilingSetup(t, 30000, "settle_wait 0")
	texts := ceilingTexts(9000)
	for _, text := range []string{"base64", "csv"} {
		model := "dense-" + text
		body := fmt.Sprintf(`{"model":%q,"max_tokens":10,"messages":[{"role":"user","content":%q}]}`, model, texts[text])
		statuses, _ := s.concurrently(6, "/v1/chat/completions", body, "X-Fake-Text: english")
		counter, billed := s.within(model)
		t.Logf("%s: statuses %v, counter %d, billed %d", text, statuses, counter, billed)
	}
	huge := fmt.Sprintf(`{"model":"dense-huge","max_tokens":10,"messages":[{"role":"user","content":%q}]}`, strings.Repeat(texts["base64"], 4))
	hits := s.up.Hits()
	if statuses, bodies := s.concurrently(1, "/v1/chat/completions", huge); statuses[0] != http.StatusTooManyRequests || !strings.Contains(bodies[0], "request_exceeds_budget") {
		t.Fatalf("a 36 KB base64 prompt under a 30,000-token budget: %d %s", statuses[0], bodies[0])
	}
	if s.up.Hits() != hits {
		t.Fatal("a prompt that cannot fit was forwarded")
	}
}

// Input the body does not show holds context_window: Responses requests
// continuing a conversation stored upstream (150,000 tokens each there).
func TestHiddenInputHoldsTheContextWindow(t *testing.T) {
	s := newCeilingSetup(t, 1000000, "context_window 200000\n\t\tsettle_wait 0")
	s.up.Input, s.up.Text = 150000, "ok"
	body := `{"model":"gpt-x","stream":true,"previous_response_id":"resp_1","input":"and then?","max_output_tokens":100}`
	statuses, _ := s.concurrently(10, "/v1/responses", body)
	counter, billed := s.within("gpt-x")
	t.Logf("statuses %v, counter %d, billed %d", statuses, counter, billed)

	// Under a smaller budget it never fits, and the denial says why.
	small := newCeilingSetup(t, 100000, "settle_wait 0")
	statuses, bodies := small.concurrently(1, "/v1/responses", body)
	if statuses[0] != http.StatusTooManyRequests || !strings.Contains(bodies[0], "previous_response_id") || !strings.Contains(bodies[0], "context_window") {
		t.Fatalf("a request with hidden input under a budget below context_window: %d %s", statuses[0], bodies[0])
	}
	refusing := newCeilingSetup(t, 1000000, "hidden_input refuse\n\t\tsettle_wait 0")
	statuses, bodies = refusing.concurrently(1, "/v1/responses", body)
	if statuses[0] != http.StatusBadRequest || !strings.Contains(bodies[0], "hidden_input") || refusing.up.Hits() != 0 {
		t.Fatalf("hidden_input refuse: %d %s (forwarded %d)", statuses[0], bodies[0], refusing.up.Hits())
	}
}

// A prompt of token ids is that many tokens: embeddings and legacy
// completions given ids hold them.
func TestTokenIDPromptsCountEachID(t *testing.T) {
	s := newCeilingSetup(t, 20000, "settle_wait 0")
	s.up.Input = 3000 // an id is a token
	ids := strings.TrimSuffix(strings.Repeat("1234,", 3000), ",")
	statuses, _ := s.concurrently(10, "/v1/completions", `{"model":"ids","prompt":[`+ids+`],"max_tokens":10}`)
	counter, _ := s.within("ids")
	if want := int64(6 * 3000); counter < want {
		t.Fatalf("statuses %v, counter %d, want the 3,000 ids of at least six admitted (each held)", statuses, counter)
	}
}

// A reload that lowers a limit applies to the streams in flight at their
// next extension: they end within the new limit, not the old one.
func TestAReloadLowersTheLimitOfStreamsInFlight(t *testing.T) {
	s := newCeilingSetup(t, 100000, "")
	s.up.Interval = 20 * time.Millisecond // 3,000 bytes in 2.5 s
	s.up.Texts["long"] = ceilingTexts(3000)["english"]
	proveModels(nil, "reload-m")
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() { s.stream(0, "reload-m", "long") })
	}
	eventually(t, 5*time.Second, "ten streams admitted", func() bool { return s.up.InFlight() == 10 })
	s.reload(6000)
	wg.Wait()
	counter, billed := s.within("reload-m")
	t.Logf("counter %d of the new limit 6000, billed %d", counter, billed)
}

// A leased stream answered with a body the meter cannot read (no
// Content-Type, text/plain, octet-stream, an encoding) keeps no usage to
// settle: it holds its whole cap where that fits, and is charged it. Where
// it does not, an unencoded body passes held a token a byte and is cut where
// the budget ends; an encoded one (whose bytes bound nothing) gets the
// budget's refusal. Either way the upstream request is cancelled.
func TestAnAnswerTheMeterCannotReadIsNeverFree(t *testing.T) {
	for _, tt := range []struct{ name, contentType, encoding string }{
		{"no content type", "", ""},
		{"text/plain", "text/plain", ""},
		{"octet-stream", "application/octet-stream", ""},
		{"brotli", "text/event-stream", "br"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cancelled := make(chan struct{}, 4)
			up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if tt.contentType != "" {
					w.Header().Set("Content-Type", tt.contentType)
				} else {
					w.Header()["Content-Type"] = nil // no sniffing
				}
				if tt.encoding != "" {
					w.Header().Set("Content-Encoding", tt.encoding)
				}
				w.WriteHeader(http.StatusOK)
				for range 200 {
					if _, err := io.WriteString(w, strings.Repeat("x", 20)); err != nil || r.Context().Err() != nil {
						cancelled <- struct{}{}
						return
					}
					w.(http.Flusher).Flush()
					time.Sleep(2 * time.Millisecond) // an upstream's pace: the refusal must come mid-answer
				}
			}))
			defer up.Close()
			for _, limit := range []int64{3000, 100000} {
				port := freePort(t)
				tc := startCaddy(t, llmCaddyfile(port, up.URL, fmt.Sprintf("fleetguard {\n prefix opaque%d\n }", port), fmt.Sprintf(`budget g {
			limit %d
			window 720h
			unit tokens
		}`, limit)))
				proveModels(nil, "gpt-4o")
				body := `{"model":"gpt-4o","stream":true,"max_tokens":4096,"messages":[{"role":"user","content":"go"}]}`
				resp, got := chat(t, fmt.Sprintf("http://127.0.0.1:%d", port), body)
				waitSettles()
				used := mustInt(t, budgetWindowAt(t, http.MethodGet, "http://"+tc.admin+"/fleetguard/budgets/g").Used.String())
				prompt := promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", body)
				switch {
				case limit < 4096 && tt.encoding == "":
					// Its bytes pass as they are held, a token a byte, and
					// it ends where the budget does.
					if resp.StatusCode != http.StatusOK || len(got) == 0 || len(got) >= 4000 {
						t.Fatalf("limit %d: %d, %d bytes, want the start of the body, cut where the budget ends", limit, resp.StatusCode, len(got))
					}
					select {
					case <-cancelled:
					case <-time.After(5 * time.Second):
						t.Fatal("the upstream request was not cancelled")
					}
					if used > limit || used < prompt+int64(len(got)) {
						t.Fatalf("limit %d: charged %d for %d bytes passed, want at least the prompt and a token a byte (%d), at most the limit", limit, used, len(got), prompt+int64(len(got)))
					}
				case limit < 4096:
					if resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(got, "cannot meter") || strings.Contains(got, "xxxx") {
						t.Fatalf("limit %d: %d %q, want the budget's refusal instead of the body", limit, resp.StatusCode, got)
					}
					select {
					case <-cancelled:
					case <-time.After(5 * time.Second):
						t.Fatal("the upstream request was not cancelled")
					}
					if used != prompt+DefaultOutputLeaseMin {
						t.Fatalf("limit %d: charged %d, want what was held, the prompt and the lease (%d)", limit, used, prompt+DefaultOutputLeaseMin)
					}
				default:
					if resp.StatusCode != http.StatusOK || len(got) != 4000 && tt.encoding == "" {
						t.Fatalf("limit %d: %d, %d bytes, want the whole answer", limit, resp.StatusCode, len(got))
					}
					if used != prompt+4096 {
						t.Fatalf("limit %d: charged %d, want the whole cap held (%d)", limit, used, prompt+4096)
					}
				}
			}
		})
	}
}

// A request refused while streams in flight hold the room waits, up to
// settle_wait, for them to settle: a stream holds a token a byte of its text
// until then, about four times what English costs. Without the wait the
// same request is refused at once.
func TestARefusalWaitsForStreamsInFlightToSettle(t *testing.T) {
	for _, wait := range []string{"settle_wait 0", "settle_wait 3s"} {
		// Each stream holds 1,000 at first: the second does not fit while
		// the first is in flight, and fits once it settled (about 400).
		s := newCeilingSetup(t, 2000, "output_lease_min 1000\n\t\t"+wait)
		s.up.Interval = 10 * time.Millisecond
		proveModels(nil, "wait-m")
		first := make(chan int, 1)
		go func() { first <- s.stream(3, "wait-m", "english") }()
		eventually(t, 5*time.Second, "the first stream under way", func() bool { return s.up.InFlight() == 1 })
		second := s.stream(3, "wait-m", "english")
		if got := <-first; got != http.StatusOK {
			t.Fatalf("%s: the first stream: %d", wait, got)
		}
		counter, billed := s.within("wait-m")
		want := http.StatusOK
		if wait == "settle_wait 0" {
			want = http.StatusTooManyRequests
		}
		if second != want {
			t.Fatalf("%s: the second request: %d, want %d (counter %d, billed %d)", wait, second, want, counter, billed)
		}
	}
}
