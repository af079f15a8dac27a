package budget

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/safego"
)

const (
	// settleAttempts and settleBackoff bound the retries of a settle; a retry
	// is safe because the reservation's record makes a settle apply once.
	settleAttempts = 3
	settleBackoff  = 25 * time.Millisecond
	// recordTTL is how long a reservation can wait for its settle (a long
	// stream); a settle after it keeps the whole reservation, never frees it.
	recordTTL = 2 * time.Hour
	// settledTTL keeps a tombstone long enough for every retry, and for a
	// reserve stalled on a server to arrive and be cancelled.
	settledTTL = 10 * time.Minute
	// resolveAttempts and resolveBackoff bound the background release of a
	// reserve whose outcome is unknown (about half a minute in all).
	resolveAttempts = 8
	resolveBackoff  = 100 * time.Millisecond
	// probeEvery is the breaker's probe period while the store is down.
	probeEvery = 250 * time.Millisecond
	// probeTimeout is the longest a probe waits for its answer: a store that
	// answers a PING within it is not down, only slow. It is long because
	// the PING waits its turn in the client's pool: in a burst of hundreds
	// of reserves on a busy machine a shorter one failed while the store
	// answered every call, and turned the rest of the burst away.
	probeTimeout = time.Second
)

// ErrStoreDown is returned by Reserve, at once, while the store is known to
// be down: a store call failed and a probe then failed too. The probe goes
// on, and closes the breaker when the store answers again.
var ErrStoreDown = errors.New("budget store is down")

// Engine reserves and settles budgets against a Store. It is safe for
// concurrent use and holds no per-config state: budgets come with each call.
type Engine struct {
	store  Store
	prefix string
	now    func() time.Time

	// down is the circuit breaker: set by a probe that failed after a store
	// call failed, cleared by the probe when the store answers.
	down    atomic.Bool
	probing atomic.Bool
	// storeErrors counts the store calls that failed (see StoreErrors).
	storeErrors atomic.Uint64
	// OnResolve, when set, is told how each background resolution ended. For
	// a reserve whose outcome was unknown (kind "reserve"): released (it had
	// run), cancelled (it had not; a late arrival charges nothing) or failed.
	// For a settle that failed (kind "settle"): applied (now), applied_before
	// (the failed attempt had applied after all) or failed (drift remains).
	// r is the reservation resolved.
	OnResolve func(r *Reservation, kind, outcome string)
	// OnPanic, when set, is told of a panic in a background resolution or
	// probe, which is stopped there instead of ending the process.
	OnPanic safego.Report
	// The instance's word (lapse.go): its owner name, its open
	// reservations, and the loop that says it is alive and writes grants.
	owner     string
	openMu    sync.Mutex
	open      map[*Reservation]struct{}
	speakOnce sync.Once
	// Lapse is how long an instance may be silent before the fleet settles
	// its open reservations (default DefaultLapse); set before first use.
	Lapse time.Duration
	// OnSweep, when set, is told how many reservations of silent
	// instances a sweep settled (only when some were).
	OnSweep func(settled int)
	// background tracks resolves and probes, so Close can wait for them.
	background sync.WaitGroup
	closed     chan struct{}
	closeOnce  sync.Once
}

// NewEngine returns an engine keeping its counters in store under prefix.
func NewEngine(store Store, prefix string) *Engine {
	return &Engine{store: store, prefix: prefix, now: time.Now, closed: make(chan struct{}),
		owner: newReservationID(), open: make(map[*Reservation]struct{}), Lapse: DefaultLapse}
}

// Down reports whether the breaker is open: a store call failed, a probe
// then failed too, and the store has not answered since.
func (e *Engine) Down() bool { return e.down.Load() }

// StoreErrors counts, since the engine was built, the store calls that
// failed: reserves, each settle attempt and background release attempt,
// reads and resets. The breaker's probes are not counted, and neither are
// the reserves the open breaker answers without asking the store, nor the
// instance's word and sweeps (lapse.go), which are not a request's.
func (e *Engine) StoreErrors() uint64 { return e.storeErrors.Load() }

// failed counts a failed store call and returns its error.
func (e *Engine) failed(err error) error {
	if err != nil {
		e.storeErrors.Add(1)
	}
	return err
}

