package fleetguard

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/redistest"
)

// The stalls of TestAStoreStallCutsNoStreamThatCanWaitItOut, to try
// others by hand (-stall.pause 100ms -stall.sleep 10s): what the test
// asserts of the pause (no stream cut) holds for a pause the breaker's
// probe sees answered (within 1 s); pauses of more than 250 ms overlap.
var (
	stallPause = flag.Duration("stall.pause", 150*time.Millisecond, "the CLIENT PAUSE of the stall test")
	stallSleep = flag.Duration("stall.sleep", time.Second, "the DEBUG SLEEP of the stall test")
)

// streamSeen is one leased stream as its client read it.
type streamSeen struct {
	status  int
	events  int    // content chunks
	finish  string // the last finish_reason
	charged int64  // prompt + completion of its usage chunk (-1: none)
	err     error
}

// readChatStream posts body to url with headers ("Name: value") and reads
// the stream to its end; seen counts each content chunk as it arrives.
func readChatStream(url, body string, seen func(), headers ...string) (s streamSeen) {
	s.charged = -1
	req, err := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		s.err = err
		return s
	}
	req.Header.Set("Content-Type", "application/json")
	for _, h := range headers {
		name, value, _ := strings.Cut(h, ": ")
		req.Header.Set(name, value)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.err = err
		return s
	}
	defer resp.Body.Close()
	s.status = resp.StatusCode
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *struct {
				Prompt     int64 `json:"prompt_tokens"`
				Completion int64 `json:"completion_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			s.err = fmt.Errorf("an event that is no JSON: %q", data)
			return s
		}
		for _, c := range chunk.Choices {
			if c.Delta.Content != "" {
				s.events++
				seen()
			}
			if c.FinishReason != nil {
				s.finish = *c.FinishReason
			}
		}
		if chunk.Usage != nil {
			s.charged = chunk.Usage.Prompt + chunk.Usage.Completion
		}
	}
	s.err = sc.Err()
	return s
}

// budgetStoreErrors is the budget store calls that failed in the Caddy whose
// admin endpoint is admin (GET /fleetguard/status).
func budgetStoreErrors(t *testing.T, admin string) uint64 {
	t.Helper()
	var n uint64
	for _, s := range storeStatuses(t, admin) {
		n += s.BudgetStoreErrors
	}
	return n
}

// TestAStoreStallCutsNoStreamThatCanWaitItOut: 50 leased streams in flight
// (300 tokens at 50 a second) on two Caddy processes sharing one Redis.
// Redis pauses for 150 ms (CLIENT PAUSE) until a pause has made some
// extension fail: no stream is cut (an extension that fails is tried again
// within the stream's slack, and once the stream waits at its lease until
// the breaker's probe fails too; one timeout does not open the breaker for
// the other streams), every stream runs to its end, and the counter is
// exactly what they reported. Then Redis sleeps 1 s (DEBUG SLEEP) under 50
// more: a stream that reaches its lease in it ends there once the probe has
// failed (most do; the test asserts no number), and the counter is still
// exactly what the streams were told they were charged (reported, or the
// lease a cut stream held), nothing lost or charged twice.
func TestAStoreStallCutsNoStreamThatCanWaitItOut(t *testing.T) {
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	up := newFakeLLM(t)
	const output = 300
	up.Output, up.Words, up.Interval = output, true, 20*time.Millisecond
	// The warm-up answers come from an upstream of their own, at once.
	warmUp := newFakeLLM(t)
	warmUp.Output, warmUp.Words, warmUp.Interval = output, true, 0
	var urls, admins []string
	for range 2 {
		port, admin := freePort(t), fmt.Sprintf("127.0.0.1:%d", freePort(t))
		startCaddyProcess(t, fmt.Sprintf(`{
	admin %s
	fleetguard {
		redis %s
		prefix pause
	}
}
:%d {
	llmbudget {
		budget all {
			limit 100000000
			window 1h
			unit tokens
		}
		settle_wait 0
	}
	@warm header X-Warm-Up 1
	reverse_proxy @warm %s
	reverse_proxy %s
}
`, admin, srv.URL(), port, strings.TrimPrefix(warmUp.URL, "http://"), strings.TrimPrefix(up.URL, "http://")), fmt.Sprintf("127.0.0.1:%d", port))
		urls, admins = append(urls, fmt.Sprintf("http://127.0.0.1:%d", port)), append(admins, admin)
	}
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr(), ReadTimeout: -1}) // it waits out a DEBUG SLEEP
	t.Cleanup(func() { rc.Close() })
	counter := func() int64 { return sumCounters(t, rc, "pause:bg:{b}:all:*") }
	// Settled: no reservation's record is still "r" (reserved); a settled
	// one is gone, or a tombstone ("x": a reserve that timed out on a busy
	// machine, released by id).
	settled := func() bool {
		records, _ := rc.Keys(context.Background(), "pause:bg:{b}:res:*").Result()
		for _, r := range records {
			if st, _ := rc.HGet(context.Background(), r, "s").Result(); st == "r" {
				return false
			}
		}
		return true
	}
	// Models whose tokenizer is not public, counted a token a byte: a
	// lease grows with each word's 4.5 bytes, so a stream of 300 events
	// makes about four extensions, early and late, for the stalls to catch.
	// Each stall has a model of its own: the streams through the first
	// teach theirs a lease that the next streams of it would end within.
	bodyOf := func(model string) string {
		return `{"model":"` + model + `","stream":true,"stream_options":{"include_usage":true},"max_tokens":4096,"messages":[{"role":"user","content":"go on"}]}`
	}
	paused, slept := bodyOf("llama-3.1-8b"), bodyOf("llama-3.1-70b")
	// An answer of each on each Caddy proves the model there, so that the
	// streams lease from their first byte.
	var charged int64
	for _, url := range urls {
		for _, body := range []string{paused, slept} {
			s := readChatStream(url, body, func() {}, "X-Warm-Up: 1")
			if s.status != http.StatusOK || s.charged < 0 || s.err != nil {
				t.Fatalf("a warm-up answer: %+v", s)
			}
			charged += s.charged
			eventually(t, 5*time.Second, "the warm-up answer's settle", settled)
		}
	}

	// run runs 50 streams, 25 on each Caddy, and stalls once each has
	// streamed 35 events, near its first extension (which starts at a
	// count of 192, three quarters of the first lease of 256: 16 and 4.5
	// an event).
	run := func(body string, stall func()) []streamSeen {
		const n = 50
		seen := make([]streamSeen, n)
		var started sync.WaitGroup
		started.Add(n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				events := 0
				// A reserve that timed out before any stall (50 at once on
				// a busy machine under -race) is no stream the stall cut:
				// it is sent again, for up to 20 s, since the timeouts may
				// have opened the store's breaker, which refuses reserves
				// until a probe answers.
				for retryUntil := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
					seen[i] = readChatStream(urls[i%2], body, func() {
						if events++; events == 35 {
							started.Done()
						}
					})
					if events > 0 || seen[i].status != http.StatusServiceUnavailable || time.Now().After(retryUntil) {
						break
					}
				}
				if events < 35 {
					started.Done()
				}
			}()
		}
		started.Wait()
		stall()
		wg.Wait()
		return seen
	}

	var errorsBefore uint64
	pauses := 0
	seen := run(paused, func() {
		// (Counted from here: a reserve of the 50 at once may have timed
		// out on a busy machine before the stall.)
		errorsBefore = budgetStoreErrors(t, admins[0]) + budgetStoreErrors(t, admins[1])
		// Pause until an extension has failed in a pause (each one may fall
		// between the streams' extensions on a slow machine), at most 10
		// times, 150 ms each with 100 ms between.
		for pauses < 10 && budgetStoreErrors(t, admins[0])+budgetStoreErrors(t, admins[1]) == errorsBefore {
			if err := rc.Do(context.Background(), "CLIENT", "PAUSE", stallPause.Milliseconds()).Err(); err != nil {
				t.Error(err)
				return
			}
			pauses++
			time.Sleep(250 * time.Millisecond)
		}
	})
	failed := budgetStoreErrors(t, admins[0]) + budgetStoreErrors(t, admins[1]) - errorsBefore
	if failed == 0 {
		t.Fatalf("%d pauses of %v made no store call fail: the test proves nothing", pauses, *stallPause)
	}
	for i, s := range seen {
		if s.err != nil || s.status != http.StatusOK || s.finish != "stop" || s.events != output || s.charged < 0 {
			t.Fatalf("stream %d of 50, through %d pauses of %v that failed %d store calls: %+v; want all %d events, finish_reason stop, and its usage",
				i, pauses, *stallPause, failed, s, output)
		}
		charged += s.charged
	}
	t.Logf("%d pauses of %v failed %d store calls; no stream of 50 was cut", pauses, *stallPause, failed)
	eventually(t, 10*time.Second, "the settles", settled)
	if got := counter(); got != charged {
		t.Fatalf("after the pauses: counter %d, want %d, what the streams reported", got, charged)
	}

	seen = run(slept, func() {
		if err := rc.Do(context.Background(), "DEBUG", "SLEEP", stallSleep.Seconds()).Err(); err != nil {
			t.Error(err)
		}
	})
	cut := 0
	for i, s := range seen {
		if s.err != nil || s.status != http.StatusOK || s.charged < 0 || (s.finish != "stop" && s.finish != "length") {
			t.Fatalf("stream %d of 50 through a %v sleep: %+v; want a finished answer and its usage", i, *stallSleep, s)
		}
		if s.finish == "length" {
			cut++
		}
		charged += s.charged
	}
	t.Logf("a %v sleep cut %d of 50 streams", *stallSleep, cut)
	eventually(t, 20*time.Second+*stallSleep, "the settles and the background resolutions", func() bool {
		return settled() && counter() == charged
	})
}
