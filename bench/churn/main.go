// Command churn measures fleetlimit through real Caddy processes while some
// of them restart: -instances Caddy processes built from this checkout on one
// throwaway redis-server, each serving two sites with a fleetlimit zone keyed
// on X-Key (-events per -window, and a tiny zone of -tiny-events), and
// clients that send each request to a random live instance, as a load
// balancer would (a refused connection goes to another at once). The last
// -restarts instances are stopped and started again every -every: with
// SIGTERM (Caddy's graceful stop: fleetlimit pushes what it counted and
// releases its instance slot) and with SIGKILL (nothing pushed, no word), one case
// each. Keys are offered at 4×, 90% and 50% of the limit, and the tiny
// zone's key at 3× its limit.
//
// Per key it prints the worst sliding window of the admits, from the
// clients' timestamps (each admit by when its request was sent / by when
// its response came back: it happened in between), the slowest response,
// and the
// denials; a key offered below its limit in every window should have none
// but, with kills, in the window after the first restart: a killed
// instance's floor admits the store has not seen, and what it held of its
// grants, are held back until they leave the window (a graceful stop pushes
// them). Those are counted apart.
//
//	go run ./bench/churn [-instances 4] [-restarts 2] [-every 1.5s] [-duration 40s] [-cases graceful,kill]
//
// CHURN_KEEP=1 keeps the scratch folder with every Caddy's log; CHURN_WHO=1
// prints which instances admitted each key's worst window; CHURN_LIVES=1
// (=tiny: the tiny zone's) prints every admit of the full zone's keys to stderr as "admit <key> <ms>
// instance <n> life <start ms>", so that each life's admits can be told
// apart; CHURN_LATE=1 starts the restarting instances 3 s after the others.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fleetguard/fleetguard/bench/internal/benchkit"
	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/window"
)

var (
	instances  = flag.Int("instances", 4, "Caddy processes")
	restarts   = flag.Int("restarts", 2, "the last this many instances restart every -every")
	every      = flag.Duration("every", 1500*time.Millisecond, "how often the restarting instances restart")
	duration   = flag.Duration("duration", 40*time.Second, "the load's length, each case")
	events     = flag.Int64("events", 100, "the zone's limit: events per -window")
	tinyEvents = flag.Int64("tiny-events", 3, "the tiny zone's limit: events per -window")
	win        = flag.Duration("window", 10*time.Second, "the zones' window")
	cases      = flag.String("cases", "graceful,kill", "the cases, comma-separated: graceful (SIGTERM), kill (SIGKILL)")
	caddyBin   = flag.String("caddy", "", "a Caddy built from this checkout (default: build ./cmd/caddy into a scratch folder)")
)

// flow is one key's load.
type flow struct {
	name   string
	tiny   bool    // on the tiny zone's site
	factor float64 // of the zone's limit per window
}

var flows = []flow{{"4x", false, 4}, {"90%", false, 0.9}, {"50%", false, 0.5}, {"tiny 3x", true, 3}}

func main() {
	flag.Parse()
	benchkit.Main("churn", run)
}

