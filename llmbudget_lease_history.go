package fleetguard

import (
	"math"
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
	// countMargin is how much more than the densest recent answer the
	// running count assumes.
	countMargin = 1.1
)

// outputHistory is what recent leased answers of one model say: the lease
// most need (the 90th percentile of their final running counts), and how far
// below the strict text bound their reported output stays. It lives on the
// store, so it survives reloads.
//
// The ratio is evidence, never trust: it shrinks a model's running count only
// once historyTrusted answers since the last surprise stayed below the bound,
// to countMargin times the densest of them, and it is dropped (the count is
// strict again) the moment an answer reports more than its count. A model
// that reports more output than its text can hold bills output it does not
// stream: it is hidden, and holds its whole cap from then on.
type outputHistory struct {
	mu     sync.Mutex
	counts [historySize]int64
	ratios [historySize]float64
	n      int // answers in counts
	m      int // answers in ratios since the last surprise
	// lease, ratio and hidden are read on the request path without the lock.
	lease  atomic.Int64
	ratio  atomic.Uint64 // math.Float64bits; 0 until trusted (the bound as is)
	hidden atomic.Bool
}

// learn records an answer that reported output tokens whose strict bound
// was bound and whose running count ended at count.
func (o *outputHistory) learn(count, bound, reported int64) {
	if bound <= 0 || reported <= 0 {
		return
	}
	if reported > bound {
		o.hidden.Store(true)
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.counts[o.n%historySize] = count
	o.n++
	if k := min(o.n, historySize); o.n >= historyTrusted {
		counts := o.counts
		slices.Sort(counts[:k])
		o.lease.Store(counts[(k*9+9)/10-1])
	}
	if reported > count {
		// The count under-counted this answer: trust nothing learned.
		o.m = 0
		o.ratio.Store(0)
		return
	}
	o.ratios[o.m%historySize] = float64(reported) / float64(bound)
	o.m++
	if o.m >= historyTrusted {
		ratio := slices.Max(o.ratios[:min(o.m, historySize)]) * countMargin
		o.ratio.Store(math.Float64bits(min(ratio, 1)))
	}
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
