// Command fleet measures how well the fleet limit holds: it starts N limiter
// instances (each with its own Redis client and reconciler, as separate Caddy
// processes would have) against one real redis-server, or a 3-node Cluster
// with -cluster, drives a load at one or many keys, and reports per run the
// admitted requests, the worst sliding window against the limit from exact
// timestamps, the overshoot, the false denials of a load under the limit and
// the Redis commands per second.
//
//	go run ./bench/fleet -suite                     # the table of BENCHMARKS.md
//	go run ./bench/fleet -instances 4 -rate 2000 -duration 5s -mode both
//
// It writes a CSV and a PNG of the admitted requests per sliding window over
// time against the limit.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/ratelimit"
	"github.com/fleetguard/fleetguard/window"
)

// scenario is one load against one fleet.
type scenario struct {
	Name      string
	Instances int
	Events    int64
	Window    time.Duration
	Precision int
	Sync      time.Duration
	Rate      float64 // offered requests per second, all keys and instances together
	Duration  time.Duration
	Pattern   string // uniform, skewed, bursty
	Keys      int
	Fixed     bool // near-limit mechanisms off
}

func (s scenario) mode() string {
	if s.Fixed {
		return "fixed"
	}
	return "near"
}

// result is what one run measured.
type result struct {
	scenario
	Offered, Admitted, Denied int
	Worst                     int     // the most admits of one key in any window
	Overshoot                 float64 // % over the limit, worst key
	FalseDenials              int     // -1: the load is over the limit, denials are due
	CmdsPerSec, StepsPerSec   float64
	EarlySyncs                int64
	Series                    []int // key 0: admits in the window ending at each sample
}

const sampleEvery = 100 * time.Millisecond

func main() {
	var s scenario
	flag.IntVar(&s.Instances, "instances", 4, "limiter instances")
	flag.Int64Var(&s.Events, "events", 1000, "limit: events per window")
	flag.DurationVar(&s.Window, "window", 10*time.Second, "limit: window")
	flag.IntVar(&s.Precision, "precision", 0, "slots per window (0: the default)")
	flag.DurationVar(&s.Sync, "sync", 100*time.Millisecond, "sync interval")
	flag.Float64Var(&s.Rate, "rate", 400, "offered requests per second (all keys)")
	flag.DurationVar(&s.Duration, "duration", 30*time.Second, "load duration")
	flag.StringVar(&s.Pattern, "pattern", "uniform", "uniform | skewed (70% to one instance) | bursty (1s on, 1s off)")
	flag.IntVar(&s.Keys, "keys", 1, "keys, requested round robin")
	mode := flag.String("mode", "both", "near | fixed | both")
	cluster := flag.Bool("cluster", false, "run against a 3-node Redis Cluster")
	suite := flag.Bool("suite", false, "run the suite of BENCHMARKS.md instead of one scenario")
	csvPath := flag.String("csv", "fleet.csv", "CSV output")
	pngPath := flag.String("png", "fleet.png", "PNG output")
	flag.Parse()

	b, err := newBackend(*cluster)
	if err != nil {
		log.Fatal(err)
	}
	defer b.stop()

	var runs []scenario
	if *suite {
		runs = suiteScenarios()
	} else {
		s.Name = fmt.Sprintf("%d inst, %g req/s %s, %s", s.Instances, s.Rate, s.Pattern, s.Duration)
		for _, fixed := range modes(*mode) {
			r := s
			r.Fixed = fixed
			runs = append(runs, r)
		}
	}
	var results []result
	for i, sc := range runs {
		log.Printf("run %d/%d: %s (%s)", i+1, len(runs), sc.Name, sc.mode())
		r, err := run(b, sc, fmt.Sprintf("bench%d", i))
		if err != nil {
			log.Fatal(err)
		}
		results = append(results, r)
	}
	printTable(os.Stdout, results, *cluster)
	if err := writeCSV(*csvPath, results); err != nil {
		log.Fatal(err)
	}
	if err := writePNG(*pngPath, results); err != nil {
		log.Fatal(err)
	}
	log.Printf("wrote %s and %s", *csvPath, *pngPath)
}

func modes(m string) []bool {
	switch m {
	case "near":
		return []bool{false}
	case "fixed":
		return []bool{true}
	}
	return []bool{true, false}
}

