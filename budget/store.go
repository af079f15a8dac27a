package budget

import (
	"context"
	"time"
)

// Charge is one budget's part of a reservation.
type Charge struct {
	Key    string
	Amount int64
	Limit  int64
	TTL    time.Duration
}

// ReserveResult is the answer of Store.Reserve.
type ReserveResult struct {
	Admitted bool
	// Denied is the index of the first charge that did not fit; -1 when admitted.
	Denied int
	// Used is each counter after the reservation, or as it stands when denied.
	Used []int64
}

// Adjustment moves one counter by Delta (floored at 0) and re-arms its TTL.
type Adjustment struct {
	Key   string
	Delta int64
	TTL   time.Duration
}

// Store keeps budget counters. Implementations must make Reserve all or
// nothing and Settle at most once per marker.
type Store interface {
	// Reserve adds every charge if each counter stays within its limit, and
	// adds none otherwise, in one atomic step.
	Reserve(ctx context.Context, charges []Charge) (ReserveResult, error)
	// Settle applies every adjustment in one atomic step unless marker was
	// already used; applied is false for such a repeat.
	Settle(ctx context.Context, marker string, markerTTL time.Duration, adjs []Adjustment) (applied bool, err error)
	// Get reads counters; a missing one reads 0.
	Get(ctx context.Context, keys []string) ([]int64, error)
}
