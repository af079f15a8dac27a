package window

import (
	"math/rand/v2"
	"sort"
	"testing"
	"time"
)

func TestNewSlots(t *testing.T) {
	tests := []struct {
		w       time.Duration
		n       int
		wantLen int64
		wantErr bool
	}{
		{10 * time.Second, 20, int64(500 * time.Millisecond), false},
		{10 * time.Second, 3, 3333333334, false}, // rounded up: 3 slots cover the window
		{time.Second, 1, int64(time.Second), false},
		{0, 20, 0, true},
		{time.Second, 0, 0, true},
		{5, 10, 0, true},
	}
	for _, tt := range tests {
		s, err := NewSlots(tt.w, tt.n)
		if (err != nil) != tt.wantErr {
			t.Fatalf("NewSlots(%s, %d): err %v, want error %v", tt.w, tt.n, err, tt.wantErr)
		}
		if err == nil && (s.Len != tt.wantLen || s.N*s.Len < int64(tt.w)) {
			t.Fatalf("NewSlots(%s, %d) = %+v, want Len %d covering the window", tt.w, tt.n, s, tt.wantLen)
		}
	}
}

func TestSlotBoundaries(t *testing.T) {
	s, _ := NewSlots(10*time.Second, 20)
	q := s.Len
	tests := []struct {
		now          int64
		slot, oldest int64
	}{
		{0, 0, -20},
		{q - 1, 0, -20},
		{q, 1, -19},
		{21 * q, 21, 1},
	}
	for _, tt := range tests {
		if got := s.Of(tt.now); got != tt.slot {
			t.Errorf("Of(%d) = %d, want %d", tt.now, got, tt.slot)
		}
		if got := s.Oldest(tt.now); got != tt.oldest {
			t.Errorf("Oldest(%d) = %d, want %d", tt.now, got, tt.oldest)
		}
	}
	// Slot 0 counts through slot 20 and stops at the start of slot 21.
	if got := s.LeavesAt(0); got != 21*q {
		t.Fatalf("LeavesAt(0) = %d, want %d", got, 21*q)
	}
	if s.Oldest(s.LeavesAt(0)-1) != 0 || s.Oldest(s.LeavesAt(0)) != 1 {
		t.Fatal("LeavesAt disagrees with Oldest")
	}
}

// The slotted count at t always covers every event of the exact window
// (t-w, t]: gating on it can never admit more than the limit in any window.
func TestSlottedCountNeverUnderCounts(t *testing.T) {
	const w = 10 * time.Second
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{1, 3, 7, 20, 60} {
		s, _ := NewSlots(w, n)
		var events []int64
		for i := 0; i < 2000; i++ {
			events = append(events, int64(rng.Int64N(int64(60*time.Second))))
		}
		sort.Slice(events, func(i, j int) bool { return events[i] < events[j] })
		for i := 0; i < 500; i++ {
			now := rng.Int64N(int64(70 * time.Second))
			exact, slotted := 0, 0
			for _, ev := range events {
				if ev > now {
					break
				}
				if ev > now-int64(w) {
					exact++
				}
				if s.Of(ev) >= s.Oldest(now) {
					slotted++
				}
			}
			if slotted < exact {
				t.Fatalf("n=%d now=%d: slotted count %d under the exact %d", n, now, slotted, exact)
			}
		}
	}
}

func TestMostInAny(t *testing.T) {
	s := int64(time.Second)
	tests := []struct {
		ts   []int64
		want int
	}{
		{nil, 0},
		{[]int64{0}, 1},
		{[]int64{0, s - 1, s, 2 * s}, 2}, // [0, 1s) holds two; 1s is outside
		{[]int64{0, s / 2, s - 1, s + s/2, s + s/2}, 3}, // 0.5s and 1.5s are a whole second apart: three at most
	}
	for _, tt := range tests {
		if got := MostInAny(tt.ts, time.Second); got != tt.want {
			t.Errorf("MostInAny(%v) = %d, want %d", tt.ts, got, tt.want)
		}
	}
}