// suiteScenarios are the cases the fleet limit is judged by (limit 1000 per
// 10 s, 100 ms sync), each with the near-limit mechanisms and without.
func suiteScenarios() []scenario {
	base := scenario{Events: 1000, Window: 10 * time.Second, Sync: 100 * time.Millisecond, Pattern: "uniform", Keys: 1}
	with := func(name string, inst int, rate float64, d time.Duration, pattern string) scenario {
		s := base
		s.Name, s.Instances, s.Rate, s.Duration, s.Pattern = name, inst, rate, d, pattern
		return s
	}
	cases := []scenario{
		with("1 instance, 4x the limit (400 req/s, 30 s)", 1, 400, 30*time.Second, "uniform"),
		with("4 instances, 400 req/s steady, 30 s", 4, 400, 30*time.Second, "uniform"),
		with("4 instances, 2000 req/s burst, 5 s", 4, 2000, 5*time.Second, "uniform"),
		with("4 instances, 95% of the limit evenly, 30 s", 4, 95, 30*time.Second, "uniform"),
		with("4 instances, 4000 req/s steady, 30 s", 4, 4000, 30*time.Second, "uniform"),
		with("4 instances, 400 req/s skewed 70% to one, 30 s", 4, 400, 30*time.Second, "skewed"),
		with("4 instances, 800 req/s bursty 1 s on/off, 30 s", 4, 800, 30*time.Second, "bursty"),
	}
	var out []scenario
	for _, c := range cases {
		for _, fixed := range []bool{true, false} {
			c.Fixed = fixed
			out = append(out, c)
		}
	}
	return out
}

// backend is the Redis the instances share.
type backend struct {
	srv     *redistest.Server
	cluster *redistest.Cluster
	dir     string
}

func newBackend(cluster bool) (*backend, error) {
	if !cluster {
		srv, err := redistest.Launch()
		return &backend{srv: srv}, err
	}
	dir, err := os.MkdirTemp("", "fleet-cluster")
	if err != nil {
		return nil, err
	}
	c, err := redistest.LaunchCluster(dir)
	return &backend{cluster: c, dir: dir}, err
}

func (b *backend) stop() {
	if b.srv != nil {
		b.srv.Stop()
	}
	if b.cluster != nil {
		b.cluster.Stop()
		_ = os.RemoveAll(b.dir)
	}
}

// client is what one instance of the fleet would open: the plugin's timeouts,
// no retries by the client.
func (b *backend) client() redis.UniversalClient {
	const timeout = 500 * time.Millisecond
	if b.cluster != nil {
		return redis.NewClusterClient(&redis.ClusterOptions{Addrs: b.cluster.Addrs(), DialTimeout: timeout,
			ReadTimeout: timeout, WriteTimeout: timeout, MaxRetries: -1, DialerRetries: 1})
	}
	return redis.NewClient(&redis.Options{Addr: b.srv.Addr(), DialTimeout: timeout,
		ReadTimeout: timeout, WriteTimeout: timeout, MaxRetries: -1, DialerRetries: 1})
}

// commandStats sums the calls of every command (INFO itself excluded) and of
// the sync script over every node.
func (b *backend) commandStats() (all, steps int64, err error) {
	var addrs []string
	if b.cluster != nil {
		addrs = b.cluster.Addrs()
	} else {
		addrs = []string{b.srv.Addr()}
	}
	for _, a := range addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		info, e := c.Info(context.Background(), "commandstats").Result()
		_ = c.Close()
		if e != nil {
			return 0, 0, e
		}
		for _, line := range strings.Split(info, "\n") {
			name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
			if !ok || !strings.HasPrefix(name, "cmdstat_") || name == "cmdstat_info" {
				continue
			}
			calls, _, _ := strings.Cut(strings.TrimPrefix(rest, "calls="), ",")
			n, _ := strconv.ParseInt(calls, 10, 64)
			all += n
			if name == "cmdstat_evalsha" {
				steps += n
			}
		}
	}
	return all, steps, nil
}

