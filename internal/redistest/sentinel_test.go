package redistest

import (
	"context"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/wait"
)

// A failover client follows the sentinels to the replica they promote after
// the master is killed (SIGKILL), and finds there what the master had
// replicated.
func TestSentinelFailsOverToTheReplica(t *testing.T) {
	s := StartSentinel(t, 3)
	c := s.Client(t)
	ctx := context.Background()
	if err := c.Set(ctx, "before", "1", 0).Err(); err != nil {
		t.Fatalf("writing through the sentinels: %v", err)
	}
	// WAIT: the write reached the replica before the kill.
	if n, err := c.Wait(ctx, 1, time.Second).Result(); err != nil || n != 1 {
		t.Fatalf("WAIT: %d replicas, %v", n, err)
	}
	from := s.Master.Addr()
	killed := time.Now()
	s.Master.Stop()
	promoted, err := s.AwaitFailover(from, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if promoted != s.Replica {
		t.Fatalf("promoted %s, want the replica %s", promoted.Addr(), s.Replica.Addr())
	}
	t.Logf("failover %s → %s in %s", from, promoted.Addr(), time.Since(killed).Round(time.Millisecond))
	var v string
	wait.Until(t, 5*time.Second, "the failover client reaching the new master", func() bool {
		var err error
		v, err = c.Get(ctx, "before").Result()
		return err == nil
	})
	if v != "1" {
		t.Fatalf("after the failover: %q, want the replicated 1", v)
	}
	if err := c.Set(ctx, "after", "2", 0).Err(); err != nil {
		t.Fatalf("writing to the new master: %v", err)
	}
}
