package fleetguard

import (
	"context"
	"time"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/internal/safego"
)

// Learning is the fleet's: what a model's answers showed (proven, hidden,
// the tokenizer's count trusted or revoked, a proxy's scale and density, the
// first lease) lives in the budget store as a budget.Learned, a union of
// evidence every instance merges its own into and reads back. An instance
// reads it when it first meets a model (loadLearned, once, within
// store_timeout), and merges every model it knows every learnedSync off the
// request path: a restart, a reload or a new instance finds a model as the
// fleet left it, and a contrary answer anywhere withdraws trust everywhere
// within one merge. The memory store has one instance: its histories are
// the store's already.

// learnedSync is how often an instance merges its models' learning with the
// store's.
const learnedSync = 2 * time.Second

// snapshot is what the history has learned, to merge into the fleet's.
func (o *outputHistory) snapshot() budget.Learned {
	o.mu.Lock()
	defer o.mu.Unlock()
	l := budget.Learned{Scale: o.scale.Load(), Density: o.density.Load(), LeaseSize: o.leaseSize.Load(),
		TokensLeaseSize: o.tokensLeaseSize.Load(), ProxyAnswers: int64(o.proxyAnswers), ProxyRatio: o.proxyRatio, ProxyDensity: o.proxyDensity}
	for _, f := range []struct {
		set  bool
		flag uint8
	}{{o.proven.Load(), budget.LearnedProven}, {o.hidden.Load(), budget.LearnedHidden},
		{o.tokensProven.Load(), budget.LearnedTokensProven}, {o.tokensRevoked.Load(), budget.LearnedTokensRevoked}} {
		if f.set {
			l.Flags |= f.flag
		}
	}
	return l
}

// absorb merges the fleet's learning into the history: flags set anywhere
// are set here, and every number is the most either saw.
func (o *outputHistory) absorb(l budget.Learned) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, f := range []struct {
		b    interface{ Store(bool) }
		flag uint8
	}{{&o.proven, budget.LearnedProven}, {&o.hidden, budget.LearnedHidden},
		{&o.tokensProven, budget.LearnedTokensProven}, {&o.tokensRevoked, budget.LearnedTokensRevoked}} {
		if l.Flags&f.flag != 0 {
			f.b.Store(true)
		}
	}
	o.scale.Store(max(o.scale.Load(), l.Scale))
	o.density.Store(max(o.density.Load(), l.Density))
	o.proxyAnswers = max(o.proxyAnswers, int(l.ProxyAnswers))
	o.proxyRatio, o.proxyDensity = max(o.proxyRatio, l.ProxyRatio), max(o.proxyDensity, l.ProxyDensity)
	o.fleetLease, o.fleetTokensLease = max(o.fleetLease, l.LeaseSize), max(o.fleetTokensLease, l.TokensLeaseSize)
	o.leaseSize.Store(max(o.leaseSize.Load(), l.LeaseSize))
	o.tokensLeaseSize.Store(max(o.tokensLeaseSize.Load(), l.TokensLeaseSize))
}

// loadLearned reads what the fleet learned of model the first time this
// instance meets it, waiting at most timeout; a store that does not answer
// leaves it to the next merge.
func (e *engines) loadLearned(o *outputHistory, model string, timeout time.Duration) {
	if e.client == nil || o == &e.histories.others {
		return
	}
	o.load.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		if l, err := e.budgets.MergeLearned(ctx, model, budget.Learned{}); err == nil {
			o.absorb(l)
		}
	})
}

// mergeLearned merges every model's learning with the store's: what this
// instance learned since the last merge goes up, what the fleet learned
// comes back. It stops at the first failure (the store is down: the next
// round tries again).
func (e *engines) mergeLearned(ctx context.Context) {
	e.histories.models.Range(func(k, v any) bool {
		o := v.(*outputHistory)
		var mine budget.Learned
		dirty := o.dirty.Swap(false)
		if dirty {
			mine = o.snapshot()
		}
		l, err := e.budgets.MergeLearned(ctx, k.(string), mine)
		if err != nil {
			if dirty {
				o.dirty.Store(true)
			}
			return false
		}
		o.absorb(l)
		return true
	})
}

// syncLearned merges every learnedSync until stop is closed, then once more
// within timeout, so that a graceful stop leaves its last answers to the
// fleet.
func (e *engines) syncLearned(stop <-chan struct{}, timeout time.Duration) {
	defer safego.Recover("llmbudget learned", e.reportPanic)
	t := time.NewTicker(learnedSync)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
			e.mergeLearned(ctx)
			cancel()
		case <-stop:
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			e.mergeLearned(ctx)
			cancel()
			return
		}
	}
}