func run(ctx context.Context) error {
	dir, bin, cleanup, err := benchkit.Workspace(ctx, "churn", "CHURN_KEEP", *caddyBin)
	if err != nil {
		return err
	}
	defer cleanup()
	rs, err := redistest.Launch()
	if err != nil {
		return err
	}
	defer rs.Stop()
	fmt.Printf("churn: %d Caddy processes on one redis-server, the last %d restarted every %s; zones of %d and %d per %s keyed on X-Key; random balancing; %s a case\n",
		*instances, *restarts, *every, *events, *tinyEvents, *win, *duration)
	fmt.Printf("%-9s %-8s %8s %8s %8s %14s %14s %8s %9s %9s\n", "case", "key", "offered", "admitted", "denied", "(first window)", "worst window", "limit", "restarts", "slowest")
	for i, name := range strings.Split(*cases, ",") {
		var sig syscall.Signal
		switch name {
		case "graceful":
			sig = syscall.SIGTERM
		case "kill":
			sig = syscall.SIGKILL
		default:
			return fmt.Errorf("-cases: unknown case %q", name)
		}
		c := &churnCase{name: name, sig: sig, bin: bin, dir: filepath.Join(dir, name), redis: rs.URL(), prefix: fmt.Sprintf("churn%d", i)}
		if err := c.run(ctx); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	return nil
}

// churnCase is one run: its fleet and what its clients saw.
type churnCase struct {
	name          string
	sig           syscall.Signal
	bin, dir      string
	redis, prefix string
	insts         []*instance
	restarted     atomic.Int64
}

// instance is one Caddy process slot: its ports, config and the process.
type instance struct {
	n            int
	site, tiny   int // ports
	admin        int
	config, logf string
	benchkit.Process
}

func (c *churnCase) run(ctx context.Context) error {
	if err := c.configure(); err != nil {
		return err
	}
	for i, in := range c.insts {
		if os.Getenv("CHURN_LATE") != "" && i == len(c.insts)-*restarts {
			time.Sleep(3 * time.Second) // the restarting ones join after the others
		}
		if err := c.start(ctx, in); err != nil {
			return err
		}
	}
	defer func() {
		for _, in := range c.insts {
			in.Stop(syscall.SIGTERM)
		}
	}()
	// The load starts once every instance has had time to take its slot.
	time.Sleep(2500 * time.Millisecond)

	loadCtx, cancel := context.WithTimeout(ctx, *duration)
	defer cancel()
	var churn sync.WaitGroup
	churn.Go(func() { c.churn(loadCtx) })
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 8}}
	results := make([]keyResult, len(flows))
	var load sync.WaitGroup
	for i, f := range flows {
		load.Go(func() {
			results[i] = c.drive(loadCtx, hc, f, fmt.Sprintf("%s-%s-%d", c.prefix, strings.ReplaceAll(f.name, " ", ""), i))
		})
	}
	load.Wait()
	churn.Wait()
	c.print(results)
	return nil
}

// configure writes each instance's Caddyfile, on ports of its own.
func (c *churnCase) configure() error {
	if err := os.MkdirAll(c.dir, 0o755); err != nil {
		return err
	}
	for n := range *instances {
		in := &instance{n: n}
		var err error
		for _, p := range []*int{&in.site, &in.tiny, &in.admin} {
			if *p, err = benchkit.FreePort(); err != nil {
				return err
			}
		}
		in.config, in.logf = filepath.Join(c.dir, fmt.Sprintf("Caddyfile%d", n)), filepath.Join(c.dir, fmt.Sprintf("caddy%d.log", n))
		if err := os.WriteFile(in.config, []byte(c.caddyfile(in)), 0o644); err != nil {
			return err
		}
		c.insts = append(c.insts, in)
	}
	return nil
}

// print prints a row for each flow's key.
func (c *churnCase) print(results []keyResult) {
	for i, f := range flows {
		r := results[i]
		limit := *events
		if f.tiny {
			limit = *tinyEvents
		}
		// (Each key's admits come in time order from one goroutine.)
		// An admit happened between its request's sending and its
		// response: the worst window by each.
		worst := fmt.Sprintf("%d/%d", window.MostInAny(r.sent, *win), window.MostInAny(r.admits, *win))
		fmt.Printf("%-9s %-8s %8d %8d %8d %14d %14s %8d %9d %9s\n", c.name, f.name, r.offered, len(r.admits), r.denied, r.early,
			worst, limit, c.restarted.Load(), r.slowest.Round(time.Millisecond))
		if os.Getenv("CHURN_WHO") != "" {
			fmt.Printf("%-9s %-8s worst window by instance: %v\n", c.name, f.name, worstBy(r.admits, r.by, *win, len(c.insts)))
		}
		if r.errors > 0 {
			fmt.Printf("%-9s %-8s %d requests found no live instance or failed\n", c.name, f.name, r.errors)
		}
	}
}

// keyResult is what the clients of one key saw.
type keyResult struct {
	admits                  []int64 // Unix ns, each admitted response
	sent                    []int64 // Unix ns, when each admitted request was sent
	by                      []int   // the instance of each admit
	slowest                 time.Duration
	offered, denied, errors int
	early                   int // denials in the window after the first restart
}