// Close stops the probe and waits, at most timeout, for the background
// releases still running.
func (e *Engine) Close(timeout time.Duration) {
	e.closeOnce.Do(func() { close(e.closed) })
	done := make(chan struct{})
	go func() { e.background.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(timeout):
	}
}

// Dims are the values a request is budgeted by. Principal and Team are raw
// (they may be API keys); they are hashed before they reach a store key.
type Dims struct {
	Principal string
	Team      string
	Model     string
}

// Value is the value of d a budget of scope s is kept by ("" for global).
func (d *Dims) Value(s Scope) string {
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
	Budget *Budget
	Key    string
	Amount int64 // reserved, in the budget's unit
	Used   int64 // the counter right after the reservation
	// Limit is the limit in force for the hold's scope value when it was
	// reserved: a limit set at run time, a Fixed one, or the budget's.
	Limit     int64
	WindowEnd time.Time
	// overridden: Limit is the scope value's own (set at run time or
	// Fixed), which extensions keep; else they follow the budget's limit
	// in force, which a reload may change.
	overridden bool
	// scopeID names the hold's scope value in store keys; top and alerted
	// are its window's top set ("" for a global budget) and marks of
	// alerts ("" without AlertAt).
	scopeID, top, alerted string
}

// Reservation is an admitted request's claim on its budgets, to be settled.
type Reservation struct {
	ID    string
	Holds []Hold
	// overLimit: reserved by ReserveOverLimit, so it extends without limits.
	overLimit bool
	// extended is the number of the last extension applied; extensions are
	// made one at a time.
	extended int
	// settle is what this engine knows of the reservation's settle: a
	// settle that found no record is only lost if none was applied or left
	// unsure before it.
	settle atomic.Uint32
	// crossings are the alerts its settle reached first (see Crossings).
	crossings []Crossing
	// grants is what its stream was granted (lapse.go).
	grants grants
}

// What an engine knows of a reservation's settle.
const (
	settleNone    = iota
	settleApplied // a settle applied it
	settleUnsure  // a settle attempt failed: it may have applied
)

// Denial says which budget refused a request.
type Denial struct {
	Budget *Budget
	// Amount is what the request would have charged it; Used what it
	// holds; Limit its limit in force for the request's scope value.
	Amount, Used, Limit int64
	WindowEnd           time.Time
	// Holds has every budget's standing, for response headers.
	Holds []Hold
}

// Reserve charges estimate to every budget in one atomic step. It returns a
// Reservation when all admit, a Denial naming the first budget that does not,
// or an error when the store fails. The reservation's id exists before the
// store is asked, so a reserve whose reply is lost (a timeout, a reset) is
// released by id in the background: whether or not it ran, and even if it
// runs later, it charges nothing in the end. While the store is known to be
// down, Reserve fails at once with ErrStoreDown.
func (e *Engine) Reserve(ctx context.Context, budgets []Budget, dims Dims, estimate Spend) (*Reservation, *Denial, error) {
	return e.reserve(ctx, budgets, dims, estimate, true)
}

// ReserveOverLimit is Reserve without the limits: it always admits, so a
// budget in shadow mode still records what a request it would have denied
// uses. The reservation settles like any other.
func (e *Engine) ReserveOverLimit(ctx context.Context, budgets []Budget, dims Dims, estimate Spend) (*Reservation, error) {
	r, _, err := e.reserve(ctx, budgets, dims, estimate, false)
	return r, err
}

