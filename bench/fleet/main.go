// Command fleet measures how well the fleet limit holds and what it costs the
// store: it starts N limiter instances (each with its own Redis client and
// reconciler, as separate Caddy processes would have) against one real
// redis-server, or a 3-node Cluster with -cluster, drives a load at one or
// many keys, starts and stops instances mid-run where a case says so, and
// reports per run the admitted requests, the worst sliding window against the
// limit from exact timestamps, the overshoot, the denials and the false
// denials (those of keys whose offered load is under the limit), and the
// store's load: Redis commands per second and per request, script calls per
// second.
//
//	go run ./bench/fleet -suite                     # every case of BENCHMARKS.md
//	go run ./bench/fleet -suite -group load         # the store-load cases alone
//	go run ./bench/fleet -suite -group edges        # restarts, tiny limits, skew, joins
//	go run ./bench/fleet -instances 4 -rate 2000 -duration 5s -mode both
//
// It writes a CSV of the admitted requests of key 0 per sliding window over
// time, a PNG of it against the limit, and a CSV of every run's figures.
package main

import (
	"flag"
	"fmt"
	"log"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/ratelimit"
	"github.com/fleetguard/fleetguard/window"
)

// maxInstances is the -max-instances flag: every engine's slots.
var maxInstances *int

// scenario is one load against one fleet.
type scenario struct {
	Name      string
	Group     string // accuracy (one key near or over its limit) or load (the store's load)
	Instances int
	Events    int64
	Window    time.Duration
	Precision int
	Sync      time.Duration
	Rate      float64 // offered requests per second, all keys and instances together
	Duration  time.Duration
	Pattern   string // uniform, skewed, bursty, random
	Keys      int
	Flows     []flow // when set, the load, instead of Rate, Pattern and Keys
	Fleet     []life // when each instance runs (nil, or past its end: the whole run)
	Fixed     bool   // near-limit mechanisms off
	// Restart lists the instances that restart every RestartEvery, as a
	// Caddy stopped and started again (Kill: killed, so that it pushes
	// nothing and leaves no word).
	Restart      []int
	RestartEvery time.Duration
	// Rolling restarts one instance of Restart at a time, in turn, as a
	// deploy does, instead of all of them at every RestartEvery.
	Rolling bool
	Kill    bool
}

func (s scenario) mode() string {
	if s.Fixed {
		return "fixed"
	}
	return "near"
}

func (s scenario) life(n int) life {
	if n < len(s.Fleet) {
		return s.Fleet[n]
	}
	return life{}
}

// keys is how many keys the load requests.
func (s scenario) keys() int {
	if len(s.Flows) == 0 {
		return s.Keys
	}
	n := 0
	for _, f := range s.Flows {
		n = max(n, f.First+f.Keys)
	}
	return n
}

// fleetSize is the number of live instances, "2→4" where it changes.
func (s scenario) fleetSize() string {
	first, last := 0, 0
	for n := 0; n < s.Instances; n++ {
		if s.life(n).live(0) {
			first++
		}
		if s.life(n).live(s.Duration - 1) {
			last++
		}
	}
	if first == last {
		return strconv.Itoa(first)
	}
	return fmt.Sprintf("%d→%d", first, last)
}

// result is what one run measured.
type result struct {
	scenario
	Offered, Admitted, Denied int
	Elapsed                   time.Duration
	Worst                     int     // the most admits of one key in any window
	Overshoot                 float64 // % over the limit, worst key
	FalseDenials              int     // denials of keys offered less than the limit in every window; -1: no such key
	Cmds, Scripts             int64   // commands Redis ran during the run, and script calls among them
	EarlySyncs                int64
	Series                    []int // key 0: admits in the window ending at each sample
}

func (r result) perSec(n int64) float64 { return float64(n) / r.Elapsed.Seconds() }
func (r result) perReq(n int64) float64 { return float64(n) / float64(max(r.Offered, 1)) }

func (r result) falseDenials() string {
	if r.FalseDenials < 0 {
		return "-"
	}
	return strconv.Itoa(r.FalseDenials)
}

