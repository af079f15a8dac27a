package fleetguard

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fleetguard/fleetguard/budget"
)

// A request refused because streams in flight hold the room, not because it
// was spent, fits once they settle: a stream holds up to its text's strict
// bound (a token a byte, about 4 times what English costs) until then. So a
// refusal of a request that fits the budget's limit waits, up to
// SettleWait, for the settles of this instance's requests in flight and
// tries again after each (and every retryTick, for other instances').

// DefaultSettleWait is SettleWait's default.
const DefaultSettleWait = 2 * time.Second

// settleRetryTick is how often a waiting request tries again without a
// settle of its own instance.
const settleRetryTick = 100 * time.Millisecond

// inFlight counts a store's reservations not yet settled and tells those
// waiting for room when one settles.
type inFlight struct {
	n       atomic.Int64
	mu      sync.Mutex
	settled chan struct{} // closed, and replaced, at each settle
}

func (f *inFlight) reserved() { f.n.Add(1) }

// done is called once a reservation's settle has run.
func (f *inFlight) done() {
	f.n.Add(-1)
	f.mu.Lock()
	if f.settled != nil {
		close(f.settled)
		f.settled = nil
	}
	f.mu.Unlock()
}

// next is closed at the next settle.
func (f *inFlight) next() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.settled == nil {
		f.settled = make(chan struct{})
	}
	return f.settled
}

// waitForRoom retries a denied reserve after settles until it is admitted,
// a settle here can no longer lift the denial (the request is larger than
// the limit, or nothing is in flight on this instance), the store fails, or
// SettleWait passes. It returns the last outcome. (Requests in flight on
// other instances are not seen: without any here, a refusal is answered at
// once.)
func (h *LLMBudget) waitForRoom(r *http.Request, c *call, denial *budget.Denial) (*budget.Reservation, *budget.Denial, error) {
	if h.settleWait <= 0 || h.Shadow || denial.Amount > denial.Limit || h.store.inFlight.n.Load() == 0 {
		return nil, denial, nil
	}
	deadline := time.NewTimer(h.settleWait)
	defer deadline.Stop()
	tick := time.NewTicker(settleRetryTick)
	defer tick.Stop()
	metrics.llmSettleWaits.Inc()
	for {
		select {
		case <-h.store.inFlight.next():
		case <-tick.C:
		case <-deadline.C:
			return nil, denial, nil
		case <-r.Context().Done():
			return nil, denial, nil
		}
		ctx, cancel := context.WithTimeout(r.Context(), h.storeTimeout)
		res, d, err := h.store.budgets.Reserve(ctx, h.budgets, c.dims, c.spend)
		cancel()
		if d == nil || err != nil {
			return res, nil, err
		}
		if denial = d; h.store.inFlight.n.Load() == 0 {
			return nil, denial, nil // nothing here left to settle
		}
	}
}