func (e *Engine) reserve(ctx context.Context, budgets []Budget, dims Dims, estimate Spend, enforce bool) (*Reservation, *Denial, error) {
	if e.down.Load() {
		return nil, nil, ErrStoreDown
	}
	now := e.now()
	r := &Reservation{ID: newReservationID(), Holds: make([]Hold, len(budgets)), overLimit: !enforce}
	charges := make([]Charge, len(budgets))
	for i := range budgets {
		b := &budgets[i]
		scopeID := ScopeID(b, dims)
		r.Holds[i] = Hold{Budget: b, Key: e.scopedKey(b, scopeID, now), Amount: max(b.Amount(estimate), 0), WindowEnd: b.WindowEnd(now)}
		e.nameWindowKeys(&r.Holds[i], scopeID, now)
		charges[i] = e.chargeOf(r, &r.Holds[i], scopeID)
	}
	res, err := e.store.Reserve(ctx, e.record(r), recordTTL, charges)
	if e.failed(err) != nil {
		e.suspect()
		e.resolve(r, releaseOf(r), "reserve", "released", "cancelled")
		return nil, nil, err
	}
	if res.Cancelled {
		// Only a reserve racing its own release sees this; ids are random.
		return nil, nil, errors.New("budget reserve: the reservation was released before it ran")
	}
	for i := range r.Holds {
		h := &r.Holds[i]
		h.Used = res.Used[i]
		if i < len(res.Limits) && res.Limits[i] != charges[i].Limit {
			h.Limit, h.overridden = res.Limits[i], true
		}
	}
	if !res.Admitted {
		return nil, r.denial(res.Denied, r.Holds[res.Denied].Amount), nil
	}
	e.opened(r)
	return r, nil, nil
}

// chargeOf is h's charge in r's reserve: within the limit the config gives
// its scope value, unless the override table holds one (read by the
// store's reserve, in the same step). A reservation over the limits (shadow
// mode) has none, and a global budget no scope value to override.
func (e *Engine) chargeOf(r *Reservation, h *Hold, scopeID string) Charge {
	c := Charge{Key: h.Key, Amount: h.Amount, TTL: h.Budget.KeyTTL()}
	h.Limit, h.overridden = h.Budget.configuredLimit(scopeID)
	c.Limit = h.Limit
	switch {
	case r.overLimit:
		// Shadow mode's hold shows the limit it would have had.
		c.Limit = math.MaxInt64
	case h.Budget.Scope != Global:
		c.Overrides, c.Override = e.overridesKey(), overrideField(h.Budget, scopeID)
	}
	return c
}

// limitOf is the limit a charge of r to b must fit: none for a reservation
// over the limits (shadow mode).
func (r *Reservation) limitOf(b *Budget) int64 {
	if r.overLimit {
		return math.MaxInt64
	}
	return b.LimitNow()
}

// extendLimit is the limit an extension of h must fit: the scope value's
// own limit found by the reserve, else the budget's limit in force now.
func (r *Reservation) extendLimit(h *Hold) int64 {
	if h.overridden && !r.overLimit {
		return h.Limit
	}
	return r.limitOf(h.Budget)
}

// denial says that r's i-th budget could not take amount more.
func (r *Reservation) denial(i int, amount int64) *Denial {
	h := r.Holds[i]
	return &Denial{Budget: h.Budget, Amount: amount, Used: h.Used, Limit: h.Limit, WindowEnd: h.WindowEnd, Holds: r.Holds}
}

// extendAttempts bounds the tries of one extension: a retry is safe, the
// store applies an extension once.
const extendAttempts = 2

// Extend adds more to a reservation in every budget in one atomic step, when
// each still fits its limit: an output lease growing with a streamed
// response. It returns a Denial naming the first budget that does not fit
// (or the reservation's first budget when the store holds the reservation no
// more), or an error when the store fails, after which the outcome is
// unknown: the settle moves the counters from what the store holds, so
// either way nothing is charged twice. Extensions of one reservation are
// made one at a time; an extension that failed may be made again, with the
// same more, and applies once. Extend asks the store even while the breaker
// is open: a stream that holds its reservation waits for its own
// extension only (the breaker spares new requests the wait), and its
// answer is evidence for the probe.
func (e *Engine) Extend(ctx context.Context, r *Reservation, more Spend) (*Denial, error) {
	seq := r.extended + 1
	charges := make([]Charge, len(r.Holds))
	for i := range r.Holds {
		h := &r.Holds[i]
		charges[i] = Charge{Key: h.Key, Amount: max(h.Budget.Amount(more), 0), Limit: r.extendLimit(h), TTL: h.Budget.KeyTTL()}
	}
	var res ExtendResult
	var err error
	for attempt := 0; attempt < extendAttempts; attempt++ {
		res, err = e.store.Extend(ctx, e.recordKey(r), seq, charges)
		if e.failed(err) == nil || ctx.Err() != nil {
			break
		}
	}
	if err != nil {
		e.suspect()
		return nil, err
	}
	if res.Gone {
		return r.denial(0, charges[0].Amount), nil
	}
	for i := range r.Holds {
		r.Holds[i].Used = res.Used[i]
	}
	if !res.Admitted {
		return r.denial(res.Denied, charges[res.Denied].Amount), nil
	}
	r.extended = seq
	for i := range r.Holds {
		r.Holds[i].Amount += charges[i].Amount
	}
	return nil, nil
}

