package fleetguard

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// A hostile upstream is a local server that answers the way a broken or
// compromised provider (or OpenAI-compatible server) might.
func hostileUpstream(t *testing.T, handler http.HandlerFunc) string {
	t.Helper()
	ts := httptest.NewServer(handler)
	t.Cleanup(ts.Close)
	return ts.URL
}

// hostileSetup runs Caddy on a real Redis in front of upstream, with the
// budgets given, and reads the budget counters from Redis.
type hostileSetup struct {
	t      *testing.T
	url    string
	prefix string
	redis  *redis.Client
	srv    *redistest.Server
}

func newHostileSetup(t *testing.T, upstream, budgets string) *hostileSetup {
	t.Helper()
	srv := redistest.Start(t)
	port := freePort(t)
	s := &hostileSetup{t: t, url: fmt.Sprintf("http://127.0.0.1:%d", port), prefix: fmt.Sprintf("hostile%d", port), srv: srv,
		redis: redis.NewClient(&redis.Options{Addr: srv.Addr()})}
	t.Cleanup(func() { s.redis.Close() })
	startCaddy(t, llmCaddyfile(port, upstream, "fleetguard {\n redis "+srv.URL()+"\n prefix "+s.prefix+"\n }", budgets))
	return s
}

// counter is the one counter of budget name in Redis, after every settle
// (0 when it has none).
func (s *hostileSetup) counter(name string) int64 {
	s.t.Helper()
	waitSettles()
	keys, err := s.redis.Keys(context.Background(), s.prefix+":bg:{b}:"+name+":*").Result()
	if err != nil || len(keys) > 1 {
		s.t.Fatalf("budget %s keys %v %v", name, keys, err)
	}
	if len(keys) == 0 {
		return 0
	}
	n, _ := s.redis.Get(context.Background(), keys[0]).Int64()
	return n
}

// keys are every key the prefix has in Redis.
func (s *hostileSetup) keys() []string {
	s.t.Helper()
	waitSettles()
	keys, err := s.redis.Keys(context.Background(), s.prefix+":*").Result()
	if err != nil {
		s.t.Fatal(err)
	}
	return keys
}

const oneBudget = `budget g {
			limit 1000000
			window 1h
			unit tokens
		}`

// chatAnswer is a chat completion reporting usage (JSON numbers as given).
func chatAnswer(prompt, completion string) string {
	return `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":` + prompt + `,"completion_tokens":` + completion + `}}`
}

// An upstream that reports usage out of range, in tokens or in cost, keeps
// the reservation, is counted, and does not take Caddy down: the same Caddy
// answers the next request. (A negative charge given to a Prometheus counter
// in the settle goroutine panics, and with no recover it ends the process.)
func TestUsageOutOfRangeKeepsTheReservation(t *testing.T) {
	var answer atomic.Value
	up := hostileUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, answer.Load().(string))
	})
	s := newHostileSetup(t, up, oneBudget+`
		budget dollars {
			limit 1000
			unit usd
			window 1h
		}`)
	reserved := promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", chatBody) + 200
	for _, tt := range []struct{ name, prompt, completion string }{
		{"tokens whose sum overflows int64", "5000000000000000000", "5000000000000000000"},
		{"a cost that overflows int64", "10", "1000000000000000000"},
		{"a negative count", "10", "-5000"},
	} {
		before := s.counter("g")
		invalid := testutil.ToFloat64(metrics.llmInvalidUsage)
		answer.Store(chatAnswer(tt.prompt, tt.completion))
		if resp, body := chat(t, s.url, chatBody); resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", tt.name, resp.StatusCode, body)
		}
		if got := s.counter("g"); got != before+reserved {
			t.Errorf("%s: counter %d, want %d + the reservation %d", tt.name, got, before, reserved)
		}
		if got := testutil.ToFloat64(metrics.llmInvalidUsage) - invalid; got != 1 {
			t.Errorf("%s: invalid_usage_total moved by %v, want 1", tt.name, got)
		}
	}
	// The same Caddy still serves, and charges what a sound report says.
	answer.Store(chatAnswer("30", "70"))
	s.servesAndCharges("after the hostile answers", 100)
}

