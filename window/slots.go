package window

import (
	"fmt"
	"time"
)

// Slots cuts a sliding window into N slots of equal length, numbered from the
// Unix epoch so that every instance agrees on them.
//
// The count of a sliding window at time t is the sum of the N+1 slots
// Of(t)-N … Of(t): the oldest slot counts whole until it has entirely left
// the window. That over-counts by at most one slot and never under-counts, so
// a limiter gating on it never admits more than its limit in any interval of
// the window's length; in exchange a request becomes admissible up to one
// slot later than under an exact log.
type Slots struct {
	// Len is the length of one slot in nanoseconds: the window divided by N,
	// rounded up so that N slots always cover the whole window.
	Len int64
	// N is the number of slots per window (the precision).
	N int64
}

// NewSlots cuts the window w into n slots.
func NewSlots(w time.Duration, n int) (Slots, error) {
	if w <= 0 {
		return Slots{}, fmt.Errorf("window must be > 0, got %s", w)
	}
	if n <= 0 {
		return Slots{}, fmt.Errorf("precision must be > 0, got %d", n)
	}
	if int64(w) < int64(n) {
		return Slots{}, fmt.Errorf("precision %d cuts the window %s into slots shorter than a nanosecond", n, w)
	}
	return Slots{Len: (int64(w) + int64(n) - 1) / int64(n), N: int64(n)}, nil
}

// Of returns the slot that contains now (Unix nanoseconds); times before 1970
// map to slot 0.
func (s Slots) Of(now int64) int64 {
	if now <= 0 {
		return 0
	}
	return now / s.Len
}

// Oldest returns the oldest slot that still counts at now.
func (s Slots) Oldest(now int64) int64 { return s.Of(now) - s.N }

// LeavesAt returns when slot stops counting (Unix nanoseconds): the start of
// the slot N+1 after it.
func (s Slots) LeavesAt(slot int64) int64 { return (slot + s.N + 1) * s.Len }

// MostInAny returns the most timestamps of ts (Unix ns, sorted ascending)
// that fall in any interval of length w: the worst sliding window of an exact
// log, which is what a limit is judged by.
func MostInAny(ts []int64, w time.Duration) int {
	most, lo := 0, 0
	for hi := range ts {
		for ts[hi]-ts[lo] >= int64(w) {
			lo++
		}
		most = max(most, hi-lo+1)
	}
	return most
}
