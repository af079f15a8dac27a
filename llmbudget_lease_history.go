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
// most need (the 90th percentile of their final running counts) and how
// much the text bound over-counts their reported output. It lives on the
// store, so it survives reloads.
type outputHistory struct {
	mu     sync.Mutex
	counts [historySize]int64
	ratios [historySize]float64
	n      int
	// lease and ratio are read on the request path without the lock.
	lease atomic.Int64
	ratio atomic.Uint64 // math.Float64bits; 0 until trusted (the bound as is)
}

// learn records an answer that reported output tokens whose text bound was
// bound and whose running count ended at count.
func (o *outputHistory) learn(count, bound, reported int64) {
	if bound <= 0 || reported <= 0 {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	i := o.n % historySize
	o.counts[i], o.ratios[i] = count, float64(reported)/float64(bound)
	o.n++
	if o.n < historyTrusted {
		return
	}
	k := min(o.n, historySize)
	counts := o.counts
	slices.Sort(counts[:k])
	o.lease.Store(counts[(k*9+9)/10-1])
	ratio := slices.Max(o.ratios[:k]) * countMargin
	o.ratio.Store(math.Float64bits(min(ratio, 1)))
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
