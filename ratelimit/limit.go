package ratelimit

import (
	"fmt"
	"math"
	"time"

	"github.com/fleetguard/fleetguard/window"
)

// DefaultPrecision is the number of slots per window when the config does not
// say. With 20 slots the count over-reads by at most 5% of the window, so a
// client sending evenly at 95% of the limit is never denied (bench/fleet
// measures it); each slot costs 4 bytes per tracked key.
const DefaultPrecision = 20

// MaxPrecision bounds the slots per window, and so the memory of a key.
const MaxPrecision = 100

// maxEvents keeps every slot count within a uint32.
const maxEvents = math.MaxUint32

// Limit is the policy of one zone: at most Events requests of a key in any
// interval of length Window across the fleet, and a local burst of at most
// Burst requests at once on each instance.
type Limit struct {
	Events    int64
	Window    time.Duration
	Burst     int64
	Precision int

	slots     window.Slots
	emission  int64 // nanoseconds between two admits at the steady rate
	tolerance int64 // how far ahead of now the GCRA's theoretical arrival time may run
}

// NewLimit validates a policy and precomputes what the request path needs.
// A burst of 0 means "the same as events"; a precision of 0 means
// DefaultPrecision.
func NewLimit(events int64, w time.Duration, burst int64, precision int) (Limit, error) {
	switch {
	case events <= 0:
		return Limit{}, fmt.Errorf("events must be > 0, got %d", events)
	case events > maxEvents:
		return Limit{}, fmt.Errorf("events must be at most %d, got %d", int64(maxEvents), events)
	case w <= 0:
		return Limit{}, fmt.Errorf("window must be > 0, got %s", w)
	case burst < 0:
		return Limit{}, fmt.Errorf("burst must be >= 0, got %d", burst)
	case precision < 0 || precision > MaxPrecision:
		return Limit{}, fmt.Errorf("precision must be between 1 and %d, got %d", MaxPrecision, precision)
	}
	if burst == 0 {
		burst = events
	}
	if precision == 0 {
		precision = DefaultPrecision
	}
	slots, err := window.NewSlots(w, precision)
	if err != nil {
		return Limit{}, err
	}
	emission := int64(w) / events
	if emission <= 0 {
		return Limit{}, fmt.Errorf("events (%d) per window (%s) is finer than one nanosecond", events, w)
	}
	return Limit{
		Events:    events,
		Window:    w,
		Burst:     burst,
		Precision: precision,
		slots:     slots,
		emission:  emission,
		tolerance: emission * burst,
	}, nil
}

// Slots is how the limit cuts its window.
func (l *Limit) Slots() window.Slots { return l.slots }
