// Package window holds the pure time arithmetic of fixed and slotted windows.
//
// Every instance of a fleet must agree on where a window or a slot starts, so
// both are aligned to the Unix epoch: fixed window number n covers
// [n*w, (n+1)*w). Times are Unix nanoseconds so the request path never builds
// a time.Time it does not need.
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

// Remaining returns the time left until the fixed window containing now ends.
func Remaining(now int64, w time.Duration) time.Duration {
	if w <= 0 {
		return 0
	}
	if now <= 0 {
		return w
	}
	return w - time.Duration(now%int64(w))
}