func run(b *backend, sc scenario, prefix string) (result, error) {
	limit, err := ratelimit.NewLimit(sc.Events, sc.Window, 0, sc.Precision)
	if err != nil {
		return result{}, err
	}
	var earlyPasses atomic.Int64
	engines := make([]*ratelimit.Engine, sc.Instances)
	zones := make([]*ratelimit.Zone, sc.Instances)
	var clients []redis.UniversalClient
	for i := range engines {
		c := b.client()
		clients = append(clients, c)
		e, err := ratelimit.NewEngine(ratelimit.Options{Store: ratelimit.NewRedisStore(c), Prefix: prefix,
			SyncInterval: sc.Sync, FixedInterval: sc.Fixed, OnEarlySync: func() { earlyPasses.Add(1) }})
		if err != nil {
			return result{}, err
		}
		e.Start()
		engines[i], zones[i] = e, e.Zone("bench", &limit)
	}
	defer func() {
		for i, e := range engines {
			e.Close(time.Second)
			_ = clients[i].Close()
		}
	}()
	keys := make([]keyhash.Hash, sc.Keys)
	for i := range keys {
		keys[i] = keyhash.Of("bench-key-" + strconv.Itoa(i))
	}
	admits := make([][]int64, sc.Keys)
	r := result{scenario: sc}
	cmds0, steps0, err := b.commandStats()
	if err != nil {
		return result{}, err
	}
	checks := make([]ratelimit.Check, 1)
	out := make([]ratelimit.Verdict, 1)
	start := time.Now()
	gap := float64(time.Second) / sc.Rate
	for i := 0; ; i++ {
		due := offset(sc, float64(i)*gap)
		if due >= sc.Duration {
			break
		}
		if wait := due - time.Since(start); wait > 200*time.Microsecond {
			time.Sleep(wait - 100*time.Microsecond)
		}
		inst := pick(sc, i)
		k := i % sc.Keys
		checks[0] = ratelimit.Check{Zone: zones[inst], Limit: &limit, Key: keys[k]}
		now := time.Now().UnixNano()
		r.Offered++
		if engines[inst].Allow(now, checks, out) < 0 {
			r.Admitted++
			admits[k] = append(admits[k], now)
			if os.Getenv("FLEET_TRACE") != "" {
				fmt.Printf("trace %d %d\n", (now-start.UnixNano())/1e7, inst)
			}
		} else {
			r.Denied++
		}
	}
	elapsed := time.Since(start)
	cmds1, steps1, err := b.commandStats()
	if err != nil {
		return result{}, err
	}
	r.EarlySyncs = earlyPasses.Load()
	r.CmdsPerSec = float64(cmds1-cmds0) / elapsed.Seconds()
	r.StepsPerSec = float64(steps1-steps0) / elapsed.Seconds()
	for _, a := range admits {
		sort.Slice(a, func(i, j int) bool { return a[i] < a[j] })
		r.Worst = max(r.Worst, window.MostInAny(a, sc.Window))
	}
	r.Overshoot = 100 * float64(r.Worst-int(sc.Events)) / float64(sc.Events)
	r.FalseDenials = -1
	if perKey := sc.Rate / float64(sc.Keys) * sc.Window.Seconds(); perKey < float64(sc.Events) && sc.Pattern == "uniform" {
		r.FalseDenials = r.Denied
	}
	r.Series = series(admits[0], start.UnixNano(), sc.Duration+sc.Window/2, sc.Window)
	return r, nil
}

// offset maps the nominal send time of a request to its time in the run:
// bursty loads send at the rate for one second, then pause one second.
func offset(sc scenario, nominal float64) time.Duration {
	if sc.Pattern != "bursty" {
		return time.Duration(nominal)
	}
	on := float64(time.Second)
	cycles := int64(nominal / on)
	return time.Duration(float64(cycles)*2*on + (nominal - float64(cycles)*on))
}

func pick(sc scenario, i int) int {
	if sc.Pattern == "skewed" && sc.Instances > 1 {
		if i%10 < 7 {
			return 0
		}
		return 1 + i%(sc.Instances-1)
	}
	return i % sc.Instances
}

// series counts the sorted timestamps in the window (t-w, t] for t every
// sampleEvery from start on.
func series(ts []int64, start int64, span, w time.Duration) []int {
	var out []int
	lo, hi := 0, 0
	for t := start; t <= start+int64(span); t += int64(sampleEvery) {
		for hi < len(ts) && ts[hi] <= t {
			hi++
		}
		for lo < hi && ts[lo] <= t-int64(w) {
			lo++
		}
		out = append(out, hi-lo)
	}
	return out
}

func printTable(f *os.File, results []result, cluster bool) {
	store := "one redis-server"
	if cluster {
		store = "a 3-node Redis Cluster"
	}
	fmt.Fprintf(f, "\nlimit 1 key unless said, on %s; worst = most admits in any window (exact timestamps)\n\n", store)
	tw := tabwriter.NewWriter(f, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "| case\t| sync\t| offered\t| admitted\t| worst window\t| over limit\t| false denials\t| Redis cmds/s\t| sync steps/s\t| early passes |")
	fmt.Fprintln(tw, "|---\t|---\t|---\t|---\t|---\t|---\t|---\t|---\t|---\t|--- |")
	for _, r := range results {
		fd := "-"
		if r.FalseDenials >= 0 {
			fd = strconv.Itoa(r.FalseDenials)
		}
		fmt.Fprintf(tw, "| %s\t| %s\t| %d\t| %d\t| %d / %d\t| %+.1f%%\t| %s\t| %.0f\t| %.0f\t| %d |\n",
			r.Name, r.mode(), r.Offered, r.Admitted, r.Worst, r.Events, r.Overshoot, fd, r.CmdsPerSec, r.StepsPerSec, r.EarlySyncs)
	}
	tw.Flush()
}

func writeCSV(path string, results []result) error {
	var b strings.Builder
	b.WriteString("t_seconds")
	n := 0
	for _, r := range results {
		fmt.Fprintf(&b, ",%q", r.Name+" ("+r.mode()+")")
		n = max(n, len(r.Series))
	}
	b.WriteString(",limit\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "%.1f", (time.Duration(i) * sampleEvery).Seconds())
		for _, r := range results {
			if i < len(r.Series) {
				fmt.Fprintf(&b, ",%d", r.Series[i])
			} else {
				b.WriteString(",")
			}
		}
		fmt.Fprintf(&b, ",%d\n", results[0].Events)
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}
