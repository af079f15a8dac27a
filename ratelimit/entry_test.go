package ratelimit

import (
	"math/rand/v2"
	"testing"
)

// walkScan is scan as a walk from the oldest slot to head, slot by slot: the
// definition scan's two loops must agree with.
func walkScan(head int64, ring []uint32) (used, oldest int64) {
	n := int64(len(ring))
	oldest, found := head, false
	for slot := head - n + 1; slot <= head; slot++ {
		if c := ring[slotIndex(slot, n)]; c != 0 {
			used += int64(c)
			if !found {
				oldest, found = slot, true
			}
		}
	}
	return used, oldest
}

func TestScanMatchesAWalkOfTheRing(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{1, 2, 3, 7, 20, MaxPrecision} {
		for trial := 0; trial < 2000; trial++ {
			ring := make([]uint32, n)
			// Sparse, dense and empty rings, with counts up to the largest.
			for i := range ring {
				switch rng.IntN(4) {
				case 0:
					ring[i] = rng.Uint32N(3)
				case 1:
					ring[i] = ^uint32(0) - rng.Uint32N(2)
				}
			}
			if trial%10 == 0 {
				clear(ring)
			}
			head := rng.Int64N(1<<40) - 1<<20 // heads before the epoch too
			e := entry{head: head}
			used, oldest := e.scan(ring)
			wantUsed, wantOldest := walkScan(head, ring)
			if used != wantUsed || oldest != wantOldest {
				t.Fatalf("n %d, head %d, ring %v: scan = %d, %d; the walk gives %d, %d", n, head, ring, used, oldest, wantUsed, wantOldest)
			}
		}
	}
}

// BenchmarkScan is scan on a ring of the default precision: full (steady
// traffic: the oldest slot holds a count) and holding the newest slot only
// (a burst: the search walks the whole ring).
func BenchmarkScan(b *testing.B) {
	for _, c := range []struct {
		name string
		fill func(ring []uint32, head int64)
	}{
		{"full", func(ring []uint32, _ int64) {
			for i := range ring {
				ring[i] = uint32(i + 1)
			}
		}},
		{"newest", func(ring []uint32, head int64) { ring[slotIndex(head, int64(len(ring)))] = 7 }},
	} {
		b.Run(c.name, func(b *testing.B) {
			ring := make([]uint32, DefaultPrecision)
			e := entry{head: 1234567}
			c.fill(ring, e.head)
			var sink int64
			for b.Loop() {
				used, oldest := e.scan(ring)
				sink += used + oldest
			}
			_ = sink
		})
	}
}