// servesAndCharges sends a chat request, which must be served, and checks
// that it charged budget g what the upstream reports (charged).
func (s *hostileSetup) servesAndCharges(when string, charged int64) {
	s.t.Helper()
	before := s.counter("g")
	if resp, body := chat(s.t, s.url, chatBody); resp.StatusCode != http.StatusOK {
		s.t.Fatalf("%s: %d %s", when, resp.StatusCode, body)
	}
	if got := s.counter("g"); got != before+charged {
		s.t.Errorf("%s: counter %d, want %d", when, got, before+charged)
	}
}

// A panic in a settle is recovered, logged and counted; Caddy keeps serving
// and the next settle applies.
func TestPanicInASettleLeavesCaddyServing(t *testing.T) {
	up := newFakeLLM(t)
	s := newHostileSetup(t, up.URL, oneBudget)
	panics := testutil.ToFloat64(metrics.panics.WithLabelValues("llmbudget settle"))
	boom := func() { panic("a settle that panics") }
	settleFault.Store(&boom)
	t.Cleanup(func() { settleFault.Store(nil) })
	if resp, body := chat(t, s.url, chatBody); resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	waitSettles()
	if got := testutil.ToFloat64(metrics.panics.WithLabelValues("llmbudget settle")) - panics; got != 1 {
		t.Fatalf("panics_total{where=\"llmbudget settle\"} moved by %v, want 1", got)
	}
	settleFault.Store(nil)
	s.servesAndCharges("after the panic", 100)
}

// Methods are read without regard to case: a "post" is budgeted like a
// POST (some frameworks upper-case it and serve it), and a method that is
// neither a read nor POST is refused on a budgeted path, not forwarded.
func TestMethodsAreBudgetedWhateverTheirCase(t *testing.T) {
	up := newFakeLLM(t)
	s := newHostileSetup(t, up.URL, `budget g {
			limit 500
			window 1h
			unit tokens
		}`)
	reserved := promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", chatBody) + 200
	resp, body := do(t, "post", s.url+"/v1/chat/completions", chatBody, "Content-Type: application/json")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("post: %d %s", resp.StatusCode, body)
	}
	if got := s.counter("g"); got != 100 {
		t.Fatalf("a lower-case post: counter %d, want its reported usage 100", got)
	}
	// 100 used: a fifth request of 100 would still fit at 500, but each
	// reserves more than 100 while in flight; fill it with "Post"s until one
	// is denied, and check it was never forwarded.
	denied := false
	for i := 0; i < 10 && !denied; i++ {
		hits := up.Hits()
		resp, _ := do(t, "Post", s.url+"/v1/chat/completions", chatBody, "Content-Type: application/json", "X-Fake-No-Usage: 1")
		if resp.StatusCode == http.StatusTooManyRequests {
			denied = true
			if up.Hits() != hits {
				t.Fatal("a denied Post was forwarded")
			}
		}
	}
	if !denied {
		t.Fatalf("no Post was denied by a 500-token budget (reservations of %d kept)", reserved)
	}
	hits := up.Hits()
	for _, m := range []string{"PUT", "patch", "DELETE"} {
		resp, body := do(t, m, s.url+"/v1/chat/completions", chatBody, "Content-Type: application/json")
		if resp.StatusCode != http.StatusMethodNotAllowed || !strings.Contains(resp.Header.Get("Allow"), "POST") {
			t.Errorf("%s: %d %s (Allow %q), want 405 with Allow", m, resp.StatusCode, body, resp.Header.Get("Allow"))
		}
	}
	for _, m := range []string{"GET", "get", "HEAD", "OPTIONS"} {
		if resp, _ := do(t, m, s.url+"/v1/chat/completions", ""); resp.StatusCode == http.StatusMethodNotAllowed {
			t.Errorf("%s on a budgeted path was refused: reads pass", m)
		}
	}
	if got := up.Hits() - hits; got != 4 {
		t.Errorf("upstream hits %d, want the 4 reads only", got)
	}
}

