package ratelimit

import (
	"strconv"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// BenchmarkAllowExistingKey measures the request path (gate + record) for a
// key the instance already tracks: key hash, shard lookup, one key lock.
func BenchmarkAllowExistingKey(b *testing.B) {
	e := memoryEngine(b)
	z := e.Zone("z")
	l := mustLimit(b, 1<<40, time.Hour, 0) // never denies: measures the admit path
	key := "Bearer sk-live-0123456789abcdef"
	now := time.Now().UnixNano()
	allow(e, z, l, key, now)
	checks := []Check{{Zone: z, Limit: l}}
	out := make([]Verdict, 1)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		checks[0].Key = keyhash.Of(key)
		if d, _ := e.Allow(time.Now().UnixNano(), checks, out); d != -1 {
			b.Fatal("denied")
		}
	}
}

// BenchmarkAllowParallel spreads 1024 keys over all cores.
func BenchmarkAllowParallel(b *testing.B) {
	e := memoryEngine(b)
	z := e.Zone("z")
	l := mustLimit(b, 1<<40, time.Hour, 0)
	keys := make([]keyhash.Hash, 1024)
	for i := range keys {
		keys[i] = keyhash.Of("key-" + strconv.Itoa(i))
	}
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		checks := []Check{{Zone: z, Limit: l}}
		out := make([]Verdict, 1)
		i := 0
		for pb.Next() {
			checks[0].Key = keys[i&1023]
			i++
			e.Allow(time.Now().UnixNano(), checks, out)
		}
	})
}

func TestAllowExistingKeyDoesNotAllocate(t *testing.T) {
	e := memoryEngine(t)
	z := e.Zone("z")
	l := mustLimit(t, 1<<40, time.Hour, 0)
	allow(e, z, l, "k", time.Now().UnixNano())
	checks := []Check{{Zone: z, Limit: l, Key: keyhash.Of("k")}}
	out := make([]Verdict, 1)
	n := testing.AllocsPerRun(1000, func() {
		e.Allow(time.Now().UnixNano(), checks, out)
	})
	if n != 0 {
		t.Fatalf("Allow on an existing key allocates %v times, want 0", n)
	}
}
