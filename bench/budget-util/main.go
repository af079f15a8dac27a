// Command budget-util measures how much of an llmbudget token budget streaming
// clients can spend: a real Caddy built from this checkout, one global budget
// (memory store, or -redis for a throwaway redis-server), in front of
// internal/fakellm in words mode (one token a chunk, -output tokens -interval
// apart). -clients streaming clients post chat completions (-format chat) or
// Anthropic Messages (-format anthropic) of -model with max_tokens -cap, all
// at once at first, each looping until its first refusal. It prints
// how many of the first requests were admitted, the share of the limit spent
// by the requests admitted before the first refusal, the counter at the end
// against the limit and against the upstream's reported usage, and the
// tokens the upstream generated that no client received (the residual).
// With -requests each client sends that many requests instead, one after
// the other; with -redis it also prints the store calls a stream and an
// event made (the lease extensions llmbudget counted, and Redis's own count
// of scripts), and -instances runs that many Caddy processes on it.
//
//	go run ./bench/budget-util [-limit 100000] [-clients 64] [-output 300] [-interval 5ms] [-cap 4096] [-warm 2]
//	    [-format chat|anthropic] [-model gpt-4o|claude-sonnet-4-5|...] [-settle-wait 2s] [-requests 1] [-redis [-instances 2]]
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/bench/internal/benchkit"
	"github.com/fleetguard/fleetguard/internal/fakellm"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

var (
	limit     = flag.Int64("limit", 100000, "the global budget's limit, tokens per -window")
	window    = flag.Duration("window", time.Hour, "the budget's window")
	clients   = flag.Int("clients", 64, "concurrent streaming clients")
	output    = flag.Int("output", 300, "tokens per answer (fakellm -output)")
	input     = flag.Int("input", 20, "prompt tokens the upstream reports")
	interval  = flag.Duration("interval", 5*time.Millisecond, "time between tokens of a stream")
	capTok    = flag.Int("cap", 4096, "max_tokens of every request")
	jitter    = flag.Float64("jitter", 0, "vary each answer's length by up to this fraction of -output either way")
	warm      = flag.Int("warm", 5, "answers sent first: the first proves the model (it bills no output its text does not show) and loads its tokenizer in the background (its own where it is public, else its proxy); the second proves the tokenizer's count, so that the clients' streams lease, by that count, from their first request; a proxy needs four counted answers to learn its scale; from the 8th on, the model's lease is learned from them (0: a cold model, whose streams hold their whole cap until one answer proves it); their usage counts against the limit")
	instances = flag.Int("instances", 1, "Caddy processes on the one store (more than 1 needs -redis); client i posts to instance i mod n, and -warm goes to each")
	requests  = flag.Int("requests", 0, "requests each client sends, one after the other (0: each loops until its first refusal)")
	useRedis  = flag.Bool("redis", false, "keep the budget in a throwaway redis-server instead of the memory store")
	caddyBin  = flag.String("caddy", "", "a Caddy built from this checkout (default: build ./cmd/caddy into a scratch folder)")
	format    = flag.String("format", "chat", "the API the clients speak: chat (OpenAI chat completions) or anthropic (Messages)")
	model     = flag.String("model", "", "the model the clients name (default gpt-4o for chat, claude-sonnet-4-5 for anthropic)")
	settle    = flag.Duration("settle-wait", -1, "llmbudget's settle_wait (default: llmbudget's own)")
)

// result is one request as a client saw it.
type result struct {
	client   int
	first    bool // the client's first request (sent with all the others at once)
	sent     time.Time
	answered time.Time // response headers
	status   int
	err      error
	chunks   int    // content chunks (one token each) received
	finish   string // the last finish_reason
	usage    bool   // a usage chunk came
	prompt   int
	complete int
	done     bool // [DONE] came
	ended    time.Time
	// remaining is the budget's room a refusal's RateLimit header shows
	// (-1: none).
	remaining int64
}

func main() {
	flag.Parse()
	benchkit.Main("budget-util", run)
}