// A stream whose usage chunk llmbudget takes out (the client did not ask for
// it) and that never ends an event passes through with bounded memory.
func TestEventWithoutEndKeepsMemoryBounded(t *testing.T) {
	const streamBytes = 64 << 20
	chunk := []byte(strings.Repeat("a", 32<<10))
	up := hostileUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: ")
		for sent := 0; sent < streamBytes; sent += len(chunk) {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	})
	s := newHostileSetup(t, up, oneBudget)
	runtime.GC()
	var base runtime.MemStats
	runtime.ReadMemStats(&base)
	var peak atomic.Uint64
	stop := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Add(1)
	go func() {
		defer sampler.Done()
		var m runtime.MemStats
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			runtime.ReadMemStats(&m)
			if m.HeapInuse > peak.Load() {
				peak.Store(m.HeapInuse)
			}
		}
	}()
	resp, _ := doStream(t, s.url+"/v1/chat/completions", streamBody)
	n, err := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	close(stop)
	sampler.Wait()
	if err != nil || n != int64(len("data: ")+streamBytes) {
		t.Fatalf("the client received %d bytes (%v), want the whole stream %d", n, err, len("data: ")+streamBytes)
	}
	growth := int64(peak.Load()) - int64(base.HeapInuse)
	if growth > 32<<20 {
		t.Errorf("heap grew by %d MiB while a %d MiB event passed, want under 32", growth>>20, streamBytes>>20)
	}
	t.Logf("heap growth %.1f MiB for a %d MiB event", float64(growth)/(1<<20), streamBytes>>20)
}

// doStream posts body and returns the response with its body unread.
func doStream(t *testing.T, url, body string) (*http.Response, error) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	return resp, nil
}

