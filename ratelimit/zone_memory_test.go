package ratelimit

import (
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// TestACollectedZoneGivesItsMemoryBack: the arena's chunks and the
// indexes' tables are outside the heap, so the zone's cleanup must unmap
// them once nothing reaches it.
func TestACollectedZoneGivesItsMemoryBack(t *testing.T) {
	l := mustLimit(t, 100, time.Minute, 0)
	z := newZone("t", "z", 0, l.slots)
	z.SetMaxKeys(60_000) // past a page of index in every shard
	now := time.Now().UnixNano()
	for i := range 60_000 {
		s, _, _, _ := z.lock(keyhash.Of("k"+strconv.Itoa(i)), now)
		s.mu.Unlock()
	}
	mem := z.arena.mem
	if mem.Size() == 0 {
		t.Fatal("60000 keys took no memory outside the heap")
	}
	z = nil
	deadline := time.Now().Add(5 * time.Second)
	for mem.Size() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d bytes still mapped after the zone was collected", mem.Size())
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
}
