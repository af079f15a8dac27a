package ratelimit

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/window"
)

// evictEvery spaces out eviction sweeps, which take each shard's write lock.
const evictEvery = time.Second

// plan is what one reconcile pass does for one key, captured under the key's
// lock and carried out without it.
type plan struct {
	zone       *Zone
	entry      *entry
	window     time.Duration
	pushEpoch  int64 // epoch the claimed admits belong to
	delta      int64
	carryEpoch int64
	carry      int64
	readEpoch  int64 // epoch whose sliding window the estimate describes
}

func (p *plan) claimed() int64 { return p.delta + p.carry }

// Start runs the reconciler in the background until Close. Calling it again
// does nothing.
func (e *Engine) Start() {
	if e.started.CompareAndSwap(false, true) {
		go e.run()
	}
}

// Close stops the reconciler and pushes what is still pending, giving the
// store at most timeout. It is safe to call more than once.
func (e *Engine) Close(timeout time.Duration) {
	if !e.stopped.CompareAndSwap(false, true) {
		return
	}
	close(e.stop)
	if e.started.Load() {
		<-e.done
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	_ = e.Reconcile(ctx)
}

func (e *Engine) run() {
	defer close(e.done)
	var lastEvict time.Time
	for {
		interval := time.Duration(e.interval.Load())
		// ±10% jitter keeps a fleet started together from pushing in lockstep.
		jitter := time.Duration(rand.Int64N(int64(interval)/5+1)) - interval/10
		t := time.NewTimer(interval + jitter)
		select {
		case <-e.stop:
			t.Stop()
			return
		case <-t.C:
		}
		if time.Since(lastEvict) >= evictEvery {
			e.evict(time.Now().UnixNano())
			lastEvict = time.Now()
		}
		ctx, cancel := context.WithTimeout(context.Background(), max(2*interval, time.Second))
		_ = e.Reconcile(ctx)
		cancel()
	}
}

// Healthy reports whether the last reconcile pass reached the store.
func (e *Engine) Healthy() bool { return e.healthy.Load() }

func (e *Engine) evict(now int64) {
	for _, z := range *e.zones.Load() {
		z.evict(now, e.idleTTL)
	}
	if s, ok := e.store.(interface{ Sweep() }); ok {
		s.Sweep()
	}
}

// Reconcile runs one pass now: claim, push, read, refresh estimates.
func (e *Engine) Reconcile(ctx context.Context) error {
	return e.reconcileAt(ctx, time.Now().UnixNano())
}

func (e *Engine) reconcileAt(ctx context.Context, now int64) error {
	e.passMu.Lock()
	defer e.passMu.Unlock()
	plans := e.claim(now)
	if len(plans) == 0 {
		return nil
	}
	// Whatever happens below, the claimed admits stop counting as in flight at
	// the end of the pass: either the refreshed estimate holds them, or the
	// push failed and they are dropped (a bounded under-count, never a double
	// count and never a spike of old admits when the store returns).
	defer e.settleInflight(plans)

	if err := e.store.Add(ctx, e.increments(plans)); err != nil {
		e.storeFailed(err)
		return err
	}
	counts, err := e.store.Get(ctx, e.readKeys(plans))
	if err != nil {
		e.storeFailed(err)
		return err
	}
	e.storeOK()
	e.applyEstimates(now, plans, counts)
	return nil
}

// claim moves every active key's unclaimed admits into a plan. A key is read
// while it has something to push or was requested within the estimate's
// lifetime (max(4 x interval, 2s)); a key idle for longer is not re-read, since
// its estimate would be ignored anyway, so a burst of one-off keys does not
// become sustained store load.
func (e *Engine) claim(now int64) []plan {
	staleAfter := e.staleAfter()
	var plans []plan
	var entries []*entry
	for _, z := range *e.zones.Load() {
		entries = z.snapshot(entries[:0])
		for _, en := range entries {
			en.mu.Lock()
			active := en.local > 0 || en.carry > 0 || now-en.lastSeen < staleAfter
			if en.dead || !en.fleet || !active {
				en.mu.Unlock()
				continue
			}
			p := plan{
				zone:       z,
				entry:      en,
				window:     en.window,
				pushEpoch:  en.epoch,
				delta:      en.local,
				carryEpoch: en.carryEpoch,
				carry:      en.carry,
				readEpoch:  window.Epoch(now, en.window),
			}
			en.local, en.carry = 0, 0
			en.inflight += p.claimed()
			en.mu.Unlock()
			plans = append(plans, p)
		}
	}
	return plans
}

func (e *Engine) settleInflight(plans []plan) {
	for i := range plans {
		p := &plans[i]
		if p.claimed() == 0 {
			continue
		}
		p.entry.mu.Lock()
		p.entry.inflight = max(p.entry.inflight-p.claimed(), 0)
		p.entry.mu.Unlock()
	}
}

func (e *Engine) increments(plans []plan) []Increment {
	var incs []Increment
	for i := range plans {
		p := &plans[i]
		ttl := 2 * p.window
		if p.delta > 0 {
			incs = append(incs, Increment{Key: e.counterKey(p, p.pushEpoch), By: p.delta, TTL: ttl})
		}
		if p.carry > 0 {
			incs = append(incs, Increment{Key: e.counterKey(p, p.carryEpoch), By: p.carry, TTL: ttl})
		}
	}
	return incs
}

func (e *Engine) readKeys(plans []plan) []string {
	keys := make([]string, 0, 2*len(plans))
	for i := range plans {
		p := &plans[i]
		keys = append(keys, e.counterKey(p, p.readEpoch), e.counterKey(p, p.readEpoch-1))
	}
	return keys
}

// counterKey is <prefix>:rl:{<zone>:<hash>}:<epoch>. The braces are a Redis
// Cluster hash tag: all epochs of a key live in one slot.
func (e *Engine) counterKey(p *plan, epoch int64) string {
	return e.prefix + ":rl:{" + p.zone.name + ":" + p.entry.hash.String() + "}:" + strconv.FormatInt(epoch, 10)
}

func (e *Engine) applyEstimates(now int64, plans []plan, counts []int64) {
	for i := range plans {
		p := &plans[i]
		cur, prev := counts[2*i], counts[2*i+1]
		est := window.SlidingEstimate(cur, prev, window.Elapsed(now, p.window), p.window)
		en := p.entry
		en.mu.Lock()
		// A request may have moved the key to another window or a newer epoch
		// while the read was in flight; this estimate describes neither.
		if en.window == p.window && en.epoch <= p.readEpoch {
			// Round up: under-counting the fleet would admit past the limit.
			en.remote = int64(math.Ceil(est))
			en.remotePrev = prev
			en.estimateAt = now
		}
		en.mu.Unlock()
	}
}

func (e *Engine) storeFailed(err error) {
	if e.onPass != nil {
		e.onPass(err)
	}
	if e.healthy.Swap(false) {
		e.log.Warn("fleet counter store unreachable; limiting per instance until it returns",
			zap.Error(err))
	}
}

func (e *Engine) storeOK() {
	if e.onPass != nil {
		e.onPass(nil)
	}
	if !e.healthy.Swap(true) {
		e.log.Info("fleet counter store reachable again; fleet-wide limits restored")
	}
}

// String describes the engine for logs.
func (e *Engine) String() string {
	return fmt.Sprintf("ratelimit.Engine(prefix=%q, interval=%s)", e.prefix, e.SyncInterval())
}
