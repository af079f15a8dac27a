package budget

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/internal/wait"
)

// waitIdle waits for the engine's background releases and for its breaker to
// close again.
func waitIdle(t *testing.T, e *Engine) {
	t.Helper()
	wait.Until(t, 20*time.Second, "the breaker closing after the store came back", func() bool { return !e.Down() })
	e.Close(20 * time.Second)
}

// waitDown waits for the breaker to open: a probe started by a failed store
// call failed too.
func waitDown(t *testing.T, e *Engine) {
	t.Helper()
	wait.Until(t, 20*time.Second, "the breaker opening while the store was down", e.Down)
}

// A reserve whose reply is lost in a stall longer than the client's timeout
// is answered with an error, runs late on the server, and is released by id:
// what was refused is never charged, and nothing is charged twice.
func TestStallDuringReservesChargesNothingRefused(t *testing.T) {
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	c := srv.Client(t)
	var resolved sync.Map
	e := NewEngine(NewRedisStore(c), "stall")
	e.OnResolve = func(_ *Reservation, _, o string) {
		n, _ := resolved.LoadOrStore(o, new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
	}
	b := []Budget{tokenBudget("daily", Global, 100_000)}
	// Admitted before the stall and settled to what they used.
	var usedBefore int64
	for i := 0; i < 3; i++ {
		r := mustReserve(t, e, b, Dims{}, 105)
		if err := e.Settle(context.Background(), r, Spend{Tokens: 40}); err != nil {
			t.Fatal(err)
		}
		usedBefore += 40
	}
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer admin.Close()
	stalled := make(chan error, 1)
	// Longer than a reserve's timeout and the probe's after it, with time
	// to spare for a reserve with the breaker open.
	go func() { stalled <- admin.Do(context.Background(), "DEBUG", "SLEEP", "3").Err() }()
	srv.WaitStalled(t)
	var wg sync.WaitGroup
	var failed atomic.Int64
	for i := 0; i < 5; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, _, err := e.Reserve(context.Background(), b, Dims{}, Spend{Tokens: 105}); err != nil {
				failed.Add(1)
			}
		}()
	}
	wg.Wait()
	if failed.Load() != 5 {
		t.Fatalf("%d of 5 reserves during the stall failed, want all", failed.Load())
	}
	// The failed reserves started a probe, which fails too (the stall
	// outlasts it) and opens the breaker. While the store is known to be
	// down, a reserve fails at once: the breaker answers without asking the
	// store (no store call, so no store error counted).
	waitDown(t, e)
	storeErrors := e.StoreErrors()
	if _, _, err := e.Reserve(context.Background(), b, Dims{}, Spend{Tokens: 105}); !errors.Is(err, ErrStoreDown) {
		t.Fatalf("a reserve with the breaker open: %v, want ErrStoreDown", err)
	}
	if got := e.StoreErrors(); got != storeErrors {
		t.Fatalf("a reserve with the breaker open asked the store (store errors %d -> %d)", storeErrors, got)
	}
	if err := <-stalled; err != nil {
		t.Fatal(err)
	}
	waitIdle(t, e)
	assertUsed(t, e, b, Dims{}, usedBefore)
	var released, cancelled int64
	if n, ok := resolved.Load("released"); ok {
		released = n.(*atomic.Int64).Load()
	}
	if n, ok := resolved.Load("cancelled"); ok {
		cancelled = n.(*atomic.Int64).Load()
	}
	if released+cancelled != 5 {
		t.Fatalf("resolved %d released + %d cancelled, want all 5 reserves resolved", released, cancelled)
	}
}

