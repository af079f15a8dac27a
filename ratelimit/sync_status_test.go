package ratelimit

import (
	"context"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/redistest"
)

// LastSync moves with each pass that reaches the store and SyncErrors with
// each that does not; a failed pass leaves LastSync where it was.
func TestLastSyncAndSyncErrors(t *testing.T) {
	srv := redistest.Start(t)
	e := fleetEngine(t, NewRedisStore(srv.Client(t)), "syncstatus")
	if !e.LastSync().IsZero() || e.SyncErrors() != 0 {
		t.Fatalf("before any pass: last sync %v, errors %d; want zero and 0", e.LastSync(), e.SyncErrors())
	}
	l := mustLimit(t, 10, time.Hour, 0)
	z := e.Zone("z", l)
	allow(e, z, l, "k", time.Now().UnixNano())
	before := time.Now()
	passNow(t, e)
	synced := e.LastSync()
	if synced.Before(before) || synced.After(time.Now()) || e.SyncErrors() != 0 {
		t.Fatalf("after a pass: last sync %v (pass started %v), errors %d", synced, before, e.SyncErrors())
	}
	srv.Stop()
	for i := 1; i <= 2; i++ {
		queue(e, z, "k")
		if err := e.pass(context.Background(), time.Now().UnixNano(), false); err == nil {
			t.Fatal("a pass against a stopped Redis must fail")
		}
		if got := e.SyncErrors(); got != uint64(i) {
			t.Fatalf("after %d failed passes: %d sync errors", i, got)
		}
	}
	if !e.LastSync().Equal(synced) {
		t.Fatalf("a failed pass moved LastSync from %v to %v", synced, e.LastSync())
	}
}