// resolve applies adjs to a reservation in the background, idempotently,
// after a reserve or settle whose outcome is unknown. For a reserve, adjs is
// its release: if the reserve ran, its charge is returned; if it has not run
// yet, the tombstone the release leaves cancels it. The outcome is applied
// or notApplied (the record was not in the reserved state), or "failed".
func (e *Engine) resolve(r *Reservation, adjs []Adjustment, kind, applied, notApplied string) {
	e.background.Add(1)
	go func() {
		defer e.background.Done()
		defer safego.Recover("budget resolve", e.OnPanic)
		outcome := "failed"
		for attempt := 0; attempt < resolveAttempts; attempt++ {
			closing := false
			select {
			case <-time.After(resolveBackoff << min(attempt, 4)):
			case <-e.closed:
				closing = true // one last try on the way out
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			ok, err := e.store.Settle(ctx, e.record(r), settledTTL, adjs)
			cancel()
			if e.failed(err) == nil {
				outcome = notApplied
				if ok {
					outcome = applied
				}
				break
			}
			if closing {
				break
			}
		}
		if kind == "settle" {
			e.settled(r)
		}
		if e.OnResolve != nil {
			e.OnResolve(r, kind, outcome)
		}
	}()
}

// suspect starts a probe after a store call failed, unless one runs: the
// breaker opens only if the probe fails too (no answer within probeTimeout),
// so one timeout (a short stall, a busy machine, one call's bad luck) does
// not turn every other request and stream away, and many calls failing
// together in one stall are one piece of evidence, not many. Once open, the
// probe tries again every probeEvery and closes the breaker when the store
// answers.
func (e *Engine) suspect() {
	if !e.probing.CompareAndSwap(false, true) {
		return
	}
	e.background.Add(1)
	go func() {
		defer e.background.Done()
		defer e.probing.Store(false)
		defer safego.Recover("budget probe", e.OnPanic)
		for {
			ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
			err := e.store.Ping(ctx)
			cancel()
			if err == nil {
				e.down.Store(false)
				return
			}
			e.down.Store(true)
			select {
			case <-time.After(probeEvery):
			case <-e.closed:
				return
			}
		}
	}()
}

// releaseOf returns every counter of r to what it was before r. It marks
// no alert: it runs in the background, where a threshold it was first to
// reach would be marked and never reported.
func releaseOf(r *Reservation) []Adjustment {
	adjs := adjustments(r, func(*Hold) int64 { return 0 })
	for i := range adjs {
		adjs[i].Alerts, adjs[i].Alerted = nil, ""
	}
	return adjs
}

// adjustments names every counter of r in the reserve's order, each settled
// at amount(h), with its top set and its alerts.
func adjustments(r *Reservation, amount func(h *Hold) int64) []Adjustment {
	adjs := make([]Adjustment, len(r.Holds))
	for i := range r.Holds {
		h := &r.Holds[i]
		adjs[i] = Adjustment{Key: h.Key, Amount: amount(h), TTL: h.Budget.KeyTTL()}
		if h.top != "" {
			adjs[i].Top, adjs[i].Member = h.top, h.scopeID
		}
		if h.alerted != "" {
			adjs[i].Alerted, adjs[i].Alerts = h.alerted, make([]Alert, len(h.Budget.AlertAt))
			for j, pct := range h.Budget.AlertAt {
				// At pct% of the limit, rounded up: at 80% of 999, 800 reaches it.
				at := (h.Limit*int64(pct) + 99) / 100
				adjs[i].Alerts[j] = Alert{At: at, Field: h.scopeID + ":" + strconv.Itoa(pct)}
			}
		}
	}
	return adjs
}

// Crossing is a threshold of a budget's AlertAt that a settle was the first
// of the fleet to reach, for one scope value in one window.
type Crossing struct {
	Budget  *Budget
	ScopeID string
	Percent int
	// Used is the counter after the settle; Limit the limit in force when
	// the reservation was made.
	Used, Limit int64
	// WindowEnd is when the window it was reached in ends.
	WindowEnd time.Time
}

// Crossings are the thresholds r's settle was the first to reach.
func (r *Reservation) Crossings() []Crossing { return r.crossings }

// collectCrossings keeps, after an applied settle, the alerts adjs reached
// first. (A settle whose reply was lost and that applied after all marks
// its alerts without reporting them: the background resolution does not.)
func (r *Reservation) collectCrossings(adjs []Adjustment) {
	for i := range adjs {
		for _, j := range adjs[i].Crossed {
			h := &r.Holds[i]
			r.crossings = append(r.crossings, Crossing{Budget: h.Budget, ScopeID: h.scopeID, Percent: h.Budget.AlertAt[j], Used: adjs[i].After, Limit: h.Limit, WindowEnd: h.WindowEnd})
		}
	}
}

// ErrDrift wraps a settle that failed after every retry: the counters keep the
// reservation instead of the actual usage until the background resolution
// (see OnResolve) applies it, if the store returns in time.
var ErrDrift = errors.New("budget settle failed; counters drifted by the unsettled difference")

// ErrReservationLost is the error of a settle that found no reservation to
// apply to: its record expired (a response longer than recordTTL) or the
// store lost its data (a Redis restarted empty). Nothing was applied.
var ErrReservationLost = errors.New("budget settle: the reservation's record is gone; nothing was applied")

// Settle moves each budget from the reserved amount to what actual costs in
// its unit, flooring counters at 0. It applies once per reservation however
// often it is called, retries a failing store, and reports a final failure
// wrapping ErrDrift. An answer that finds no reservation is
// ErrReservationLost, unless a settle of r applied before or failed in a way
// that may have applied (then it is the repeat the record guards against).
func (e *Engine) Settle(ctx context.Context, r *Reservation, actual Spend) error {
	// The store moves each counter from what the record holds, so a settle
	// is right whatever extensions applied, even one whose reply was lost.
	return e.settle(ctx, r, adjustments(r, func(h *Hold) int64 { return max(h.Budget.Amount(actual), 0) }))
}

// Keep settles a reservation at what it holds (its reserve and every
// extension), in every budget: for a response whose usage is unknown, which
// the upstream still bills. It ends the reservation's record like any settle.
func (e *Engine) Keep(ctx context.Context, r *Reservation) error {
	return e.settle(ctx, r, adjustments(r, func(*Hold) int64 { return KeepHeld }))
}

func (e *Engine) settle(ctx context.Context, r *Reservation, adjs []Adjustment) error {
	var lastErr error
	for attempt := 0; attempt < settleAttempts; attempt++ {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return fmt.Errorf("%w: %w", ErrDrift, ctx.Err())
			case <-time.After(settleBackoff << (attempt - 1)):
			}
		}
		applied, err := e.store.Settle(ctx, e.record(r), settledTTL, adjs)
		if e.failed(err) != nil {
			r.settle.CompareAndSwap(settleNone, settleUnsure)
			lastErr = err
			continue
		}
		e.settled(r)
		if applied {
			r.settle.Store(settleApplied)
			r.collectCrossings(adjs)
		} else if r.settle.Load() == settleNone {
			return ErrReservationLost
		}
		return nil
	}
	e.suspect()
	e.resolve(r, adjs, "settle", "applied", "applied_before")
	return fmt.Errorf("%w: %w", ErrDrift, lastErr)
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
	used, err := e.store.Get(ctx, keys)
	return used, e.failed(err)
}

