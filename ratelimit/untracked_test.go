package ratelimit

import (
	"context"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// fullZone is a zone of max_keys 10, all tracked, under a limit of 3
// requests a minute (burst 3, one request every 20 s).
func fullZone(t *testing.T, now int64) (*Engine, *Zone, *Limit) {
	t.Helper()
	e := memoryEngine(t)
	l := mustLimit(t, 3, time.Minute, 0)
	z := e.Zone("z", l)
	z.SetMaxKeys(10)
	for i := range 10 {
		allow(e, z, l, "tracked-"+strconv.Itoa(i), now)
	}
	return e, z, l
}

// admitted sends n requests of key, one every step from start, and counts
// the admitted ones; every denial must be the local cap's.
func admitted(t *testing.T, e *Engine, z *Zone, l *Limit, key string, start, step int64, n int) int64 {
	t.Helper()
	var got int64
	for i := range n {
		v := allow(e, z, l, key, start+int64(i)*step)
		switch {
		case v.Allowed:
			got++
		case v.Fleet:
			t.Fatalf("%s: an untracked key denied by the window: %+v", key, v)
		}
	}
	return got
}

// Past max_keys a flood of unique keys does not refuse a new key: its first
// requests are admitted up to its burst, on its own account. A flood key that
// keeps hammering is still held to its local cap.
func TestPastMaxKeysAFloodDoesNotRefuseANewKey(t *testing.T) {
	now := time.Now().UnixNano()
	e, z, l := fullZone(t, now)
	// Three times the table's room in unique keys, each spending its whole
	// burst and one request more.
	for i := range 3 * UntrackedKeys {
		admitted(t, e, z, l, "flood-"+strconv.Itoa(i), now, 0, int(l.Burst)+1)
	}
	if z.Keys() != 10 {
		t.Fatalf("tracked keys = %d, want max_keys 10", z.Keys())
	}

	v := allow(e, z, l, "newcomer", now)
	if !v.Allowed || v.Remaining != 2 || v.Reset != 20*time.Second {
		t.Fatalf("a new key's first request after the flood: %+v, want admitted with 2 remaining, one more in 20s", v)
	}
	allow(e, z, l, "newcomer", now)
	allow(e, z, l, "newcomer", now)
	if v := allow(e, z, l, "newcomer", now); v.Allowed || v.Fleet || v.RetryAfter != 20*time.Second {
		t.Fatalf("the new key past its burst: %+v, want denied by the local cap, retry in 20s", v)
	}

	// Hammering for a whole window, alone and then amid a new flood, a flood
	// key gets its burst at once and one request per 20 s after.
	later := now + int64(time.Minute)
	step := int64(100 * time.Millisecond)
	if got := admitted(t, e, z, l, "flood-7", later, step, 600); got > l.Burst+l.Events {
		t.Fatalf("a flood key hammering alone: %d admitted in a window, want at most burst + events = %d", got, l.Burst+l.Events)
	}
	// The new flood keeps every set full of states younger than 20 s (a
	// state per key: 16 384 keys each 20 s fill the table).
	const floodPerStep = UntrackedKeys / 100
	later += 2 * int64(time.Minute)
	var got int64
	for i := range 600 {
		at := later + int64(i)*step
		got += admitted(t, e, z, l, "flood-7", at, 0, 1)
		for j := range floodPerStep {
			admitted(t, e, z, l, "flood-again-"+strconv.Itoa(floodPerStep*i+j), at, 0, 1)
		}
	}
	if got > l.Burst+l.Events {
		t.Fatalf("a flood key hammering amid a flood: %d admitted in a window, want at most burst + events = %d", got, l.Burst+l.Events)
	}

	// A tracked key keeps its own limit, window included.
	if v := allow(e, z, l, "tracked-0", now); !v.Allowed {
		t.Fatalf("a tracked key after the flood: %+v, want admitted", v)
	}
}

// Untracked keys cost a fixed table, whatever their number, and nothing in
// the arena; once idle tracked keys are evicted, new keys are tracked again.
func TestMaxKeysBoundsMemory(t *testing.T) {
	if size := unsafe.Sizeof(untrackedState{}); size != untrackedStateBytes {
		t.Fatalf("an untracked state is %d bytes; the docs say %d", size, untrackedStateBytes)
	}
	now := time.Now().UnixNano()
	e, z, l := fullZone(t, now)
	for i := range 100_000 {
		allow(e, z, l, "k"+strconv.Itoa(i), now)
	}
	if z.Keys() != 10 || z.arena.next != 10 {
		t.Fatalf("tracked keys %d, arena entries %d, want max_keys 10 of each", z.Keys(), z.arena.next)
	}
	for i := range z.shards {
		if z.shards[i].untracked == nil {
			t.Fatalf("shard %d has no table for its untracked keys after 100 000 of them", i)
		}
	}

	if err := e.pass(context.Background(), now, false); err != nil {
		t.Fatal(err)
	}
	later := now + int64(time.Hour)
	e.evict(later)
	if z.Keys() != 0 {
		t.Fatalf("after eviction %d tracked keys", z.Keys())
	}
	if v := allow(e, z, l, "one more", later); !v.Allowed || z.Keys() != 1 {
		t.Fatalf("after eviction a new key is tracked: %+v, keys %d", v, z.Keys())
	}
}

// A key that the zone starts to track keeps what it spent of its burst while
// it was untracked.
func TestATrackedKeyKeepsItsUntrackedLocalCap(t *testing.T) {
	now := time.Now().UnixNano()
	e, z, l := fullZone(t, now)
	if err := e.pass(context.Background(), now, false); err != nil {
		t.Fatal(err)
	}
	later := now + int64(time.Hour)
	if got := admitted(t, e, z, l, "newcomer", later, 0, 4); got != l.Burst {
		t.Fatalf("untracked: %d admitted, want the burst %d", got, l.Burst)
	}
	e.evict(later) // the tracked keys have been idle for an hour
	v := allow(e, z, l, "newcomer", later)
	if _, ring := stateOf(z, "newcomer"); ring == nil {
		t.Fatal("the key is not tracked once the zone has room")
	}
	if v.Allowed || v.Fleet {
		t.Fatalf("the newly tracked key: %+v, want denied by the local cap it spent", v)
	}
}

func TestAllowUntrackedKeyDoesNotAllocate(t *testing.T) {
	now := time.Now().UnixNano()
	e, z, l := fullZone(t, now)
	allow(e, z, l, "untracked", now)
	checks := []Check{{Zone: z, Limit: l, Key: keyhash.Of("untracked")}}
	out := make([]Verdict, 1)
	n := testing.AllocsPerRun(1000, func() {
		e.Allow(time.Now().UnixNano(), checks, out)
	})
	if n != 0 {
		t.Fatalf("Allow on an untracked key allocates %v times, want 0", n)
	}
}
