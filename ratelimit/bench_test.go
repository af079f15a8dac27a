package ratelimit

import (
	"context"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// BenchmarkAllowExistingKey measures the request path (gate + record) for a
// key the instance already tracks: key hash, one shard lock, the slot ring.
func BenchmarkAllowExistingKey(b *testing.B) {
	e := memoryEngine(b)
	l := mustLimit(b, maxEvents, time.Hour, 0) // never denies: measures the admit path
	benchAllowKey(b, e, l, e.Zone("z", l))
}

// benchAllowKey admits one key again and again (hash included), a key the
// zone has already seen.
func benchAllowKey(b *testing.B, e *Engine, l *Limit, z *Zone) {
	key := "Bearer sk-live-0123456789abcdef"
	allow(e, z, l, key, time.Now().UnixNano())
	checks := []Check{{Zone: z, Limit: l}}
	out := make([]Verdict, 1)
	b.ReportAllocs()
	for b.Loop() {
		checks[0].Key = keyhash.Of(key)
		if d := e.Allow(time.Now().UnixNano(), checks, out); d != -1 {
			b.Fatal("denied")
		}
	}
}

// BenchmarkAllowBusyKey is BenchmarkAllowExistingKey for a key with
// requests in every slot of its window, as steady traffic has (the other
// benchmark's requests all fall in the newest slot of an hour): a clock
// that advances 1 ms per request through a 1 s window of 20 slots.
func BenchmarkAllowBusyKey(b *testing.B) {
	e := memoryEngine(b)
	l := mustLimit(b, 1<<29, time.Second, 0)
	z := e.Zone("z", l)
	key := "Bearer sk-live-0123456789abcdef"
	now := time.Now().UnixNano()
	for i := 0; i < 1000; i++ { // fill the window
		now += int64(time.Millisecond)
		allow(e, z, l, key, now)
	}
	checks := []Check{{Zone: z, Limit: l}}
	out := make([]Verdict, 1)
	b.ReportAllocs()
	for b.Loop() {
		now += int64(time.Millisecond)
		checks[0].Key = keyhash.Of(key)
		if d := e.Allow(now, checks, out); d != -1 {
			b.Fatal("denied")
		}
	}
}

// BenchmarkAllowUntrackedKey is BenchmarkAllowExistingKey for a key that
// arrived while its zone was full: its local cap alone, in the shard's
// table of untracked keys.
func BenchmarkAllowUntrackedKey(b *testing.B) {
	e := memoryEngine(b)
	l := mustLimit(b, maxEvents, time.Hour, 0)
	z := e.Zone("z", l)
	z.SetMaxKeys(1)
	allow(e, z, l, "tracked", time.Now().UnixNano())
	benchAllowKey(b, e, l, z)
}

// BenchmarkAllowParallel spreads 1024 keys over all cores.
func BenchmarkAllowParallel(b *testing.B) {
	e := memoryEngine(b)
	l := mustLimit(b, maxEvents, time.Hour, 0)
	z := e.Zone("z", l)
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

// BenchmarkMemoryPerKey reports the memory a tracked key costs (entry, ring
// of 21 slots, map slot), over 100k keys: B/key is the live heap and the
// arena's memory outside it (heap-B/key and offheap-B/key, all of its
// chunks), and rss-B/key the process's resident memory after minus before,
// the collector's headroom included, as an operator sees it.
func BenchmarkMemoryPerKey(b *testing.B) {
	const keys = 100_000
	hashes := make([]keyhash.Hash, keys)
	for i := range hashes {
		hashes[i] = keyhash.Of("key-" + strconv.Itoa(i))
	}
	var heap, offHeap, rss float64
	for b.Loop() {
		e := memoryEngine(b)
		l := mustLimit(b, 100, time.Minute, 0)
		z := e.Zone("z", l)
		z.SetMaxKeys(keys)
		now := time.Now().UnixNano()
		checks := []Check{{Zone: z, Limit: l}}
		out := make([]Verdict, 1)
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		rssBefore := residentBytes()
		for _, h := range hashes {
			checks[0].Key = h
			e.Allow(now, checks, out)
		}
		rss = float64(residentBytes()-rssBefore) / keys
		runtime.GC()
		runtime.ReadMemStats(&after)
		heap = float64(after.HeapAlloc-before.HeapAlloc) / keys
		offHeap = float64(z.arena.mem.Size()) / keys
		runtime.KeepAlive(e)
	}
	b.ReportMetric(heap+offHeap, "B/key")
	b.ReportMetric(heap, "heap-B/key")
	b.ReportMetric(offHeap, "offheap-B/key")
	b.ReportMetric(rss, "rss-B/key")
}

// residentBytes is the process's resident memory (VmRSS), 0 where
// /proc/self/status cannot tell.
func residentBytes() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb * 1024
		}
	}
	return 0
}

func TestAllowExistingKeyDoesNotAllocate(t *testing.T) {
	e := memoryEngine(t)
	l := mustLimit(t, maxEvents, time.Hour, 0)
	z := e.Zone("z", l)
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

// BenchmarkAllowOnAFloor is BenchmarkAllowExistingKey for an instance of a
// fleet: a key admitted on its slot's floor, with no store call.
func BenchmarkAllowOnAFloor(b *testing.B) {
	e := newEngine(b, Options{Store: newScriptStore(b), Prefix: "floor", SyncInterval: 100 * time.Millisecond})
	l := mustLimit(b, maxEvents/2, time.Hour, 0) // a floor of 2^26: never spent
	z := e.Zone("z", l)
	e.heartbeat(context.Background(), time.Now().UnixNano())
	if e.floor(l.Events, time.Now().UnixNano()) == 0 {
		b.Fatal("no floor")
	}
	benchAllowKey(b, e, l, z)
}
