package fleetguard

import (
	"slices"
	"sync"
	"sync/atomic"
)

const (
	// historySize answers of a model are remembered for its leases.
	historySize = 64
	// historyTrusted answers are needed before the history is used.
	historyTrusted = 8
	// maxHistoryModels bounds the models remembered; more share one history.
	maxHistoryModels = 256
)

// outputHistory is what recent streamed answers of one model say: the lease
// most need (the 90th percentile of their final running counts), and
// whether the model bills only output its text can hold. A model leases
// once it is proven, by an answer whose reported output was within its
// text's strict bound: until then a stream of it holds its whole cap, since
// a model on no reasoning list may still bill output it does not stream. A
// model seen to bill more than its text holds is hidden, and holds its
// whole cap from then on. A model whose tokenizer is public is counted by
// it once an answer has billed no more than the tokenizer's count of its
// text, and by the strict bound again, for good, the moment one bills more.
// It lives on the store, so it survives reloads.
type outputHistory struct {
	mu     sync.Mutex
	counts [historySize]int64
	n      int
	// lease, proven, hidden, tokensProven and tokensRevoked are read on the
	// request path without the lock.
	lease                       atomic.Int64
	proven, hidden              atomic.Bool
	tokensProven, tokensRevoked atomic.Bool
}

// leases reports whether a stream of the model may hold a lease.
func (o *outputHistory) leases() bool { return o.proven.Load() && !o.hidden.Load() }

// countsTokens reports whether a stream of the model is counted by its
// tokenizer.
func (o *outputHistory) countsTokens() bool {
	return o.tokensProven.Load() && !o.tokensRevoked.Load()
}

// learn records an answer that reported output tokens whose strict bound
// was bound, whose tokenizer count (with the strict bound of what the
// tokenizer did not count) was tokens (0: not counted), and whose running
// count ended at count.
func (o *outputHistory) learn(count, bound, tokens, reported int64) {
	if bound <= 0 || reported <= 0 {
		return
	}
	switch {
	case tokens <= 0:
	case reported > tokens:
		o.tokensRevoked.Store(true)
	default:
		o.tokensProven.Store(true)
	}
	if reported > bound {
		o.hidden.Store(true)
		return
	}
	o.proven.Store(true)
	o.mu.Lock()
	defer o.mu.Unlock()
	o.counts[o.n%historySize] = count
	o.n++
	if o.n < historyTrusted {
		return
	}
	k := min(o.n, historySize)
	counts := o.counts
	slices.Sort(counts[:k])
	o.lease.Store(counts[(k*9+9)/10-1])
}

// histories are the output histories of a store, by model. Reads take no
// lock: a model's history is found on every leased request.
type histories struct {
	models sync.Map // string → *outputHistory
	n      atomic.Int32
	others outputHistory // the models past maxHistoryModels
}

func (hs *histories) of(model string) *outputHistory {
	if o, ok := hs.models.Load(model); ok {
		return o.(*outputHistory)
	}
	if hs.n.Load() >= maxHistoryModels {
		return &hs.others
	}
	o, loaded := hs.models.LoadOrStore(model, new(outputHistory))
	if !loaded {
		hs.n.Add(1)
	}
	return o.(*outputHistory)
}