// drive offers one key its load, evenly spaced, each request to a random
// live instance, until ctx ends.
func (c *churnCase) drive(ctx context.Context, hc *http.Client, f flow, key string) keyResult {
	limit := *events
	if f.tiny {
		limit = *tinyEvents
	}
	gap := time.Duration(float64(*win) / (f.factor * float64(limit)))
	var r keyResult
	settled := time.Now().Add(*every + *win + 2*time.Second)
	tick := time.NewTicker(gap)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return r
		case <-tick.C:
		}
		r.offered++
		sent := time.Now()
		code, n := c.send(ctx, hc, f.tiny, key)
		r.slowest = max(r.slowest, time.Since(sent))
		switch code {
		case http.StatusOK:
			r.admits = append(r.admits, time.Now().UnixNano())
			r.sent = append(r.sent, sent.UnixNano())
			r.by = append(r.by, n)
		case http.StatusTooManyRequests:
			if time.Now().Before(settled) {
				r.early++
			} else {
				r.denied++
			}
		default:
			if ctx.Err() == nil {
				r.errors++
			}
		}
	}
}

// send posts one request to a random instance, and to the next ones while
// they refuse the connection (down, or not yet up), as a balancer retries.
func (c *churnCase) send(ctx context.Context, hc *http.Client, tiny bool, key string) (status, inst int) {
	first := rand.IntN(len(c.insts))
	for i := range c.insts {
		in := c.insts[(first+i)%len(c.insts)]
		port := in.site
		if tiny {
			port = in.tiny
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/", port), nil)
		req.Header.Set("X-Key", key)
		resp, err := hc.Do(req)
		if err != nil {
			if ctx.Err() != nil {
				return 0, 0
			}
			continue // down: the next instance
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if os.Getenv("CHURN_LIVES") != "" && resp.StatusCode == http.StatusOK && tiny == (os.Getenv("CHURN_LIVES") == "tiny") {
			fmt.Fprintf(os.Stderr, "admit %s %d %s\n", key, time.Now().UnixMilli(), body)
		}
		return resp.StatusCode, in.n
	}
	return 0, 0
}

// churn restarts the last -restarts instances every -every until ctx ends.
func (c *churnCase) churn(ctx context.Context) {
	tick := time.NewTicker(*every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		for _, in := range c.insts[len(c.insts)-*restarts:] {
			in.Stop(c.sig)
			if err := c.start(ctx, in); err != nil && ctx.Err() == nil {
				log.Printf("restarting instance %d: %v", in.n, err)
			}
			c.restarted.Add(1)
		}
	}
}

// start starts in's Caddy (its life named in CHURN_LIFE) and waits for its
// site.
func (c *churnCase) start(ctx context.Context, in *instance) error {
	return in.Start(ctx, c.bin, in.config, in.logf, in.tiny, fmt.Sprintf("CHURN_LIFE=%d", time.Now().UnixMilli()))
}

func (c *churnCase) caddyfile(in *instance) string {
	site := func(port int, zone string, events int64) string {
		return fmt.Sprintf(`http://127.0.0.1:%d {
	fleetlimit {
		zone %s {
			key {http.request.header.X-Key}
			events %d
			window %s
		}
	}
	respond "instance %d life {env.CHURN_LIFE}"
}
`, port, zone, events, *win, in.n)
	}
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	fleetguard {
		redis %s
		prefix %s
		sync_interval 100ms
	}
}
`, in.admin, c.redis, c.prefix) + site(in.site, "per_key", *events) + site(in.tiny, "tiny", *tinyEvents)
}

// worstBy counts, per instance, the admits of the first worst window.
func worstBy(ts []int64, by []int, w time.Duration, n int) []int {
	most, lo, at := 0, 0, 0
	for hi := range ts {
		for ts[hi]-ts[lo] >= int64(w) {
			lo++
		}
		if hi-lo+1 > most {
			most, at = hi-lo+1, lo
		}
	}
	counts := make([]int, n)
	for i := at; i < at+most; i++ {
		counts[by[i]]++
	}
	return counts
}
