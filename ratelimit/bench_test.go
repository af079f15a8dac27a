package ratelimit

import (
	"context"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
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

// BenchmarkMemoryPerKey reports the heap a tracked key costs (entry, ring of
// 21 slots, map slot), over 100k keys.
func BenchmarkMemoryPerKey(b *testing.B) {
	const keys = 100_000
	hashes := make([]keyhash.Hash, keys)
	for i := range hashes {
		hashes[i] = keyhash.Of("key-" + strconv.Itoa(i))
	}
	var perKey float64
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
		for _, h := range hashes {
			checks[0].Key = h
			e.Allow(now, checks, out)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		perKey = float64(after.HeapAlloc-before.HeapAlloc) / keys
		runtime.KeepAlive(e)
	}
	b.ReportMetric(perKey, "B/key")
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

// founderWithKeysOnTheirFloor is a fleet's founder on store (a fleet of
// its own: prefix) that has admitted one request of each of keys keys of a
// zone of 1000 per 10 s, on their floor share, at now.
func founderWithKeysOnTheirFloor(b *testing.B, store SlotStore, prefix string, keys int) (e *Engine, z *Zone, l *Limit, now int64) {
	e = newEngine(b, Options{Store: store, Prefix: prefix, SyncInterval: 100 * time.Millisecond})
	l = mustLimit(b, 1000, 10*time.Second, 0)
	z = e.Zone("z", l)
	z.SetMaxKeys(int64(keys) + 1)
	e.heartbeat(context.Background(), time.Now().UnixMilli())
	now = e.warmUntil.Load()
	e.heartbeat(context.Background(), now/int64(time.Millisecond)) // founders take their floor shares
	checks := []Check{{Zone: z, Limit: l}}
	out := make([]Verdict, 1)
	for i := range keys {
		checks[0].Key = keyhash.Of("key-" + strconv.Itoa(i))
		e.Allow(now, checks, out)
	}
	onFloor := z.Keys()
	for i := range z.shards {
		onFloor -= int64(len(z.shards[i].active))
	}
	if onFloor < int64(keys)*9/10 {
		b.Fatalf("%d of %d keys on their floor share", onFloor, keys)
	}
	return e, z, l, now
}

// BenchmarkPassWithKeysOnTheirFloor is one full reconcile pass of a fleet
// instance tracking 100k or 1M keys on their floor share, plus one synced
// key: the pass visits only the synced one.
func BenchmarkPassWithKeysOnTheirFloor(b *testing.B) {
	for _, keys := range []int{100_000, 1_000_000} {
		b.Run(strconv.Itoa(keys), func(b *testing.B) {
			e, z, l, now := founderWithKeysOnTheirFloor(b, NewMemoryStore(), "bench", keys)
			checks := []Check{{Zone: z, Limit: l, Key: keyhash.Of("hot")}}
			out := make([]Verdict, 1)
			for range 700 { // past three quarters of its floor share (800): it syncs
				e.Allow(now, checks, out)
			}
			ctx := context.Background()
			_ = e.pass(ctx, now, true)
			b.ReportAllocs()
			for b.Loop() {
				if err := e.pass(ctx, now, false); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkHeartbeatWithKeysOnTheirFloor is one heartbeat of a fleet
// instance tracking 100k or 1M keys on their floor share (on the embedded
// store): its promise reads every such key's ring (see propose).
func BenchmarkHeartbeatWithKeysOnTheirFloor(b *testing.B) {
	for _, keys := range []int{100_000, 1_000_000} {
		b.Run(strconv.Itoa(keys), func(b *testing.B) {
			e, _, _, now := founderWithKeysOnTheirFloor(b, NewMemoryStore(), "bench", keys)
			nowMs := now / int64(time.Millisecond)
			b.ReportAllocs()
			for b.Loop() {
				nowMs++
				e.heartbeat(context.Background(), nowMs)
			}
		})
	}
}

// BenchmarkGracefulStopWithKeysOnTheirFloor is what a graceful stop costs
// when many keys hold admits on their floor share: one step each, pushed to
// a real redis-server in pipelines (see flush). Each op is one stop.
func BenchmarkGracefulStopWithKeysOnTheirFloor(b *testing.B) {
	srv := redistest.Start(b)
	for _, keys := range []int{10_000, flushFloorKeys} {
		b.Run(strconv.Itoa(keys), func(b *testing.B) {
			store := NewRedisStore(srv.Client(b))
			flushed := 0
			for b.Loop() {
				b.StopTimer()
				e, _, _, now := founderWithKeysOnTheirFloor(b, store, "stop"+strconv.Itoa(keys)+"-"+strconv.Itoa(flushed), keys)
				b.StartTimer()
				e.stopped.Store(true)
				if e.flush(context.Background(), now) {
					flushed++
				}
			}
			if flushed != b.N {
				b.Fatalf("%d of %d stops flushed", flushed, b.N)
			}
			if n, err := srv.Client(b).DBSize(context.Background()).Result(); err != nil || n < int64(keys) {
				b.Fatalf("the store holds %d keys (%v): the floor admits of %d were not pushed", n, err, keys)
			}
		})
	}
}

// BenchmarkAllowKeysOnTheirFloor admits 100k keys on their floor share in
// turn, as a fleet's cold keys are: the floor admit, with the floor
// promise's raise and check. The clock moves 1 µs a request (each key comes
// back every 100 ms, a tenth of its floor share in a window), and a
// heartbeat every half second sends the promise (not timed).
func BenchmarkAllowKeysOnTheirFloor(b *testing.B) {
	const keys = 100_000
	e, z, l, now := founderWithKeysOnTheirFloor(b, NewMemoryStore(), "bench", keys)
	hashes := make([]keyhash.Hash, keys)
	for i := range hashes {
		hashes[i] = keyhash.Of("key-" + strconv.Itoa(i))
	}
	checks := []Check{{Zone: z, Limit: l}}
	out := make([]Verdict, 1)
	nextHeartbeat := now
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		now += int64(time.Microsecond)
		if now >= nextHeartbeat {
			b.StopTimer()
			e.heartbeat(context.Background(), now/int64(time.Millisecond))
			nextHeartbeat = now + int64(500*time.Millisecond)
			b.StartTimer()
		}
		checks[0].Key = hashes[i]
		if i++; i == keys {
			i = 0
		}
		if d := e.Allow(now, checks, out); d != -1 {
			b.Fatal("denied")
		}
	}
}
