package budget

import (
	"context"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/redistest"
)

// BenchmarkRequestLatency is what llmbudget adds to one request, with three
// budgets applying to it (a key's tokens, a team's dollars, global tokens):
// the reserve before the request is forwarded (on the request path) and the
// settle after the response (off it, but each one holds a connection). It
// reports the percentiles of each request's reserve and of its reserve plus
// settle, on the memory store and on a local redis-server through a client
// set up as module.go's store() sets it up.
func BenchmarkRequestLatency(b *testing.B) {
	b.Run("memory", func(b *testing.B) { benchRequestLatency(b, NewMemoryStore(), 0) })
	b.Run("redis", func(b *testing.B) { benchRequestLatency(b, benchRedisStore(b), 0) })
	// 10,000 keys and the 8 teams with limits of their own, the bench's 64
	// keys among them: every reserve reads its key's and team's override.
	b.Run("redis-10k-overrides", func(b *testing.B) { benchRequestLatency(b, benchRedisStore(b), 10_000) })
}

// benchTrips counts the round trips of benchRedisStore's clients.
var benchTrips roundTrips

// benchRedisStore is a store on a local redis-server through a client set up
// as module.go's store() sets it up.
func benchRedisStore(b *testing.B) *RedisStore {
	srv := redistest.Start(b)
	opts, err := redis.ParseURL(srv.URL())
	if err != nil {
		b.Fatal(err)
	}
	// As module.go: the plugin's timeouts, no retries by the client (a
	// re-sent reserve script would count twice), one dial attempt, and
	// the request's context bounding each command.
	opts.DialTimeout, opts.ReadTimeout, opts.WriteTimeout = 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond
	opts.MaxRetries, opts.DialerRetries = -1, 1
	opts.ContextTimeoutEnabled = true
	client := redis.NewClient(opts)
	client.AddHook(&benchTrips)
	b.Cleanup(func() { _ = client.Close() })
	return NewRedisStore(client)
}

// roundTrips counts the commands a client sends, each a round trip (a
// script's EVALSHA is one, whatever it runs on the server).
type roundTrips struct{ n atomic.Int64 }

func (*roundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }

func (rt *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		rt.n.Add(1)
		return next(ctx, cmd)
	}
}

func (rt *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		rt.n.Add(1)
		return next(ctx, cmds)
	}
}

// storeRoundTrips is the round trips a store's client has made so far, or
// -1 for a store that is not Redis.
func storeRoundTrips(s Store) int64 {
	if _, ok := s.(*RedisStore); ok {
		return benchTrips.n.Load()
	}
	return -1
}

func benchRequestLatency(b *testing.B, s Store, overrides int) {
	e := NewEngine(s, "latency")
	b.Cleanup(func() { e.Close(time.Second) })
	budgets := []Budget{
		{Name: "key_tokens", Scope: PerKey, Unit: Tokens, Limit: 1 << 60, Window: 24 * time.Hour},
		{Name: "team_usd", Scope: PerTeam, Unit: USD, Limit: 1 << 60, Window: 720 * time.Hour},
		{Name: "global_tokens", Scope: Global, Unit: Tokens, Limit: 1 << 60, Window: 24 * time.Hour},
	}
	// 64 API keys over 8 teams, so requests touch different counters.
	dims := make([]Dims, 64)
	for i := range dims {
		dims[i] = Dims{Principal: "Bearer sk-bench-" + strconv.Itoa(i), Team: "team-" + strconv.Itoa(i%8), Model: "gpt-4o"}
	}
	request := func(ctx context.Context, d Dims) (reserved time.Duration) {
		start := time.Now()
		r, denial, err := e.Reserve(ctx, budgets, d, Spend{Tokens: 1200, CostMicros: 9000})
		reserved = time.Since(start)
		if err != nil || denial != nil {
			b.Fatal(denial, err)
		}
		if err := e.Settle(ctx, r, Spend{Tokens: 700, CostMicros: 5000}); err != nil {
			b.Fatal(err)
		}
		return reserved
	}
	ctx := context.Background()
	for i := range overrides {
		d := Dims{Principal: "Bearer sk-bench-" + strconv.Itoa(i), Team: "team-" + strconv.Itoa(i%8)}
		for j := range 2 {
			if err := e.SetLimit(ctx, &budgets[j], ScopeID(&budgets[j], d), 1<<60); err != nil {
				b.Fatal(err)
			}
		}
	}
	for _, d := range dims { // warm the connection pool and the counters
		request(ctx, d)
	}
	var reserves, totals []time.Duration
	b.ReportAllocs()
	trips := storeRoundTrips(s)
	b.ResetTimer()
	n := 0
	for i := 0; b.Loop(); i++ {
		start := time.Now()
		reserve := request(ctx, dims[i%len(dims)])
		totals = append(totals, time.Since(start))
		reserves = append(reserves, reserve)
		n++
	}
	b.StopTimer()
	if trips >= 0 {
		// The store's round trips per request, reserve and settle.
		b.ReportMetric(float64(storeRoundTrips(s)-trips)/float64(n), "trips/req")
	}
	b.ReportMetric(percentile(reserves, 50), "reserve-p50-ns")
	b.ReportMetric(percentile(reserves, 99), "reserve-p99-ns")
	b.ReportMetric(percentile(totals, 50), "p50-ns")
	b.ReportMetric(percentile(totals, 99), "p99-ns")
}

// percentile is the p-th percentile of ds in nanoseconds (nearest rank).
func percentile(ds []time.Duration, p int) float64 {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return float64(s[min((len(s)*p+99)/100, len(s))-1])
}