// A settle whose reply is lost in a stall is retried by the engine (never by
// the client): it applies exactly once.
func TestStallDuringSettleAppliesOnce(t *testing.T) {
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	e := NewEngine(NewRedisStore(srv.Client(t)), "stallsettle")
	b := []Budget{tokenBudget("daily", Global, 100_000)}
	r := mustReserve(t, e, b, Dims{}, 500)
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer admin.Close()
	stalled := make(chan error, 1)
	go func() { stalled <- admin.Do(context.Background(), "DEBUG", "SLEEP", "0.5").Err() }()
	srv.WaitStalled(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = e.Settle(ctx, r, Spend{Tokens: 120}) // may fail: its first try ran late
	if err := <-stalled; err != nil {
		t.Fatal(err)
	}
	if err := e.Settle(ctx, r, Spend{Tokens: 120}); err != nil {
		t.Fatal(err)
	}
	waitIdle(t, e)
	assertUsed(t, e, b, Dims{}, 120)
}

// kill -9 mid-flight and a restart: reserves that failed are resolved once
// the store is back, and nothing refused is charged.
func TestKillAndRestartMidFlight(t *testing.T) {
	srv := redistest.Start(t)
	e := NewEngine(NewRedisStore(srv.Client(t)), "kill")
	b := []Budget{tokenBudget("daily", Global, 100_000)}
	srv.Stop() // SIGKILL
	for i := 0; i < 5; i++ {
		if _, _, err := e.Reserve(context.Background(), b, Dims{}, Spend{Tokens: 50}); err == nil {
			t.Fatal("a reserve against a killed Redis must fail")
		}
	}
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	waitIdle(t, e)
	assertUsed(t, e, b, Dims{}, 0)
	r := mustReserve(t, e, b, Dims{}, 50)
	if err := e.Settle(context.Background(), r, Spend{Tokens: 30}); err != nil {
		t.Fatal(err)
	}
	assertUsed(t, e, b, Dims{}, 30)
}

// A settle against a killed store fails after its retries with ErrDrift, and
// is applied in the background once the store is back (it restarts empty
// here, so the background finds no reservation: nothing is applied twice).
func TestSettleAgainstAKilledStoreIsDrift(t *testing.T) {
	srv := redistest.Start(t)
	e := NewEngine(NewRedisStore(srv.Client(t)), "drift")
	var outcomes sync.Map
	e.OnResolve = func(_ *Reservation, kind, o string) { outcomes.Store(kind, o) }
	b := []Budget{tokenBudget("daily", Global, 100_000)}
	r := mustReserve(t, e, b, Dims{}, 500)
	srv.Stop()
	err := e.Settle(context.Background(), r, Spend{Tokens: 120})
	if !errors.Is(err, ErrDrift) {
		t.Fatalf("a settle against a killed store: %v, want ErrDrift", err)
	}
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	waitIdle(t, e)
	if o, _ := outcomes.Load("settle"); o != "applied_before" {
		t.Fatalf("the background resolution of the settle: %v, want applied_before (no reservation left to apply to)", o)
	}
	assertUsed(t, e, b, Dims{}, 0)
}

// An extension whose reply is lost in a stall runs late on the server (or
// not at all): the settle moves the counters from what the record holds, so
// the charge is what was used either way, never the lost extension on top.
func TestStallDuringAnExtensionChargesWhatWasUsed(t *testing.T) {
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	e := NewEngine(NewRedisStore(srv.Client(t)), "stallext")
	b := []Budget{tokenBudget("daily", Global, 100_000), tokenBudget("per_key", PerKey, 100_000)}
	dims := Dims{Principal: "alice"}
	r := mustReserve(t, e, b, dims, 100)
	// One extension before the stall: the server knows the script, so the
	// one sent into the stall runs once the stall ends.
	if d, err := e.Extend(context.Background(), r, Spend{Tokens: 50}); err != nil || d != nil {
		t.Fatal(d, err)
	}
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer admin.Close()
	stalled := make(chan error, 1)
	go func() { stalled <- admin.Do(context.Background(), "DEBUG", "SLEEP", "1").Err() }()
	srv.WaitStalled(t)
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	d, err := e.Extend(ctx, r, Spend{Tokens: 500})
	cancel()
	if err == nil || d != nil {
		t.Fatalf("an extension in a stall: denial %+v, error %v; want an error", d, err)
	}
	if err := <-stalled; err != nil {
		t.Fatal(err)
	}
	waitIdle(t, e)
	e = NewEngine(NewRedisStore(srv.Client(t)), "stallext")
	// The extension's script ran after the stall, unseen: 650 held.
	assertUsed(t, e, b, dims, 650)
	if err := e.Settle(context.Background(), r, Spend{Tokens: 130}); err != nil {
		t.Fatal(err)
	}
	used, err := e.Used(context.Background(), b, dims)
	if err != nil || used[0] != 130 || used[1] != 130 {
		t.Fatalf("after the settle: %v %v, want [130 130]", used, err)
	}
}

// One slow call is no evidence that the store is down: a reserve that times
// out in a CLIENT PAUSE starts a probe, which the store answers once the
// pause ends, so the breaker stays closed and the next reserve asks the
// store. A stall that outlasts the probe's second (DEBUG SLEEP 2) opens it,
// and the probe closes it once the store answers.
func TestTheBreakerOpensOnAFailedProbeNotOnOneTimeout(t *testing.T) {
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	e := NewEngine(NewRedisStore(srv.Client(t)), "breaker")
	t.Cleanup(func() { e.Close(5 * time.Second) })
	b := []Budget{tokenBudget("daily", Global, 100_000)}
	mustReserve(t, e, b, Dims{}, 10) // the script is loaded
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer admin.Close()
	// A reserve waits 100 ms; the pause is 200 ms, so the probe it starts
	// is answered within its second. (A machine too slow to send the
	// reserve within 100 ms of the pause sees it answered: pause again.)
	timedOut := false
	for range 10 {
		if err := admin.Do(context.Background(), "CLIENT", "PAUSE", "200").Err(); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		_, _, err := e.Reserve(ctx, b, Dims{}, Spend{Tokens: 10})
		cancel()
		if err != nil {
			timedOut = true
			if e.Down() {
				t.Fatal("one reserve timed out in a 200 ms pause, and the breaker opened at once")
			}
			break
		}
		time.Sleep(300 * time.Millisecond) // out of the pause before the next one
	}
	if !timedOut {
		t.Fatal("no reserve timed out in 10 pauses of 200 ms: the test proves nothing")
	}
	wait.Until(t, 20*time.Second, "the probe ending", func() bool { return !e.probing.Load() })
	if e.Down() {
		t.Fatal("one reserve timed out in a 200 ms pause, and the breaker opened")
	}
	if _, _, err := e.Reserve(context.Background(), b, Dims{}, Spend{Tokens: 10}); err != nil {
		t.Fatalf("a reserve after the pause: %v", err)
	}

	stalled := make(chan error, 1)
	go func() { stalled <- admin.Do(context.Background(), "DEBUG", "SLEEP", "2").Err() }()
	srv.WaitStalled(t)
	if _, _, err := e.Reserve(context.Background(), b, Dims{}, Spend{Tokens: 10}); err == nil {
		t.Fatal("a reserve in a 2 s sleep succeeded")
	}
	waitDown(t, e)
	if err := <-stalled; err != nil {
		t.Fatal(err)
	}
	waitIdle(t, e)
}