func run(ctx context.Context) error {
	dir, cleanup, err := benchkit.Scratch("budget-util", "BUDGET_UTIL_KEEP")
	if err != nil {
		return err
	}
	defer cleanup()
	bin, err := benchkit.Caddy(ctx, *caddyBin, dir)
	if err != nil {
		return err
	}

	// The upstream, in this process so its Generated counter can be read.
	up := &fakellm.Server{Input: *input, Output: *output, Interval: *interval,
		Words: true, Jitter: *jitter}
	upLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	upSrv := &http.Server{Handler: up}
	go func() { _ = upSrv.Serve(upLn) }()
	defer upSrv.Close()

	global, store, redisAddr := "", "memory store", ""
	if *useRedis {
		rs, err := redistest.Launch()
		if err != nil {
			return err
		}
		defer rs.Stop()
		global = fmt.Sprintf("\tfleetguard {\n\t\tredis %s\n\t\tprefix budgetutil\n\t}\n", rs.URL())
		store, redisAddr = "redis "+rs.Addr(), rs.Addr()
	}
	if *instances < 1 || *instances > 1 && !*useRedis {
		return errors.New("-instances: 1, or more with -redis (they share its counters)")
	}
	settleWait := ""
	if *settle >= 0 {
		settleWait = fmt.Sprintf("\t\tsettle_wait %s\n", *settle)
	}
	var sitePorts, admins []string
	for n := range *instances {
		sitePort, err := benchkit.FreePort()
		if err != nil {
			return err
		}
		adminPort, err := benchkit.FreePort()
		if err != nil {
			return err
		}
		caddyfile := fmt.Sprintf(`{
	admin 127.0.0.1:%d
%s}
http://127.0.0.1:%d {
	llmbudget {
		budget all {
			scope global
			unit tokens
			limit %d
			window %s
		}
%s	}
	reverse_proxy %s
}
`, adminPort, global, sitePort, *limit, *window, settleWait, upLn.Addr())
		cfgPath := filepath.Join(dir, fmt.Sprintf("Caddyfile%d", n))
		if err := os.WriteFile(cfgPath, []byte(caddyfile), 0o644); err != nil {
			return err
		}
		logf, err := os.Create(filepath.Join(dir, fmt.Sprintf("caddy%d.log", n)))
		if err != nil {
			return err
		}
		defer logf.Close()
		caddy := exec.Command(bin, "run", "--config", cfgPath, "--adapter", "caddyfile")
		caddy.Stdout, caddy.Stderr = logf, logf
		if err := caddy.Start(); err != nil {
			return err
		}
		defer func() {
			_ = caddy.Process.Signal(syscall.SIGTERM)
			_ = caddy.Wait()
		}()
		admin := fmt.Sprintf("http://127.0.0.1:%d", adminPort)
		if _, err := waitCounter(ctx, admin, 30*time.Second); err != nil {
			tail, _ := os.ReadFile(logf.Name())
			return fmt.Errorf("caddy did not come up: %w\n%s", err, tail)
		}
		sitePorts, admins = append(sitePorts, strconv.Itoa(sitePort)), append(admins, admin)
	}
	admin := admins[0] // the counters are the store's: any instance shows them
	anthropic := *format == "anthropic"
	if !anthropic && *format != "chat" {
		return fmt.Errorf("-format %q: want chat or anthropic", *format)
	}
	if *model == "" {
		*model = "gpt-4o"
		if anthropic {
			*model = "claude-sonnet-4-5"
		}
	}
	path := "/v1/chat/completions"
	body := fmt.Sprintf(`{"model":%q,"stream":true,"max_tokens":%d,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"write about budgets"}]}`, *model, *capTok)
	if anthropic {
		path = "/v1/messages"
		body = fmt.Sprintf(`{"model":%q,"stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"write about budgets"}]}`, *model, *capTok)
	}
	sites := make([]string, len(sitePorts))
	for i, port := range sitePorts {
		sites[i] = "http://127.0.0.1:" + port + path
	}
	before, err := readCounter(admin)
	if err != nil {
		return err
	}
	if before.used != 0 {
		return fmt.Errorf("the budget starts at %d used, want 0", before.used)
	}

	// The clients: all first requests at once, then each loops until its
	// first refusal.
	hc := &http.Client{Transport: &http.Transport{
		MaxIdleConnsPerHost: *clients, MaxConnsPerHost: *clients, DisableCompression: true,
	}}
	// On each instance (each learns for itself), the first two one after the
	// other (the first proves the model, the second its tokenizer's count),
	// the rest at once.
	for _, site := range sites {
		for i := 0; i < *warm; {
			n := 1
			if i >= 2 {
				n = *warm - i
			}
			errs := make(chan error, n)
			for range n {
				go func() {
					var err error
					if r := stream(ctx, hc, site, body); r.err != nil || r.status != http.StatusOK {
						err = fmt.Errorf("a warm-up answer: %d %v", r.status, r.err)
					}
					errs <- err
				}()
			}
			for range n {
				if err := <-errs; err != nil {
					return err
				}
			}
			i += n
			time.Sleep(200 * time.Millisecond) // their settles
		}
	}
	warmGenerated := up.Generated() // not the clients' to receive
	callsBefore, err := storeCalls(ctx, redisAddr, admins)
	if err != nil {
		return err
	}
	var (
		mu      sync.Mutex
		results []result
		wg      sync.WaitGroup
	)
	ready := make(chan struct{})
	for c := range *clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-ready
			for n, first := 0, true; ctx.Err() == nil && (*requests == 0 || n < *requests); n, first = n+1, false {
				r := stream(ctx, hc, sites[c%len(sites)], body)
				r.client, r.first = c, first
				mu.Lock()
				results = append(results, r)
				mu.Unlock()
				if r.err != nil || r.status < 200 || r.status > 299 {
					return
				}
			}
		}()
	}
	start := time.Now()
	close(ready)
	wg.Wait()
	wall := time.Since(start)
	if ctx.Err() != nil {
		return ctx.Err()
	}

	// Settles run after the response: wait for the counter to hold still.
	var end counter
	for prev := int64(-1); ; prev = end.used {
		time.Sleep(300 * time.Millisecond)
		if end, err = readCounter(admin); err != nil {
			return err
		}
		if end.used == prev {
			break
		}
	}
	if !end.windowStart.Equal(before.windowStart) {
		log.Printf("warning: the budget's window turned over during the run (%s → %s): run it again", before.windowStart, end.windowStart)
	}

	// The figures.
	var (
		firstAdmitted, admitted, truncated, noUsage, refusals, errs int
		firstRefusal                                                time.Time
		reported, received                                          int64
		statuses                                                    = map[int]int{}
	)
	for _, r := range results {
		switch {
		case r.err != nil:
			errs++
		case r.status >= 200 && r.status <= 299:
		default:
			refusals++
			statuses[r.status]++
			if firstRefusal.IsZero() || r.answered.Before(firstRefusal) {
				firstRefusal = r.answered
			}
		}
	}
	var spentBefore int64
	var admittedBefore int
	for _, r := range results {
		if r.err != nil || r.status < 200 || r.status > 299 {
			continue
		}
		admitted++
		if r.first {
			firstAdmitted++
		}
		received += int64(r.chunks)
		if r.usage {
			reported += int64(r.prompt + r.complete)
		} else {
			noUsage++
		}
		if (r.finish == "length" || r.finish == "max_tokens") && r.chunks < *capTok {
			truncated++
		}
		if firstRefusal.IsZero() || r.sent.Before(firstRefusal) {
			admittedBefore++
			spentBefore += int64(r.prompt + r.complete)
		}
	}
	generated := up.Generated() - warmGenerated
	pct := func(a, b int64) float64 { return 100 * float64(a) / float64(b) }
	fmt.Printf("budget-util: one global budget of %d tokens per %s (%s), %d streaming clients (%s, model %s), max_tokens %d;\n", *limit, *window, store, *clients, *format, *model, *capTok)
	fmt.Printf("  upstream fakellm words mode: %d prompt tokens, %d output tokens %s apart (jitter %.0f%%)\n", *input, *output, *interval, *jitter*100)
	fmt.Printf("concurrency admitted (first %d requests, sent at once): %d of %d\n", *clients, firstAdmitted, *clients)
	if firstRefusal.IsZero() {
		fmt.Printf("share of the limit spent before the first refusal: no refusal (%d requests, %d tokens, %.1f%%)\n", admittedBefore, spentBefore, pct(spentBefore, *limit))
	} else {
		fmt.Printf("share of the limit spent before the first refusal: %.1f%% (%d tokens reported by the %d requests admitted before it, %.2f s in)\n",
			pct(spentBefore, *limit), spentBefore, admittedBefore, firstRefusal.Sub(start).Seconds())
	}
	fmt.Printf("counter at the end: %d of %d = %.1f%% of the limit\n", end.used, *limit, pct(end.used, *limit))
	if end.used > 0 {
		fmt.Printf("upstream's reported usage / counter: %d / %d = %.4f\n", reported, end.used, float64(reported)/float64(end.used))
		bill := up.Hits()*int64(*input) + generated + warmGenerated
		fmt.Printf("upstream's bill (prompt of each request it got + tokens generated) / counter: %d / %d = %.4f\n", bill, end.used, float64(bill)/float64(end.used))
	}
	fmt.Printf("requests admitted: %d; truncated streams (finish_reason length below max_tokens): %d; admitted streams without a usage chunk: %d\n", admitted, truncated, noUsage)
	if refusals > 0 {
		lowest, highest := int64(-1), int64(-1)
		for _, r := range results {
			if r.err == nil && (r.status < 200 || r.status > 299) && r.remaining >= 0 {
				held := *limit - r.remaining
				if lowest < 0 || held < lowest {
					lowest = held
				}
				highest = max(highest, held)
			}
		}
		if lowest >= 0 {
			fmt.Printf("counter (held and spent) when a request was refused, by its RateLimit header: lowest %.1f%%, highest %.1f%% of the limit\n", pct(lowest, *limit), pct(highest, *limit))
		}
	}
	var codes []string
	for code, n := range statuses {
		codes = append(codes, fmt.Sprintf("%d×%d", n, code))
	}
	fmt.Printf("refusals: %d (%s); client errors: %d\n", refusals, strings.Join(codes, ", "), errs)
	fmt.Printf("upstream generated %d output tokens, clients received %d: residual (generated, never received) %d; streams the upstream stopped early: %d\n",
		generated, received, generated-received, up.Stopped())
	if redisAddr != "" {
		after, err := storeCalls(ctx, redisAddr, admins)
		if err != nil {
			return err
		}
		calls, exts := after.scripts-callsBefore.scripts, after.extensions-callsBefore.extensions
		streams := int64(admitted)
		// An admitted stream makes one reserve, its extensions and one
		// settle; Redis's own count has the refused requests' calls too
		// (a reserve, and a release of one that timed out).
		perStream := 2 + float64(exts)/float64(max(streams, 1))
		fmt.Printf("store calls of the %d admitted streams (a reserve, %d lease extensions, a settle): %.2f a stream, %.4f an event of their %d; Redis ran %d scripts in all (refused requests' included)\n",
			streams, exts, perStream, perStream*float64(streams)/float64(max(received, 1)), received, calls)
		fmt.Printf("events a second a stream: nominal %.0f, received %.0f (events over each stream's time from its request to its end, mean)\n",
			float64(time.Second)/float64(max(*interval, time.Microsecond)), eventRate(results))
	}
	fmt.Printf("wall time: %.1f s\n", wall.Seconds())
	return nil
}