// Requests the upstream refuses (random credentials, 401) leave nothing in
// the store once their reservations are released: no counter at 0, no
// record.
func TestRefusedStrangersLeaveNoKeys(t *testing.T) {
	up := hostileUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusUnauthorized)
		io.WriteString(w, `{"error":{"message":"Incorrect API key provided","type":"invalid_request_error","code":"invalid_api_key"}}`)
	})
	s := newHostileSetup(t, up, oneBudget+`
		budget per_key {
			scope key
			limit 100000
			window 1h
			unit tokens
		}
		store_timeout 2s # a loaded test machine is no store outage`)
	const requests, workers = 10000, 16
	var next atomic.Int64
	var wrong atomic.Int64
	var wg sync.WaitGroup
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: workers}}
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1); i <= requests; i = next.Add(1) {
				req, _ := http.NewRequest(http.MethodPost, s.url+"/v1/chat/completions", strings.NewReader(chatBody))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Authorization", fmt.Sprintf("Bearer sk-stranger-%d-%d", i, time.Now().UnixNano()))
				resp, err := client.Do(req)
				if err != nil {
					wrong.Add(1)
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusUnauthorized {
					wrong.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if wrong.Load() != 0 {
		t.Fatalf("%d of %d requests did not get the upstream's 401", wrong.Load(), requests)
	}
	if keys := s.keys(); len(keys) != 0 {
		t.Fatalf("%d keys left after %d refused requests were released, e.g. %v", len(keys), requests, keys[:min(len(keys), 5)])
	}
}

// A settle that finds no reservation (Redis restarted empty while the
// request was in flight) applies nothing and says so: outcome "lost", not
// "ok".
func TestSettleAfterTheStoreLostItsDataIsLost(t *testing.T) {
	release := make(chan struct{})
	up := hostileUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		<-release
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, chatAnswer("30", "70"))
	})
	s := newHostileSetup(t, up, oneBudget)
	lost := testutil.ToFloat64(metrics.llmSettleOutcomes.WithLabelValues("lost"))
	ok := testutil.ToFloat64(metrics.llmSettleOutcomes.WithLabelValues("ok"))
	done := make(chan int)
	go func() {
		resp, err := http.Post(s.url+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
		if err != nil {
			done <- 0
			return
		}
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	// The reservation is in Redis once the request reaches the upstream.
	eventually(t, 5*time.Second, "the reservation reaching Redis", func() bool { return len(s.keys()) > 0 })
	s.srv.Stop()
	if err := s.srv.Restart(); err != nil {
		t.Fatal(err)
	}
	close(release)
	if code := <-done; code != http.StatusOK {
		t.Fatalf("the request in flight: %d", code)
	}
	waitSettles()
	if got := testutil.ToFloat64(metrics.llmSettleOutcomes.WithLabelValues("lost")) - lost; got != 1 {
		t.Errorf("settle_outcomes_total{outcome=\"lost\"} moved by %v, want 1", got)
	}
	if got := testutil.ToFloat64(metrics.llmSettleOutcomes.WithLabelValues("ok")) - ok; got != 0 {
		t.Errorf("settle_outcomes_total{outcome=\"ok\"} moved by %v, want 0", got)
	}
}

// The log block of examples/llm.Caddyfile keeps API keys out of the access
// log: Gemini's ?key= in the URI and the key headers. (Caddy redacts
// Authorization by itself.)
func TestExampleLogFilterKeepsKeysOutOfTheAccessLog(t *testing.T) {
	example, err := os.ReadFile("examples/llm.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	block := regexp.MustCompile(`(?s)\n\tlog \{\n.*?\n\t\}\n`).Find(example)
	if block == nil {
		t.Fatal("examples/llm.Caddyfile has no log block")
	}
	logFile := filepath.Join(t.TempDir(), "access.log")
	logBlock := strings.Replace(string(block), "\tlog {\n", "\tlog {\n\t\toutput file "+logFile+"\n", 1)
	up := newFakeLLM(t)
	port := freePort(t)
	startCaddy(t, testCaddyfile{Port: port, Upstream: up.URL, LLMBudget: []string{oneBudget}, Directives: []string{logBlock}}.String())
	const secret = "AIzaSy-not-a-real-key-0123456789"
	url := fmt.Sprintf("http://127.0.0.1:%d/v1beta/models/gemini-2.0-flash:generateContent?key=%s&alt=json", port, secret)
	if resp, body := do(t, http.MethodPost, url, `{"contents":[{"parts":[{"text":"hi"}]}]}`,
		"Content-Type: application/json", "X-Goog-Api-Key: "+secret, "X-Api-Key: "+secret); resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	logged := eventuallyValue(t, 5*time.Second, "an access log line", func() []byte {
		logged, _ := os.ReadFile(logFile)
		return logged
	}, func(logged []byte) bool { return len(logged) > 0 })
	if strings.Contains(string(logged), secret) {
		t.Fatalf("the access log holds the key:\n%s", logged)
	}
	if !strings.Contains(string(logged), "alt=json") {
		t.Fatalf("the access log lost the rest of the query:\n%s", logged)
	}
}

// Requests are read as the upstream reads them, at the HTTP edge: what the
// budget holds for an answer without usage (the whole reservation) shows
// what it read.
func TestReservationsReadRequestsAsUpstreamsDo(t *testing.T) {
	up := hostileUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{}`) // no usage: the reservation stands
	})
	s := newHostileSetup(t, up, `budget g {
			limit 10000000
			window 1h
			unit tokens
		}
		budget per_model {
			scope model
			limit 10000000
			window 1h
			unit tokens
		}`)
	gemini := `{"contents":[{"parts":[{"text":"hi"}]}],"generation_config":{"candidate_count":8,"max_output_tokens":1000}}`
	for _, tt := range []struct {
		name, path, body string
		atLeast          int64
	}{
		{"Gemini's snake_case generation_config", "/v1beta/models/gemini-1.5-flash:generateContent", gemini, 8 * 1000},
		{"legacy completions' best_of", "/v1/completions", `{"model":"gpt-3.5-turbo-instruct","prompt":"hi","best_of":20,"max_tokens":1000}`, 20 * 1000},
	} {
		before := s.counter("g")
		if resp, body := do(t, http.MethodPost, s.url+tt.path, tt.body, "Content-Type: application/json"); resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", tt.name, resp.StatusCode, body)
		}
		if got := s.counter("g") - before; got < tt.atLeast {
			t.Errorf("%s: held %d, want at least %d", tt.name, got, tt.atLeast)
		}
	}
	// The model is taken from the path as the upstream routes it (cleaned):
	// a model budget charges gemini-2.5-pro, not the flash named before "..".
	path := "/v1beta/models/gemini-2.0-flash/../gemini-2.5-pro:generateContent"
	req, _ := http.NewRequest(http.MethodPost, s.url+path, strings.NewReader(`{"contents":[{"parts":[{"text":"hi"}]}]}`))
	req.URL.Opaque = path // sent as written, not cleaned by the client
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %v %v", path, resp, err)
	}
	waitSettles()
	pro, _ := s.redis.Keys(context.Background(), s.prefix+":bg:{b}:per_model:model-"+keyhash.Of("gemini-2.5-pro").String()+":*").Result()
	flash, _ := s.redis.Keys(context.Background(), s.prefix+":bg:{b}:per_model:model-"+keyhash.Of("gemini-2.0-flash").String()+":*").Result()
	if len(pro) != 1 || len(flash) != 0 {
		t.Fatalf("model counters: gemini-2.5-pro %v, gemini-2.0-flash %v; want the request charged to gemini-2.5-pro only", pro, flash)
	}
}
