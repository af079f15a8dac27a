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
// With -restart, the warm-up answers go through the first instance only,
// then every instance restarts and the clients post to the last one: what
// the fleet learned of the model must have survived.
//
//	go run ./bench/budget-util [-limit 100000] [-clients 64] [-output 300] [-interval 5ms] [-cap 4096] [-warm 2]
//	    [-format chat|anthropic] [-model gpt-4o|claude-sonnet-4-5|...] [-settle-wait 2s] [-requests 1] [-redis [-instances 2] [-restart]]
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
	"slices"
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
	restart   = flag.Bool("restart", false, "with -redis: -warm goes to the first instance only, then every instance is stopped and started again (a deploy) and the clients post to the last one only: what the fleet learned of the model must survive it")
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
	dir, bin, cleanup, err := benchkit.Workspace(ctx, "budget-util", "BUDGET_UTIL_KEEP", *caddyBin)
	if err != nil {
		return err
	}
	defer cleanup()
	up, upAddr, stopUpstream, err := startUpstream()
	if err != nil {
		return err
	}
	defer stopUpstream()
	st, err := startStore()
	if err != nil {
		return err
	}
	defer st.stop()
	var stops []func()
	defer func() {
		for _, stop := range stops {
			stop()
		}
	}()
	if *restart && st.redisAddr == "" {
		return errors.New("-restart needs -redis: the memory store does not outlive its process")
	}
	path, body, err := request()
	if err != nil {
		return err
	}
	// start (re)starts every instance, and returns their sites and admins.
	start := func() (sites, admins []string, err error) {
		for _, stop := range stops {
			stop()
		}
		stops = nil
		bases, admins, err := startInstances(ctx, bin, dir, st.global, upAddr, &stops)
		if err != nil {
			return nil, nil, err
		}
		for _, base := range bases {
			sites = append(sites, base+path)
		}
		return sites, admins, nil
	}
	sites, admins, err := start()
	if err != nil {
		return err
	}
	before, err := readCounter(admins[0]) // the counters are the store's: any instance shows them
	if err != nil {
		return err
	}
	if before.used != 0 {
		return fmt.Errorf("the budget starts at %d used, want 0", before.used)
	}
	return measure(ctx, up, st, admins, sites, body, before, start)
}

// measure warms the model up, runs the clients until each is refused, and
// prints the figures.
func measure(ctx context.Context, up *fakellm.Server, st store, admins, sites []string, body string, before counter,
	restartAll func() (sites, admins []string, err error)) error {
	hc := &http.Client{Transport: &http.Transport{
		MaxIdleConnsPerHost: *clients, MaxConnsPerHost: *clients, DisableCompression: true,
	}}
	warmSites := sites
	if *restart {
		warmSites = sites[:1]
	}
	if err := warmUp(ctx, hc, warmSites, body); err != nil {
		return err
	}
	if *restart {
		var err error
		if sites, admins, err = restartAll(); err != nil {
			return err
		}
		if len(sites) > 1 {
			sites = sites[len(sites)-1:] // the clients go to an instance the warm-up did not
		}
		fmt.Printf("restarted every instance after %d warm-up answers through the first; the clients post to the last\n", *warm)
	}
	warmGenerated := up.Generated() // not the clients' to receive
	callsBefore, err := storeCalls(ctx, st.redisAddr, admins)
	if err != nil {
		return err
	}
	results, start, wall := runClients(ctx, hc, sites, body)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	end, err := waitStill(admins[0])
	if err != nil {
		return err
	}
	if !end.windowStart.Equal(before.windowStart) {
		log.Printf("warning: the budget's window turned over during the run (%s → %s): run it again", before.windowStart, end.windowStart)
	}
	f := tally(results)
	f.print(st.name, start, end, up, up.Generated()-warmGenerated, warmGenerated)
	if st.redisAddr != "" {
		after, err := storeCalls(ctx, st.redisAddr, admins)
		if err != nil {
			return err
		}
		printStoreCalls(callsBefore, after, f, results)
	}
	fmt.Printf("wall time: %.1f s\n", wall.Seconds())
	return nil
}