// eventRate is the mean, over admitted streams, of the events a stream
// received a second from its request to its end.
func eventRate(results []result) float64 {
	var sum float64
	var n int
	for _, r := range results {
		if d := r.ended.Sub(r.sent).Seconds(); r.err == nil && r.status == http.StatusOK && r.chunks > 0 && d > 0 {
			sum += float64(r.chunks) / d
			n++
		}
	}
	return sum / float64(max(n, 1))
}

// calls are the store calls made so far: the scripts Redis ran (every
// budget call is one script: a reserve, an extension, a settle) and the
// lease extensions llmbudget counted.
type calls struct{ scripts, extensions int64 }

// storeCalls reads Redis's command counts (INFO commandstats: EVALSHA and
// EVAL, which is what a script the server had not cached yet is sent as)
// and llmbudget's extension counter from Caddy's /metrics. Without -redis
// there is nothing to count.
func storeCalls(ctx context.Context, addr string, admins []string) (calls, error) {
	if addr == "" {
		return calls{}, nil
	}
	rc := redis.NewClient(&redis.Options{Addr: addr})
	defer rc.Close()
	info, err := rc.Info(ctx, "commandstats").Result()
	if err != nil {
		return calls{}, err
	}
	var c calls
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || (name != "cmdstat_evalsha" && name != "cmdstat_eval") {
			continue
		}
		v, _, _ := strings.Cut(strings.TrimPrefix(rest, "calls="), ",")
		n, _ := strconv.ParseInt(v, 10, 64)
		c.scripts += n
	}
	for _, admin := range admins {
		resp, err := http.Get(admin + "/metrics")
		if err != nil {
			return calls{}, err
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return calls{}, err
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "fleetguard_llmbudget_lease_extensions_total{"); ok {
				f, _ := strconv.ParseFloat(v[strings.LastIndexByte(v, ' ')+1:], 64)
				c.extensions += int64(f)
			}
		}
	}
	return c, nil
}

