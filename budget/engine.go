package budget

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

const (
	// settleAttempts and settleBackoff bound the retries of a settle; a retry
	// is safe because the reservation's marker makes a settle apply once.
	settleAttempts = 3
	settleBackoff  = 25 * time.Millisecond
	// markerTTL only has to outlive the retries of one settle.
	markerTTL = 10 * time.Minute
)

// Engine reserves and settles budgets against a Store. It is safe for
// concurrent use and holds no per-config state: budgets come with each call.
type Engine struct {
	store  Store
	prefix string
	now    func() time.Time
}

// NewEngine returns an engine keeping its counters in store under prefix.
func NewEngine(store Store, prefix string) *Engine {
	return &Engine{store: store, prefix: prefix, now: time.Now}
}

// Dims are the values a request is budgeted by. Principal and Team are raw
// (they may be API keys); they are hashed before they reach a store key.
type Dims struct {
	Principal string
	Team      string
	Model     string
}

func (d *Dims) value(s Scope) string {
	switch s {
	case PerKey:
		return d.Principal
	case PerTeam:
		return d.Team
	case PerModel:
		return d.Model
	}
	return ""
}

// Hold is one budget's part of a reservation.
type Hold struct {
	Budget    *Budget
	Key       string
	Amount    int64 // reserved, in the budget's unit
	Used      int64 // the counter right after the reservation
	WindowEnd time.Time
}

// Reservation is an admitted request's claim on its budgets, to be settled.
type Reservation struct {
	ID    string
	Holds []Hold
}

// Denial says which budget refused a request.
type Denial struct {
	Budget *Budget
	// Amount is what the request would have charged it; Used what it holds.
	Amount, Used int64
	WindowEnd    time.Time
	// Holds has every budget's standing, for response headers.
	Holds []Hold
}

// Reserve charges estimate to every budget in one atomic step. It returns a
// Reservation when all admit, a Denial naming the first budget that does not,
// or an error when the store fails (nothing is charged then either).
func (e *Engine) Reserve(ctx context.Context, budgets []Budget, dims Dims, estimate Spend) (*Reservation, *Denial, error) {
	now := e.now()
	holds := make([]Hold, len(budgets))
	charges := make([]Charge, len(budgets))
	for i := range budgets {
		b := &budgets[i]
		holds[i] = Hold{Budget: b, Key: e.counterKey(b, &dims, now), Amount: max(b.Amount(estimate), 0), WindowEnd: b.WindowEnd(now)}
		charges[i] = Charge{Key: holds[i].Key, Amount: holds[i].Amount, Limit: b.Limit, TTL: 2 * b.Window}
	}
	res, err := e.store.Reserve(ctx, charges)
	if err != nil {
		return nil, nil, err
	}
	for i := range holds {
		holds[i].Used = res.Used[i]
	}
	if !res.Admitted {
		h := holds[res.Denied]
		return nil, &Denial{Budget: h.Budget, Amount: h.Amount, Used: h.Used, WindowEnd: h.WindowEnd, Holds: holds}, nil
	}
	return &Reservation{ID: newReservationID(), Holds: holds}, nil, nil
}

// ErrDrift wraps a settle that failed after every retry: the counters keep the
// reservation instead of the actual usage.
var ErrDrift = errors.New("budget settle failed; counters drifted by the unsettled difference")

// Settle moves each budget from the reserved amount to what actual costs in
// its unit, flooring counters at 0. It applies once per reservation however
// often it is called, retries a failing store, and reports a final failure
// wrapping ErrDrift.
func (e *Engine) Settle(ctx context.Context, r *Reservation, actual Spend) error {
	adjs := make([]Adjustment, 0, len(r.Holds))
	for _, h := range r.Holds {
		delta := max(h.Budget.Amount(actual), 0) - h.Amount
		if delta != 0 {
			adjs = append(adjs, Adjustment{Key: h.Key, Delta: delta, TTL: 2 * h.Budget.Window})
		}
	}
	if len(adjs) == 0 {
		return nil
	}
	marker := e.prefix + ":bg:{b}:settled:" + r.ID
	var err error
	for attempt := 0; attempt < settleAttempts; attempt++ {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return fmt.Errorf("%w: %w", ErrDrift, ctx.Err())
			case <-time.After(settleBackoff << (attempt - 1)):
			}
		}
		if _, err = e.store.Settle(ctx, marker, markerTTL, adjs); err == nil {
			return nil
		}
	}
	return fmt.Errorf("%w: %w", ErrDrift, err)
}

// Release returns a reservation in full, as when nothing was used.
func (e *Engine) Release(ctx context.Context, r *Reservation) error {
	return e.Settle(ctx, r, Spend{})
}

// Used reads the counters of budgets for dims in the current window.
func (e *Engine) Used(ctx context.Context, budgets []Budget, dims Dims) ([]int64, error) {
	now := e.now()
	keys := make([]string, len(budgets))
	for i := range budgets {
		keys[i] = e.counterKey(&budgets[i], &dims, now)
	}
	return e.store.Get(ctx, keys)
}

// counterKey is <prefix>:bg:{b}:<budget>:<hash of scope value>:<window index>.
// Every budget key shares the {b} hash tag so one script can touch several on
// Redis Cluster.
func (e *Engine) counterKey(b *Budget, dims *Dims, now time.Time) string {
	scopeValue := "global"
	if b.Scope != Global {
		scopeValue = b.Scope.String() + "-" + keyhash.Of(dims.value(b.Scope)).String()
	}
	return e.prefix + ":bg:{b}:" + b.Name + ":" + scopeValue + ":" + strconv.FormatInt(b.WindowIndex(now), 10)
}

func newReservationID() string {
	return strconv.FormatUint(rand.Uint64(), 36) + strconv.FormatUint(rand.Uint64(), 36)
}
