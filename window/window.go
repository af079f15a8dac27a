// Package window holds the pure time arithmetic of fixed and sliding windows.
//
// Every instance of a fleet must agree on where a window starts, so windows are
// aligned to the Unix epoch: window number n covers [n*w, (n+1)*w). Times are
// Unix nanoseconds so the request path never builds a time.Time it does not need.
package window

import "time"

// Epoch returns the index of the fixed window of length w that contains now
// (Unix nanoseconds). Times before 1970 map to epoch 0.
func Epoch(now int64, w time.Duration) int64 {
	if w <= 0 || now <= 0 {
		return 0
	}
	return now / int64(w)
}

// Elapsed returns how far now is into its fixed window of length w.
func Elapsed(now int64, w time.Duration) time.Duration {
	if w <= 0 || now <= 0 {
		return 0
	}
	return time.Duration(now % int64(w))
}

// Remaining returns the time left until the fixed window containing now ends.
func Remaining(now int64, w time.Duration) time.Duration {
	if w <= 0 {
		return 0
	}
	return w - Elapsed(now, w)
}

// SlidingEstimate approximates the events in the sliding window of length w
// that ends now, from the count of the current fixed window and of the one
// before it. The previous window is weighted by the part of it that still
// overlaps the sliding window, assuming its events were spread evenly.
func SlidingEstimate(current, previous int64, elapsed, w time.Duration) float64 {
	if w <= 0 {
		return float64(current)
	}
	if elapsed < 0 {
		elapsed = 0
	}
	if elapsed > w {
		elapsed = w
	}
	overlap := 1 - float64(elapsed)/float64(w)
	return float64(current) + float64(previous)*overlap
}