// Standing is one budget's counter for one scope value in one window.
type Standing struct {
	// Used is in the budget's unit: tokens, or micro-dollars for USD.
	Used int64
	// Start and End bound the fixed window: [Start, End).
	Start, End time.Time
}

// Standing reads b's counter for the scope value named by scopeID (see
// ScopeID) in the current window.
func (e *Engine) Standing(ctx context.Context, b *Budget, scopeID string) (Standing, error) {
	now := e.now()
	st := Standing{Start: b.WindowStart(now), End: b.WindowEnd(now)}
	used, err := e.store.Get(ctx, []string{e.scopedKey(b, scopeID, now)})
	if e.failed(err) != nil {
		return Standing{}, err
	}
	st.Used = used[0]
	return st, nil
}

// Reset zeroes b's counter for the scope value named by scopeID in the
// current window and returns that window. A reservation still in flight
// settles against the zeroed counter: its release, or a settle below its
// estimate, floors at 0; a settle above it adds the difference.
func (e *Engine) Reset(ctx context.Context, b *Budget, scopeID string) (Standing, error) {
	now := e.now()
	st := Standing{Start: b.WindowStart(now), End: b.WindowEnd(now)}
	if err := e.failed(e.store.Reset(ctx, []string{e.scopedKey(b, scopeID, now)})); err != nil {
		return Standing{}, err
	}
	return st, nil
}

