package ratelimit

import (
	"fmt"
	"time"
)

// Limit is the policy of one zone: Events per Window across the fleet, and a
// local burst of at most Burst requests at once on each instance.
type Limit struct {
	Events int64
	Window time.Duration
	Burst  int64

	// derived by NewLimit
	emission  int64 // nanoseconds between two admits at the steady rate
	tolerance int64 // how far ahead of now the GCRA's theoretical arrival time may run
}

// NewLimit validates a policy and precomputes what the request path needs.
// A burst of 0 means "the same as events".
func NewLimit(events int64, window time.Duration, burst int64) (Limit, error) {
	if events <= 0 {
		return Limit{}, fmt.Errorf("events must be > 0, got %d", events)
	}
	if window <= 0 {
		return Limit{}, fmt.Errorf("window must be > 0, got %s", window)
	}
	if burst < 0 {
		return Limit{}, fmt.Errorf("burst must be >= 0, got %d", burst)
	}
	if burst == 0 {
		burst = events
	}
	emission := int64(window) / events
	if emission <= 0 {
		return Limit{}, fmt.Errorf("events (%d) per window (%s) is finer than one nanosecond", events, window)
	}
	return Limit{
		Events:    events,
		Window:    window,
		Burst:     burst,
		emission:  emission,
		tolerance: emission * burst,
	}, nil
}