// startUpstream serves fakellm in words mode, in this process so its
// Generated counter can be read.
func startUpstream() (up *fakellm.Server, addr net.Addr, stop func(), err error) {
	up = &fakellm.Server{Input: *input, Output: *output, Interval: *interval,
		Words: true, Jitter: *jitter}
	upLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, nil, err
	}
	upSrv := &http.Server{Handler: up}
	go func() { _ = upSrv.Serve(upLn) }()
	return up, upLn.Addr(), func() { _ = upSrv.Close() }, nil
}

// store is where the budget is kept: the memory store, or a throwaway
// redis-server with -redis.
type store struct {
	name      string
	global    string // the Caddyfile's global fleetguard block
	redisAddr string // "" on the memory store
	stop      func()
}

func startStore() (store, error) {
	st := store{name: "memory store", stop: func() {}}
	if *useRedis {
		rs, err := redistest.Launch()
		if err != nil {
			return st, err
		}
		st.stop = rs.Stop
		st.global = fmt.Sprintf("\tfleetguard {\n\t\tredis %s\n\t\tprefix budgetutil\n\t}\n", rs.URL())
		st.name, st.redisAddr = "redis "+rs.Addr(), rs.Addr()
	}
	if *instances < 1 || *instances > 1 && !*useRedis {
		st.stop()
		return st, errors.New("-instances: 1, or more with -redis (they share its counters)")
	}
	return st, nil
}