// Where a scope value's limit in force comes from (see Engine.Limit).
const (
	LimitFromBudget = "budget" // the budget's own limit
	LimitFromConfig = "config" // the budget's Fixed limit of the value (limit_for)
	LimitFromAdmin  = "admin"  // set at run time, by SetLimit
)

// Limit is the limit in force for b's scope value scopeID (see ScopeID), and
// where it comes from: LimitFromAdmin, LimitFromConfig or LimitFromBudget.
func (e *Engine) Limit(ctx context.Context, b *Budget, scopeID string) (int64, string, error) {
	limit, fixed := b.configuredLimit(scopeID)
	from := map[bool]string{true: LimitFromConfig, false: LimitFromBudget}[fixed]
	if b.Scope == Global {
		return limit, from, nil
	}
	n, err := e.store.Override(ctx, e.overridesKey(), overrideField(b, scopeID))
	if e.failed(err) != nil {
		return 0, "", err
	}
	if n > 0 {
		return n, LimitFromAdmin, nil
	}
	return limit, from, nil
}

// SetLimit sets the limit of b's scope value scopeID in the store, for every
// instance's next reserve; a limit of 0 deletes it, so the config's limit
// holds again. A global budget has no scope value: its limit is the config's.
func (e *Engine) SetLimit(ctx context.Context, b *Budget, scopeID string, limit int64) error {
	if b.Scope == Global {
		return errors.New("a global budget's limit is the config's: it has no scope value to set one for")
	}
	return e.failed(e.store.SetOverride(ctx, e.overridesKey(), overrideField(b, scopeID), max(limit, 0)))
}

// overridesKey names the override table, <prefix>:bg:{b}:limits, a hash of
// limits set at run time without a TTL, in the budgets' hash tag so the
// reserve script reads it on the counters' Cluster slot.
func (e *Engine) overridesKey() string {
	return e.prefix + ":bg:{b}:limits"
}

// overrideField names b's scope value scopeID in the override table:
// <budget>:<scope id>, which carries a hash, never a raw value.
func overrideField(b *Budget, scopeID string) string {
	return b.Name + ":" + scopeID
}

// recordKey names the reservation's record: <prefix>:bg:{b}:res:<id>, in the
// budgets' hash tag so the scripts stay on one Cluster slot.
func (e *Engine) recordKey(r *Reservation) string {
	return e.prefix + ":bg:{b}:res:" + r.ID
}

// counterKey is <prefix>:bg:{b}:<budget>:<scope id>:<window index>.
// Every budget key shares the {b} hash tag so one script can touch several on
// Redis Cluster.
func (e *Engine) counterKey(b *Budget, dims *Dims, now time.Time) string {
	return e.scopedKey(b, ScopeID(b, *dims), now)
}

func (e *Engine) scopedKey(b *Budget, scopeID string, now time.Time) string {
	return e.prefix + ":bg:{b}:" + b.Name + ":" + scopeID + ":" + windowID(b, now)
}

// windowID names the window of b containing now in store keys.
func windowID(b *Budget, now time.Time) string {
	window := strconv.FormatInt(b.WindowIndex(now), 10)
	if b.Calendar != Fixed {
		window = b.Calendar.String()[:1] + window // d, w or m: apart from fixed windows' numbers
	}
	return window
}

// topKey names b's top set of the window containing now:
// <prefix>:bg:{b}:top:<budget>:<window>, in the counters' hash tag so the
// settle script writes it on their Cluster slot.
func (e *Engine) topKey(b *Budget, now time.Time) string {
	return e.prefix + ":bg:{b}:top:" + b.Name + ":" + windowID(b, now)
}

