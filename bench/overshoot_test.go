// Package bench measures what the unit tests cannot assert: how far a fleet
// overshoots its limit, with real reconcilers on a real Redis.
//
//	go test -run '^$' -bench Overshoot -benchtime 1x ./bench/
package bench

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/ratelimit"
	"github.com/fleetguard/fleetguard/window"
)

// BenchmarkFleetOvershoot runs N instances, each with its own Redis client
// and reconciler (100 ms sync), against one key limited to 100 events per
// 2 s window. Each instance sends the key 200 requests a second for one
// window, starting right after a window boundary, so every admit lands in
// one epoch. It reports the admitted total, the overshoot past 100 and the
// documented bound (N-1) x rate x interval.
func BenchmarkFleetOvershoot(b *testing.B) {
	srv := redistest.Start(b)
	const (
		events   = 100
		win      = 2 * time.Second
		rate     = 200 // requests per second per instance
		interval = 100 * time.Millisecond
	)
	for _, n := range []int{1, 2, 3, 4} {
		b.Run(fmt.Sprintf("instances=%d", n), func(b *testing.B) {
			var admitted, overshoot float64
			for i := 0; i < b.N; i++ {
				a := runFleet(b, srv, n, events, win, rate, interval, fmt.Sprintf("os%d-%d", n, i))
				admitted += float64(a)
				overshoot += float64(max(a-events, 0))
			}
			b.ReportMetric(admitted/float64(b.N), "admitted/run")
			b.ReportMetric(overshoot/float64(b.N), "overshoot/run")
			b.ReportMetric(float64(n-1)*rate*interval.Seconds(), "bound/run")
		})
	}
}

func runFleet(b *testing.B, srv *redistest.Server, n int, events int64, win time.Duration, rate int, interval time.Duration, prefix string) int64 {
	limit, err := ratelimit.NewLimit(events, win, events)
	if err != nil {
		b.Fatal(err)
	}
	key := keyhash.Of("overshoot-key")
	engines := make([]*ratelimit.Engine, n)
	for i := range engines {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
		b.Cleanup(func() { _ = c.Close() })
		e, err := ratelimit.NewEngine(ratelimit.Options{Store: ratelimit.NewRedisStore(c), Prefix: prefix, SyncInterval: interval})
		if err != nil {
			b.Fatal(err)
		}
		e.Start()
		engines[i] = e
	}
	defer func() {
		for _, e := range engines {
			e.Close(time.Second)
		}
	}()
	// Start just after a window boundary so the whole run is one epoch.
	now := time.Now().UnixNano()
	time.Sleep(window.Remaining(now, win) + 10*time.Millisecond)
	stop := time.Now().Add(win - 50*time.Millisecond)

	var admitted atomic.Int64
	var wg sync.WaitGroup
	for _, e := range engines {
		wg.Add(1)
		go func(e *ratelimit.Engine) {
			defer wg.Done()
			z := e.Zone("z")
			checks := []ratelimit.Check{{Zone: z, Limit: &limit, Key: key}}
			out := make([]ratelimit.Verdict, 1)
			tick := time.NewTicker(time.Second / time.Duration(rate))
			defer tick.Stop()
			for time.Now().Before(stop) {
				<-tick.C
				if d, _ := e.Allow(time.Now().UnixNano(), checks, out); d < 0 {
					admitted.Add(1)
				}
			}
		}(e)
	}
	wg.Wait()
	return admitted.Load()
}
