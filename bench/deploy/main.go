// Command deploy measures what fleetlimit costs the store while a fleet of
// Caddy processes lives through a deploy: -instances Caddy processes built
// from this checkout on one throwaway redis-server, a zone of -events per
// -window keyed on X-Key (the global option's defaults otherwise), and
// clients that send each request to a random live instance (a refused
// connection goes to another at once). Each case has two phases, -phase
// long each, Redis commands counted apart:
//
//   - start: the load begins and every Caddy starts at once, under it;
//   - rolling: each instance in turn is stopped (SIGTERM, Caddy's graceful
//     stop) and started again, -every apart, as a deploy does.
//
// Cases: 10,000 keys far below their limit (0.2% each, 2,000 req/s) and 100
// keys at 40% of it (4,000 req/s), offered evenly (round robin). No key is
// offered its limit: every denial is false. It prints per phase the offered
// and admitted requests, the denials, the worst window of any key (exact
// timestamps of the admitted responses) and the Redis commands a request.
//
//	go run ./bench/deploy [-instances 4] [-phase 20s] [-every 5s] [-cases far,40%]
//
// DEPLOY_KEEP=1 keeps the scratch folder with every Caddy's log.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/bench/internal/benchkit"
	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/window"
)

var (
	instances = flag.Int("instances", 4, "Caddy processes")
	phase     = flag.Duration("phase", 20*time.Second, "each phase's length")
	every     = flag.Duration("every", 5*time.Second, "the rolling restart's spacing")
	events    = flag.Int64("events", 1000, "the zone's limit: events per -window")
	win       = flag.Duration("window", 10*time.Second, "the zone's window")
	cases     = flag.String("cases", "far,40%", "the cases, comma-separated: far (10,000 keys at 0.2%), 40% (100 keys at 40%)")
	caddyBin  = flag.String("caddy", "", "a Caddy built from this checkout (default: build ./cmd/caddy into a scratch folder)")
)

// load is one case's traffic: keys offered evenly, rate requests a second
// in all.
type load struct {
	name string
	keys int
	rate float64
}

var loads = map[string]load{
	"far": {"10,000 keys at 0.2% of the limit", 10_000, 2000},
	"40%": {"100 keys at 40% of the limit", 100, 4000},
}

func main() {
	flag.Parse()
	benchkit.Main("deploy", run)
}

func run(ctx context.Context) error {
	dir, bin, cleanup, err := benchkit.Workspace(ctx, "deploy", "DEPLOY_KEEP", *caddyBin)
	if err != nil {
		return err
	}
	defer cleanup()
	rs, err := redistest.Launch()
	if err != nil {
		return err
	}
	defer rs.Stop()
	stats := redis.NewClient(&redis.Options{Addr: rs.Addr(), PoolSize: 1})
	defer stats.Close()
	fmt.Printf("deploy: %d Caddy processes on one redis-server, a zone of %d per %s keyed on X-Key, random balancing; phases of %s, a restart every %s\n",
		*instances, *events, *win, *phase, *every)
	fmt.Printf("%-34s %-8s %9s %9s %8s %8s %14s %10s %13s\n", "case", "phase", "offered", "admitted", "denied", "refused", "worst window", "Redis cmds", "cmds/request")
	for i, name := range strings.Split(*cases, ",") {
		l, ok := loads[name]
		if !ok {
			return fmt.Errorf("-cases: unknown case %q", name)
		}
		f := &fleet{bin: bin, dir: filepath.Join(dir, fmt.Sprintf("case%d", i)), redis: rs.URL(), prefix: fmt.Sprintf("deploy%d", i)}
		if err := f.run(ctx, l, stats); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	return nil
}

// fleet is one case's Caddy processes.
type fleet struct {
	bin, dir      string
	redis, prefix string
	insts         []*instance
}

// instance is one Caddy process slot: its port and config, and the process.
type instance struct {
	port   int
	config string
	benchkit.Process
}

// run drives one case: the start phase, then the rolling restart.
func (f *fleet) run(ctx context.Context, l load, stats *redis.Client) error {
	if err := f.configure(); err != nil {
		return err
	}
	defer func() {
		for _, in := range f.insts {
			in.Stop(syscall.SIGTERM)
		}
	}()
	c := newClients(f, l)
	before, err := commands(stats)
	if err != nil {
		return err
	}
	loadCtx, cancel := context.WithCancel(ctx)
	var traffic sync.WaitGroup
	traffic.Go(func() { c.drive(loadCtx) })
	// The fleet starts under the load.
	var starting sync.WaitGroup
	for _, in := range f.insts {
		starting.Go(func() {
			if err := f.start(ctx, in); err != nil {
				c.note(err)
			}
		})
	}
	starting.Wait()
	time.Sleep(time.Until(c.started.Add(*phase)))
	mid, err := commands(stats)
	if err != nil {
		cancel()
		return err
	}
	startPhase := c.cut()
	for i, in := range f.insts {
		if i > 0 {
			time.Sleep(*every)
		}
		in.Stop(syscall.SIGTERM)
		if err := f.start(ctx, in); err != nil {
			c.note(err)
		}
	}
	time.Sleep(*every)
	after, err := commands(stats)
	cancel()
	traffic.Wait()
	if err != nil {
		return err
	}
	rolling := c.cut()
	startPhase.print(l.name, "start", mid-before)
	rolling.print(l.name, "rolling", after-mid)
	return c.err()
}

// configure writes each instance's Caddyfile, on a port of its own.
func (f *fleet) configure() error {
	if err := os.MkdirAll(f.dir, 0o755); err != nil {
		return err
	}
	for n := range *instances {
		in := &instance{config: filepath.Join(f.dir, fmt.Sprintf("Caddyfile%d", n))}
		admin, err := benchkit.FreePort()
		if err != nil {
			return err
		}
		if in.port, err = benchkit.FreePort(); err != nil {
			return err
		}
		cfg := fmt.Sprintf(`{
	admin 127.0.0.1:%d
	fleetguard {
		redis %s
		prefix %s
	}
}
http://127.0.0.1:%d {
	fleetlimit {
		zone per_key {
			key {http.request.header.X-Key}
			events %d
			window %s
		}
	}
	respond "ok"
}
`, admin, f.redis, f.prefix, in.port, *events, *win)
		if err := os.WriteFile(in.config, []byte(cfg), 0o644); err != nil {
			return err
		}
		f.insts = append(f.insts, in)
	}
	return nil
}

// start starts in's Caddy and waits for its site.
func (f *fleet) start(ctx context.Context, in *instance) error {
	return in.Start(ctx, f.bin, in.config, in.config+".log", in.port)
}

// commands is every command Redis has run but INFO itself.
func commands(c *redis.Client) (int64, error) {
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		return 0, err
	}
	var n int64
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || !strings.HasPrefix(name, "cmdstat_") || name == "cmdstat_info" {
			continue
		}
		var calls int64
		if _, err := fmt.Sscanf(rest, "calls=%d,", &calls); err == nil {
			n += calls
		}
	}
	return n, nil
}