// nameWindowKeys names, in h, its scope value and the keys of its window
// that its settle writes besides the counter: the top set of a budget with
// scope values, <prefix>:bg:{b}:top:<budget>:<window>, and the marks of a
// budget's alerts, <prefix>:bg:{b}:alerted:<budget>:<window>.
func (e *Engine) nameWindowKeys(h *Hold, scopeID string, now time.Time) {
	h.scopeID = scopeID
	if h.Budget.Scope != Global {
		h.top = e.topKey(h.Budget, now)
	}
	if len(h.Budget.AlertAt) > 0 {
		h.alerted = e.prefix + ":bg:{b}:alerted:" + h.Budget.Name + ":" + windowID(h.Budget, now)
	}
}

// NoteDenied marks that b denied its scope value scopeID in the current
// window, and reports whether this was the fleet's first denial of it
// there: counting the firsts counts the values denied, once each.
func (e *Engine) NoteDenied(ctx context.Context, b *Budget, scopeID string) (bool, error) {
	now := e.now()
	key := e.prefix + ":bg:{b}:denied:" + b.Name + ":" + windowID(b, now)
	first, err := e.store.MarkOnce(ctx, key, scopeID, b.KeyTTL())
	return first, e.failed(err)
}

// Standings reads b's counters and limits in force for the scope values
// scopeIDs in the current window: its counters in one call, and the limit
// of each value a scope has (a global budget's is its own).
func (e *Engine) Standings(ctx context.Context, b *Budget, scopeIDs []string) (used, limits []int64, err error) {
	now := e.now()
	keys := make([]string, len(scopeIDs))
	for i, id := range scopeIDs {
		keys[i] = e.scopedKey(b, id, now)
	}
	if used, err = e.store.Get(ctx, keys); e.failed(err) != nil {
		return nil, nil, err
	}
	limits = make([]int64, len(scopeIDs))
	for i, id := range scopeIDs {
		if limits[i], _, err = e.Limit(ctx, b, id); err != nil {
			return nil, nil, err
		}
	}
	return used, limits, nil
}

// MaxTop is the most spenders Top lists.
const MaxTop = 100

// Top lists b's scope values that spent most in the current window, at most
// n (1 to MaxTop), largest first: each value's counter as its last settle
// left it (reservations still in flight are not in it), exact among the
// TopSize largest. Scope values are named by ScopeID. A global budget has
// one value and no list.
func (e *Engine) Top(ctx context.Context, b *Budget, n int) ([]TopEntry, Standing, error) {
	now := e.now()
	st := Standing{Start: b.WindowStart(now), End: b.WindowEnd(now)}
	if b.Scope == Global {
		return nil, st, errors.New("a global budget has one scope value: its window is GET of the budget")
	}
	if n < 1 || n > MaxTop {
		return nil, st, fmt.Errorf("n: %d is not within 1 and %d", n, MaxTop)
	}
	top, err := e.store.Top(ctx, e.topKey(b, now), n)
	return top, st, e.failed(err)
}

// ScopeID names, in store keys and logs, the scope value of b that dims fall
// in: "global", or the scope and the hash of the raw value, such as
// "key-<32 hex digits>" (see internal/keyhash). The raw value, which may be
// an API key, never appears.
func ScopeID(b *Budget, dims Dims) string {
	if b.Scope == Global {
		return "global"
	}
	return b.Scope.String() + "-" + keyhash.Of(dims.Value(b.Scope)).String()
}

// HashedScopeID is ScopeID for a scope value known only by its hash: digest
// is the 32 lowercase hex digits of keyhash.Of(value).String().
func HashedScopeID(s Scope, digest string) (string, error) {
	if s == Global {
		return "", errors.New("a global budget has no scope value")
	}
	if len(digest) != 32 || strings.Trim(digest, "0123456789abcdef") != "" {
		// Not echoed: it may be a raw key given by mistake.
		return "", errors.New("a scope hash is 32 lowercase hex digits (keyhash.Of(value).String())")
	}
	return s.String() + "-" + digest, nil
}

func newReservationID() string {
	return strconv.FormatUint(rand.Uint64(), 36) + strconv.FormatUint(rand.Uint64(), 36)
}
