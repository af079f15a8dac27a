package budget

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/redistest"
)

// Each failed store call counts once: reads, resets and reserves (whose
// background releases then count too, so past that the count only grows).
func TestStoreErrorsCountFailedCalls(t *testing.T) {
	srv := redistest.Start(t)
	e := NewEngine(NewRedisStore(srv.Client(t)), "storeerrors")
	t.Cleanup(func() { e.Close(time.Second) })
	b := tokenBudget("daily", Global, 1000)
	mustReserve(t, e, []Budget{b}, Dims{}, 10)
	if _, err := e.Standing(context.Background(), &b, "global"); err != nil || e.StoreErrors() != 0 {
		t.Fatalf("a healthy store: %v, %d errors", err, e.StoreErrors())
	}
	srv.Stop()
	if _, err := e.Standing(context.Background(), &b, "global"); err == nil {
		t.Fatal("a read against a stopped Redis must fail")
	}
	if _, err := e.Reset(context.Background(), &b, "global"); err == nil {
		t.Fatal("a reset against a stopped Redis must fail")
	}
	if got := e.StoreErrors(); got != 2 {
		t.Fatalf("after a failed read and reset: %d store errors, want 2", got)
	}
	if _, _, err := e.Reserve(context.Background(), []Budget{b}, Dims{}, Spend{Tokens: 1}); err == nil || errors.Is(err, ErrStoreDown) {
		t.Fatalf("the first reserve asks the store and fails: %v", err)
	}
	if got := e.StoreErrors(); got < 3 {
		t.Fatalf("after a failed reserve: %d store errors, want at least 3", got)
	}
}