// startWait is how long the store-load cases let a fleet started together
// run before the load begins: they measure a fleet that runs (bench/deploy
// measures one that starts under load).
const startWait = 2500 * time.Millisecond

const sampleEvery = 100 * time.Millisecond

func main() {
	var s scenario
	flag.IntVar(&s.Instances, "instances", 4, "limiter instances")
	maxInstances = flag.Int("max-instances", 0, "the fleet's instance slots (0: ratelimit.DefaultMaxInstances)")
	flag.Int64Var(&s.Events, "events", 1000, "limit: events per window")
	flag.DurationVar(&s.Window, "window", 10*time.Second, "limit: window")
	flag.IntVar(&s.Precision, "precision", 0, "slots per window (0: the default)")
	flag.DurationVar(&s.Sync, "sync", 100*time.Millisecond, "sync interval")
	flag.Float64Var(&s.Rate, "rate", 400, "offered requests per second (all keys)")
	flag.DurationVar(&s.Duration, "duration", 30*time.Second, "load duration")
	flag.StringVar(&s.Pattern, "pattern", "uniform", "uniform | skewed (70% to one instance) | bursty (1s on, 1s off) | random (a random balancer)")
	flag.IntVar(&s.Keys, "keys", 1, "keys, requested round robin")
	mode := flag.String("mode", "both", "near | fixed | both")
	cluster := flag.Bool("cluster", false, "run against a 3-node Redis Cluster")
	suite := flag.Bool("suite", false, "run the suite of BENCHMARKS.md instead of one scenario")
	group := flag.String("group", "", "with -suite, only this group of cases: accuracy | load | edges")
	only := flag.String("case", "", "with -suite, only the cases whose name contains this")
	csvPath := flag.String("csv", "fleet.csv", "CSV output: admits of key 0 per sliding window over time")
	pngPath := flag.String("png", "fleet.png", "PNG output")
	runsPath := flag.String("runs", "fleet-runs.csv", "CSV output: the figures of every run")
	flag.Parse()

	runs := scenarios(s, *suite, *group, *only, *mode)
	b, err := newBackend(*cluster)
	if err != nil {
		log.Fatal(err)
	}
	defer b.stop()
	results := runAll(b, runs)
	printTable(os.Stdout, results, *cluster)
	if err := writeCSV(*csvPath, results); err != nil {
		log.Fatal(err)
	}
	if err := writeRuns(*runsPath, results); err != nil {
		log.Fatal(err)
	}
	if err := writePNG(*pngPath, results); err != nil {
		log.Fatal(err)
	}
	log.Printf("wrote %s, %s and %s", *csvPath, *runsPath, *pngPath)
}

// scenarios are the runs asked for: the suite's cases of group whose name
// contains only, or s in each of mode's modes.
func scenarios(s scenario, suite bool, group, only, mode string) []scenario {
	var runs []scenario
	if suite {
		for _, sc := range suiteScenarios() {
			if (group == "" || sc.Group == group) && strings.Contains(sc.Name, only) {
				runs = append(runs, sc)
			}
		}
		if len(runs) == 0 {
			log.Fatalf("no case in group %q", group)
		}
		return runs
	}
	s.Name = fmt.Sprintf("%d inst, %g req/s %s, %d keys, %s", s.Instances, s.Rate, s.Pattern, s.Keys, s.Duration)
	for _, fixed := range modes(mode) {
		r := s
		r.Fixed = fixed
		runs = append(runs, r)
	}
	return runs
}