// startInstances runs -instances Caddy processes with the budget, in front
// of the upstream at upAddr, and returns each one's site and admin URLs
// once it answers; stops gathers how to stop them.
func startInstances(ctx context.Context, bin, dir, global string, upAddr net.Addr, stops *[]func()) (sites, admins []string, err error) {
	settleWait := ""
	if *settle >= 0 {
		settleWait = fmt.Sprintf("\t\tsettle_wait %s\n", *settle)
	}
	for n := range *instances {
		sitePort, err := benchkit.FreePort()
		if err != nil {
			return nil, nil, err
		}
		adminPort, err := benchkit.FreePort()
		if err != nil {
			return nil, nil, err
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
`, adminPort, global, sitePort, *limit, *window, settleWait, upAddr)
		admin := fmt.Sprintf("http://127.0.0.1:%d", adminPort)
		if err := startCaddy(ctx, bin, dir, n, caddyfile, admin, stops); err != nil {
			return nil, nil, err
		}
		sites, admins = append(sites, "http://127.0.0.1:"+strconv.Itoa(sitePort)), append(admins, admin)
	}
	return sites, admins, nil
}

// startCaddy runs Caddy number n on caddyfile, its log in dir, and waits
// until its admin API shows the budget.
func startCaddy(ctx context.Context, bin, dir string, n int, caddyfile, admin string, stops *[]func()) error {
	cfgPath := filepath.Join(dir, fmt.Sprintf("Caddyfile%d", n))
	if err := os.WriteFile(cfgPath, []byte(caddyfile), 0o644); err != nil {
		return err
	}
	logf, err := os.Create(filepath.Join(dir, fmt.Sprintf("caddy%d.log", n)))
	if err != nil {
		return err
	}
	*stops = append(*stops, func() { logf.Close() })
	caddy := exec.Command(bin, "run", "--config", cfgPath, "--adapter", "caddyfile")
	caddy.Stdout, caddy.Stderr = logf, logf
	if err := caddy.Start(); err != nil {
		return err
	}
	// Stopped before its log is closed, as the deferred calls of one
	// function did.
	*stops = append([]func(){func() {
		_ = caddy.Process.Signal(syscall.SIGTERM)
		_ = caddy.Wait()
	}}, *stops...)
	if _, err := waitCounter(ctx, admin, 30*time.Second); err != nil {
		tail, _ := os.ReadFile(logf.Name())
		return fmt.Errorf("caddy did not come up: %w\n%s", err, tail)
	}
	return nil
}

// request is the path and body every client posts, in -format.
func request() (path, body string, err error) {
	anthropic := *format == "anthropic"
	if !anthropic && *format != "chat" {
		return "", "", fmt.Errorf("-format %q: want chat or anthropic", *format)
	}
	if *model == "" {
		*model = "gpt-4o"
		if anthropic {
			*model = "claude-sonnet-4-5"
		}
	}
	if anthropic {
		return "/v1/messages", fmt.Sprintf(`{"model":%q,"stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"write about budgets"}]}`, *model, *capTok), nil
	}
	return "/v1/chat/completions", fmt.Sprintf(`{"model":%q,"stream":true,"max_tokens":%d,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"write about budgets"}]}`, *model, *capTok), nil
}

// warmUp sends -warm answers to each instance (each learns for itself): the
// first two one after the other (the first proves the model, the second its
// tokenizer's count), the rest at once.
func warmUp(ctx context.Context, hc *http.Client, sites []string, body string) error {
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
	return nil
}

// runClients sends all the clients' first requests at once, then each
// client loops until its first refusal (or -requests).
func runClients(ctx context.Context, hc *http.Client, sites []string, body string) (results []result, start time.Time, wall time.Duration) {
	var (
		mu sync.Mutex
		wg sync.WaitGroup
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
	start = time.Now()
	close(ready)
	wg.Wait()
	return results, start, time.Since(start)
}

// waitStill reads the counter until it holds still: settles run after the
// response.
func waitStill(admin string) (end counter, err error) {
	for prev := int64(-1); ; prev = end.used {
		time.Sleep(300 * time.Millisecond)
		if end, err = readCounter(admin); err != nil {
			return end, err
		}
		if end.used == prev {
			return end, nil
		}
	}
}

// figures are what the clients saw, summed.
type figures struct {
	firstAdmitted, admitted, truncated, noUsage, refusals, errs int
	firstRefusal                                                time.Time
	reported, received                                          int64
	statuses                                                    map[int]int
	firstWait                                                   []time.Duration // the admitted first requests', to their headers
	// spentBefore is what the admittedBefore requests sent before the
	// first refusal reported.
	spentBefore    int64
	admittedBefore int
	// lowestHeld and highestHeld are the counter (held and spent) when a
	// request was refused, by its RateLimit header (-1: none shown).
	lowestHeld, highestHeld int64
}

func tally(results []result) figures {
	f := figures{statuses: map[int]int{}, lowestHeld: -1, highestHeld: -1}
	for _, r := range results {
		switch {
		case r.err != nil:
			f.errs++
		case r.status >= 200 && r.status <= 299:
		default:
			f.refusals++
			f.statuses[r.status]++
			if f.firstRefusal.IsZero() || r.answered.Before(f.firstRefusal) {
				f.firstRefusal = r.answered
			}
			if r.remaining >= 0 {
				held := *limit - r.remaining
				if f.lowestHeld < 0 || held < f.lowestHeld {
					f.lowestHeld = held
				}
				f.highestHeld = max(f.highestHeld, held)
			}
		}
	}
	for _, r := range results {
		if r.err == nil && r.status >= 200 && r.status <= 299 {
			f.admit(r)
		}
	}
	return f
}

// admit counts an admitted request.
func (f *figures) admit(r result) {
	f.admitted++
	if r.first {
		f.firstAdmitted++
		f.firstWait = append(f.firstWait, r.answered.Sub(r.sent))
	}
	f.received += int64(r.chunks)
	if r.usage {
		f.reported += int64(r.prompt + r.complete)
	} else {
		f.noUsage++
	}
	if (r.finish == "length" || r.finish == "max_tokens") && r.chunks < *capTok {
		f.truncated++
	}
	if f.firstRefusal.IsZero() || r.sent.Before(f.firstRefusal) {
		f.admittedBefore++
		f.spentBefore += int64(r.prompt + r.complete)
	}
}

func pct(a, b int64) float64 { return 100 * float64(a) / float64(b) }

// print prints the figures of a run that started at start and left the
// counter at end; generated is what the upstream generated for the clients.
func (f figures) print(storeName string, start time.Time, end counter, up *fakellm.Server, generated, warmGenerated int64) {
	fmt.Printf("budget-util: one global budget of %d tokens per %s (%s), %d streaming clients (%s, model %s), max_tokens %d;\n", *limit, *window, storeName, *clients, *format, *model, *capTok)
	fmt.Printf("  upstream fakellm words mode: %d prompt tokens, %d output tokens %s apart (jitter %.0f%%)\n", *input, *output, *interval, *jitter*100)
	fmt.Printf("concurrency admitted (first %d requests, sent at once): %d of %d\n", *clients, f.firstAdmitted, *clients)
	if n := len(f.firstWait); n > 0 {
		slices.Sort(f.firstWait)
		fmt.Printf("  time to response headers of the admitted first requests (a wait for room included): median %s, p90 %s, max %s\n",
			f.firstWait[n/2].Round(time.Millisecond), f.firstWait[(n*9)/10].Round(time.Millisecond), f.firstWait[n-1].Round(time.Millisecond))
	}
	if f.firstRefusal.IsZero() {
		fmt.Printf("share of the limit spent before the first refusal: no refusal (%d requests, %d tokens, %.1f%%)\n", f.admittedBefore, f.spentBefore, pct(f.spentBefore, *limit))
	} else {
		fmt.Printf("share of the limit spent before the first refusal: %.1f%% (%d tokens reported by the %d requests admitted before it, %.2f s in)\n",
			pct(f.spentBefore, *limit), f.spentBefore, f.admittedBefore, f.firstRefusal.Sub(start).Seconds())
	}
	fmt.Printf("counter at the end: %d of %d = %.1f%% of the limit\n", end.used, *limit, pct(end.used, *limit))
	if end.used > 0 {
		fmt.Printf("upstream's reported usage / counter: %d / %d = %.4f\n", f.reported, end.used, float64(f.reported)/float64(end.used))
		bill := up.Hits()*int64(*input) + generated + warmGenerated
		fmt.Printf("upstream's bill (prompt of each request it got + tokens generated) / counter: %d / %d = %.4f\n", bill, end.used, float64(bill)/float64(end.used))
	}
	fmt.Printf("requests admitted: %d; truncated streams (finish_reason length below max_tokens): %d; admitted streams without a usage chunk: %d\n", f.admitted, f.truncated, f.noUsage)
	if f.refusals > 0 && f.lowestHeld >= 0 {
		fmt.Printf("counter (held and spent) when a request was refused, by its RateLimit header: lowest %.1f%%, highest %.1f%% of the limit\n", pct(f.lowestHeld, *limit), pct(f.highestHeld, *limit))
	}
	var codes []string
	for code, n := range f.statuses {
		codes = append(codes, fmt.Sprintf("%d×%d", n, code))
	}
	fmt.Printf("refusals: %d (%s); client errors: %d\n", f.refusals, strings.Join(codes, ", "), f.errs)
	fmt.Printf("upstream generated %d output tokens, clients received %d: residual (generated, never received) %d; streams the upstream stopped early: %d\n",
		generated, f.received, generated-f.received, up.Stopped())
}

// printStoreCalls prints the store calls the admitted streams made, from
// Redis's counts before and after the run.
func printStoreCalls(before, after calls, f figures, results []result) {
	scripts, exts := after.scripts-before.scripts, after.extensions-before.extensions
	streams := int64(f.admitted)
	// An admitted stream makes one reserve, its extensions and one
	// settle; Redis's own count has the refused requests' calls too
	// (a reserve, and a release of one that timed out).
	perStream := 2 + float64(exts)/float64(max(streams, 1))
	fmt.Printf("store calls of the %d admitted streams (a reserve, %d lease extensions, a settle): %.2f a stream, %.4f an event of their %d; Redis ran %d scripts in all (refused requests' included)\n",
		streams, exts, perStream, perStream*float64(streams)/float64(max(f.received, 1)), f.received, scripts)
	fmt.Printf("events a second a stream: nominal %.0f, received %.0f (events over each stream's time from its request to its end, mean)\n",
		float64(time.Second)/float64(max(*interval, time.Microsecond)), eventRate(results))
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
	read(resp.Body, &r)
	r.ended = time.Now()
	return r
}

// read reads an admitted answer's events into r, to the end.
func read(body io.Reader, r *result) {
	sc := bufio.NewScanner(body)
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
		if anthropicEvent(data, r) {
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
