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
// most need (the 90th percentile of their final running counts, as a
// stream counted a token a byte would end, and as one counted by the
// model's tokenizer would), and
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
	mu sync.Mutex
	// counts are the answers' final counts a token a byte; tokenCounts by
	// the tokenizer (0: not counted by it), each with its margin, so that a
	// first lease is learned from counts as its stream is counted, not from
	// a token a byte once the tokenizer counts the stream.
	counts, tokenCounts [historySize]int64
	n                   int
	// lease, tokensLease (the percentile of tokenCounts, 0 until
	// historyTrusted answers were counted by the tokenizer), proven, hidden,
	// tokensProven and tokensRevoked are read on the request path without
	// the lock.
	lease, tokensLease          atomic.Int64
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
// count ended at count a token a byte, and at tokensCount by the tokenizer
// with its margin (0: not counted).
func (o *outputHistory) learn(count, tokensCount, bound, tokens, reported int64) {
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
	o.tokenCounts[o.n%historySize] = tokensCount
	o.n++
	o.lease.Store(p90(o.counts[:min(o.n, historySize)]))
	o.tokensLease.Store(p90(o.tokenCounts[:min(o.n, historySize)]))
}

// p90 is the 90th percentile of the counts above 0, or 0 when fewer than
// historyTrusted are.
func p90(counts []int64) int64 {
	var sorted [historySize]int64
	k := 0
	for _, c := range counts {
		if c > 0 {
			sorted[k] = c
			k++
		}
	}
	if k < historyTrusted {
		return 0
	}
	slices.Sort(sorted[:k])
	return sorted[(k*9+9)/10-1]
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