// clients send one case's load and count the answers by phase.
type clients struct {
	f       *fleet
	l       load
	hc      *http.Client
	started time.Time
	next    atomic.Int64 // round robin over the keys

	mu   sync.Mutex
	cur  phaseResult
	errs []error
}

// phaseResult is what the clients saw in one phase.
type phaseResult struct {
	offered, admitted, denied, refused int
	admits                             [][]int64
}

func newClients(f *fleet, l load) *clients {
	return &clients{f: f, l: l, started: time.Now(),
		hc:  &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64, MaxConnsPerHost: 64}},
		cur: phaseResult{admits: make([][]int64, l.keys)}}
}

// drive sends the load, evenly paced, from 64 workers, until ctx ends.
func (c *clients) drive(ctx context.Context) {
	const workers = 64
	gap := time.Duration(float64(time.Second) * workers / c.l.rate)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			next := c.started.Add(gap * time.Duration(w) / workers)
			for ctx.Err() == nil {
				time.Sleep(time.Until(next))
				next = next.Add(gap)
				c.send(ctx, int(c.next.Add(1)%int64(c.l.keys)))
			}
		})
	}
	wg.Wait()
}

// send posts one request of key to a random instance, and to the next ones
// while they refuse the connection, as a balancer retries.
func (c *clients) send(ctx context.Context, key int) {
	first := rand.IntN(len(c.f.insts))
	for i := range c.f.insts {
		in := c.f.insts[(first+i)%len(c.f.insts)]
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/", in.port), nil)
		req.Header.Set("X-Key", fmt.Sprintf("deploy-%d", key))
		resp, err := c.hc.Do(req)
		if err != nil {
			continue
		}
		resp.Body.Close()
		c.count(key, resp.StatusCode)
		return
	}
	if ctx.Err() == nil {
		c.count(key, 0)
	}
}

// count records one answer (0: no instance took the request).
func (c *clients) count(key, status int) {
	now := time.Now().UnixNano()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cur.offered++
	switch status {
	case http.StatusOK:
		c.cur.admitted++
		c.cur.admits[key] = append(c.cur.admits[key], now)
	case http.StatusTooManyRequests:
		c.cur.denied++
	default:
		c.cur.refused++
	}
}

// cut ends the current phase and returns what it saw.
func (c *clients) cut() phaseResult {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := c.cur
	c.cur = phaseResult{admits: make([][]int64, c.l.keys)}
	return r
}

func (c *clients) note(err error) {
	c.mu.Lock()
	c.errs = append(c.errs, err)
	c.mu.Unlock()
}

func (c *clients) err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return errors.Join(c.errs...)
}

// print prints the phase's row: cmds were the Redis commands in it.
func (r phaseResult) print(name, phase string, cmds int64) {
	worst := 0
	for _, ts := range r.admits {
		slices.Sort(ts) // taken before the lock: nearly sorted
		worst = max(worst, window.MostInAny(ts, *win))
	}
	fmt.Printf("%-34s %-8s %9d %9d %8d %8d %9d / %d %10d %13.3f\n", name, phase, r.offered, r.admitted, r.denied, r.refused,
		worst, *events, cmds, float64(cmds)/float64(max(r.offered, 1)))
}