// runAll runs each scenario on b in turn, logging its figures.
func runAll(b *backend, runs []scenario) []result {
	var results []result
	for i, sc := range runs {
		log.Printf("run %d/%d: %s (%s)", i+1, len(runs), sc.Name, sc.mode())
		r, err := run(b, sc, fmt.Sprintf("bench%d", i))
		if err != nil {
			log.Fatal(err)
		}
		log.Printf("  offered %.0f req/s, worst window %d / %d, denied %d, false denials %s, Redis %.0f cmds/s, %.3f cmds/request, %.0f script calls/s",
			float64(r.Offered)/r.Elapsed.Seconds(), r.Worst, r.Events, r.Denied, r.falseDenials(), r.perSec(r.Cmds), r.perReq(r.Cmds), r.perSec(r.Scripts))
		results = append(results, r)
	}
	return results
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

// fleet is the instances of one run, started and stopped as the scenario says.
type fleet struct {
	b       *backend
	sc      scenario
	prefix  string
	limit   *ratelimit.Limit
	early   atomic.Int64
	engines []*ratelimit.Engine
	zones   []*ratelimit.Zone
	clients []redis.UniversalClient
	leaving sync.WaitGroup
}

// up starts instance n: its own client, engine and reconciler.
func (f *fleet) up(n int) error {
	c := f.b.client()
	e, err := ratelimit.NewEngine(ratelimit.Options{Store: ratelimit.NewRedisStore(c), Prefix: f.prefix,
		SyncInterval: f.sc.Sync, FixedInterval: f.sc.Fixed, MaxInstances: *maxInstances, OnEarlySync: func() { f.early.Add(1) }})
	if err != nil {
		_ = c.Close()
		return err
	}
	e.Start()
	f.engines[n], f.zones[n], f.clients[n] = e, e.Zone("bench", f.limit), c
	return nil
}

// restart replaces instance n by a new one, as a Caddy stopped and started
// again; with kill, the old one is killed: it can push nothing more and says
// nothing (its client is closed before its engine), as after kill -9.
func (f *fleet) restart(n int, kill bool) error {
	if kill {
		_ = f.clients[n].Close()
	}
	f.down(n)
	return f.up(n)
}

// down stops instance n as Caddy's shutdown would (a last push of its
// deltas), without holding up the load.
func (f *fleet) down(n int) {
	e, c := f.engines[n], f.clients[n]
	f.leaving.Add(1)
	go func() {
		defer f.leaving.Done()
		e.Close(time.Second)
		_ = c.Close()
	}()
}

func (f *fleet) close() {
	f.leaving.Wait()
	for n, e := range f.engines {
		if e != nil {
			e.Close(time.Second)
			_ = f.clients[n].Close()
		}
	}
}

// change is an instance joining, leaving or restarting mid-run.
type change struct {
	At      time.Duration
	Inst    int
	Up      bool
	Restart bool
}

func run(b *backend, sc scenario, prefix string) (result, error) {
	limit, err := ratelimit.NewLimit(sc.Events, sc.Window, 0, sc.Precision)
	if err != nil {
		return result{}, err
	}
	reqs := schedule(sc)
	f := &fleet{b: b, sc: sc, prefix: prefix, limit: &limit, engines: make([]*ratelimit.Engine, sc.Instances),
		zones: make([]*ratelimit.Zone, sc.Instances), clients: make([]redis.UniversalClient, sc.Instances)}
	defer f.close()
	changes, err := f.start()
	if err != nil {
		return result{}, err
	}
	if sc.Group == "load" && !sc.Fixed {
		time.Sleep(startWait)
	}
	l := newTraffic(sc)
	r := result{scenario: sc}
	before, err := b.commandStats()
	if err != nil {
		return result{}, err
	}
	start := time.Now()
	if err := l.replay(f, &r, reqs, changes, start); err != nil {
		return result{}, err
	}
	f.leaving.Wait()
	r.Elapsed = time.Since(start)
	after, err := b.commandStats()
	if err != nil {
		return result{}, err
	}
	r.Cmds, r.Scripts = after.all-before.all, after.scripts-before.scripts
	r.EarlySyncs = f.early.Load()
	l.figures(&r, start)
	return r, nil
}

// start brings up the instances that live from the start, and returns the
// changes to come, in time order: the others' ups and downs, the restarts.
func (f *fleet) start() ([]change, error) {
	sc := f.sc
	var changes []change
	for n := 0; n < sc.Instances; n++ {
		l := sc.life(n)
		if l.Up == 0 {
			if err := f.up(n); err != nil {
				return nil, err
			}
		} else {
			changes = append(changes, change{At: l.Up, Inst: n, Up: true})
		}
		if l.Down > 0 {
			changes = append(changes, change{At: l.Down, Inst: n})
		}
	}
	turn := 0
	for at := sc.RestartEvery; sc.RestartEvery > 0 && at < sc.Duration; at += sc.RestartEvery {
		for i, n := range sc.Restart {
			if !sc.Rolling || i == turn%len(sc.Restart) {
				changes = append(changes, change{At: at, Inst: n, Restart: true})
			}
		}
		turn++
	}
	sort.SliceStable(changes, func(i, j int) bool { return changes[i].At < changes[j].At })
	return changes, nil
}

// apply makes one change of the fleet.
func (f *fleet) apply(c change) error {
	switch {
	case c.Restart:
		return f.restart(c.Inst, f.sc.Kill)
	case c.Up:
		return f.up(c.Inst)
	default:
		f.down(c.Inst)
		return nil
	}
}

// traffic is the requests of a run by key: when each was offered and admitted,
// and how many were denied.
type traffic struct {
	sc              scenario
	keys            []keyhash.Hash
	admits, offered [][]int64
	denied          []int
}

func newTraffic(sc scenario) *traffic {
	keys := make([]keyhash.Hash, sc.keys())
	for i := range keys {
		keys[i] = keyhash.Of("bench-key-" + strconv.Itoa(i))
	}
	return &traffic{sc: sc, keys: keys, admits: make([][]int64, len(keys)),
		offered: make([][]int64, len(keys)), denied: make([]int, len(keys))}
}

// replay sends reqs on their schedule from start, making the fleet's
// changes as their time comes, and counts the answers in r.
func (l *traffic) replay(f *fleet, r *result, reqs []req, changes []change, start time.Time) error {
	checks := make([]ratelimit.Check, 1)
	out := make([]ratelimit.Verdict, 1)
	trace := os.Getenv("FLEET_TRACE") != ""
	var mu sync.Mutex
	var waiting sync.WaitGroup
	for _, q := range reqs {
		if wait := q.At - time.Since(start); wait > 200*time.Microsecond {
			time.Sleep(wait - 100*time.Microsecond)
		}
		for ; len(changes) > 0 && changes[0].At <= q.At; changes = changes[1:] {
			if err := f.apply(changes[0]); err != nil {
				return err
			}
		}
		checks[0] = ratelimit.Check{Zone: f.zones[q.Inst], Limit: f.limit, Key: l.keys[q.Key]}
		now := time.Now().UnixNano()
		mu.Lock()
		r.Offered++
		l.offered[q.Key] = append(l.offered[q.Key], now)
		mu.Unlock()
		e := f.engines[q.Inst]
		if e.Allow(now, checks, out) >= 0 && out[0].Leasing {
			// As the fleetlimit handler does: a request denied for want of
			// its key's grant waits for the reconciler's pass (at most
			// 200 ms) and is decided again, off the schedule.
			waiting.Add(1)
			go func(c ratelimit.Check, key int) {
				defer waiting.Done()
				checks, out := []ratelimit.Check{c}, make([]ratelimit.Verdict, 1)
				for try := 0; try < 2; try++ {
					e.AwaitPass(100 * time.Millisecond)
					if e.Allow(time.Now().UnixNano(), checks, out) < 0 {
						l.count(r, &mu, key, time.Now().UnixNano(), true)
						return
					}
					if !out[0].Leasing {
						break
					}
				}
				l.count(r, &mu, key, 0, false)
			}(checks[0], q.Key)
			continue
		}
		if out[0].Allowed && trace {
			fmt.Printf("trace %d %d\n", (now-start.UnixNano())/1e7, q.Inst)
		}
		l.count(r, &mu, q.Key, now, out[0].Allowed)
	}
	waiting.Wait()
	return nil
}

// count records one request's answer.
func (l *traffic) count(r *result, mu *sync.Mutex, key int, at int64, admitted bool) {
	mu.Lock()
	defer mu.Unlock()
	if admitted {
		r.Admitted++
		l.admits[key] = append(l.admits[key], at)
	} else {
		r.Denied++
		l.denied[key]++
	}
}

// figures fills in r's worst window, false denials, overshoot and series.
func (l *traffic) figures(r *result, start time.Time) {
	sc := l.sc
	r.FalseDenials = -1
	for k, a := range l.admits {
		// The load runs in time order; sorting guards against a wall clock step.
		sort.Slice(a, func(i, j int) bool { return a[i] < a[j] })
		sort.Slice(l.offered[k], func(i, j int) bool { return l.offered[k][i] < l.offered[k][j] })
		r.Worst = max(r.Worst, window.MostInAny(a, sc.Window))
		if len(l.offered[k]) > 0 && window.MostInAny(l.offered[k], sc.Window) < int(sc.Events) {
			r.FalseDenials = max(r.FalseDenials, 0) + l.denied[k]
		}
	}
	r.Overshoot = 100 * float64(r.Worst-int(sc.Events)) / float64(sc.Events)
	r.Series = series(l.admits[0], start.UnixNano(), sc.Duration+sc.Window/2, sc.Window)
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
	fmt.Fprintf(f, "\nlimit %d per %s per key, sync %s, on %s; worst = most admits of one key in any window (exact timestamps);\n",
		results[0].Events, results[0].Window, results[0].Sync, store)
	fmt.Fprintf(f, "false denials = denials of keys offered less than the limit in every window; Redis cmds = every command Redis ran\n")
	fmt.Fprintf(f, "(the commands inside scripts too, the bench's own excluded), per second and per offered request\n\n")
	tw := tabwriter.NewWriter(f, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "| case\t| sync\t| instances\t| keys\t| offered req/s\t| admitted\t| worst window\t| over limit\t| denied\t| false denials\t| Redis cmds/s\t| cmds/request\t| script calls/s\t| early passes |")
	fmt.Fprintln(tw, "|---\t|---\t|---\t|---\t|---\t|---\t|---\t|---\t|---\t|---\t|---\t|---\t|---\t|--- |")
	for _, r := range results {
		fmt.Fprintf(tw, "| %s\t| %s\t| %s\t| %d\t| %.0f\t| %d\t| %d / %d\t| %+.1f%%\t| %d\t| %s\t| %.0f\t| %.3f\t| %.0f\t| %d |\n",
			r.Name, r.mode(), r.fleetSize(), r.keys(), float64(r.Offered)/r.Elapsed.Seconds(), r.Admitted, r.Worst, r.Events,
			r.Overshoot, r.Denied, r.falseDenials(), r.perSec(r.Cmds), r.perReq(r.Cmds), r.perSec(r.Scripts), r.EarlySyncs)
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

// writeRuns writes one row of figures per run.
func writeRuns(path string, results []result) error {
	var b strings.Builder
	b.WriteString("case,group,sync,instances,keys,events,window_s,seconds,offered,offered_per_s,admitted,denied,false_denials," +
		"worst_window,over_limit_pct,redis_cmds,redis_cmds_per_s,redis_cmds_per_request,script_calls,script_calls_per_s,script_calls_per_request,early_passes\n")
	for _, r := range results {
		fd := ""
		if r.FalseDenials >= 0 {
			fd = strconv.Itoa(r.FalseDenials)
		}
		fmt.Fprintf(&b, "%q,%s,%s,%s,%d,%d,%g,%.2f,%d,%.1f,%d,%d,%s,%d,%.1f,%d,%.1f,%.4f,%d,%.1f,%.4f,%d\n",
			r.Name, r.Group, r.mode(), r.fleetSize(), r.keys(), r.Events, r.Window.Seconds(), r.Elapsed.Seconds(),
			r.Offered, float64(r.Offered)/r.Elapsed.Seconds(), r.Admitted, r.Denied, fd, r.Worst, r.Overshoot,
			r.Cmds, r.perSec(r.Cmds), r.perReq(r.Cmds), r.Scripts, r.perSec(r.Scripts), r.perReq(r.Scripts), r.EarlySyncs)
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}