// stream posts one request and reads its answer to the end.
func stream(ctx context.Context, hc *http.Client, url, body string) (r result) {
	r.sent = time.Now()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		r.err = err
		return r
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer budget-util")
	req.Header.Set("X-Api-Key", "budget-util")
	req.Header.Set("Anthropic-Version", "2023-06-01")
	resp, err := hc.Do(req)
	r.answered = time.Now()
	if err != nil {
		r.err = err
		return r
	}
	defer resp.Body.Close()
	r.status = resp.StatusCode
	if r.status < 200 || r.status > 299 {
		r.remaining = -1
		if _, item, ok := strings.Cut(resp.Header.Get("RateLimit"), ";r="); ok {
			v, _, _ := strings.Cut(item, ";")
			r.remaining, _ = strconv.ParseInt(v, 10, 64)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		return r
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data:")
		if !ok {
			continue
		}
		data = strings.TrimSpace(data)
		if data == "[DONE]" {
			r.done = true
			continue
		}
		if anthropicEvent(data, &r) {
			continue
		}
		var c fakellm.ChatChunk
		if json.Unmarshal([]byte(data), &c) != nil {
			continue
		}
		for _, ch := range c.Choices {
			if ch.Delta.Content != nil && *ch.Delta.Content != "" {
				r.chunks++
			}
			if ch.FinishReason != nil {
				r.finish = *ch.FinishReason
			}
		}
		if c.Usage != nil {
			r.usage, r.prompt, r.complete = true, c.Usage.Prompt, c.Usage.Completion
		}
	}
	if err := sc.Err(); err != nil && !errors.Is(err, io.EOF) {
		r.err = err
	}
	r.ended = time.Now()
	return r
}

// anthropicEvent reads an Anthropic Messages event into r; false when data
// is none.
func anthropicEvent(data string, r *result) bool {
	var ev struct {
		Type    string `json:"type"`
		Message struct {
			Usage struct {
				Input int `json:"input_tokens"`
			} `json:"usage"`
		} `json:"message"`
		Delta struct {
			Text       string `json:"text"`
			StopReason string `json:"stop_reason"`
		} `json:"delta"`
		Usage struct {
			Output int `json:"output_tokens"`
		} `json:"usage"`
	}
	if json.Unmarshal([]byte(data), &ev) != nil || ev.Type == "" {
		return false
	}
	switch ev.Type {
	case "message_start":
		r.prompt = ev.Message.Usage.Input
	case "content_block_delta":
		if ev.Delta.Text != "" {
			r.chunks++
		}
	case "message_delta":
		r.usage, r.complete = true, ev.Usage.Output
		if ev.Delta.StopReason != "" {
			r.finish = ev.Delta.StopReason
		}
	case "message_stop":
		r.done = true
	}
	return true
}

// counter is the global budget as the admin API shows it.
type counter struct {
	used        int64
	windowStart time.Time
}

func readCounter(admin string) (counter, error) {
	resp, err := http.Get(admin + "/fleetguard/budgets/all")
	if err != nil {
		return counter{}, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return counter{}, fmt.Errorf("GET /fleetguard/budgets/all: %d %s", resp.StatusCode, b)
	}
	var v struct {
		Used        json.Number `json:"used"`
		WindowStart time.Time   `json:"window_start"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return counter{}, err
	}
	used, err := strconv.ParseInt(v.Used.String(), 10, 64)
	return counter{used: used, windowStart: v.WindowStart}, err
}

// waitCounter reads the budget once Caddy answers, within timeout.
func waitCounter(ctx context.Context, admin string, timeout time.Duration) (counter, error) {
	deadline := time.Now().Add(timeout)
	for {
		c, err := readCounter(admin)
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			return c, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}
