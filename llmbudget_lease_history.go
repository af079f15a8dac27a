package fleetguard

import (
	"slices"
	"sync"
	"sync/atomic"

	"github.com/fleetguard/fleetguard/budget/usage"
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
// most need (the 90th percentile of their final running counts, a token a
// byte and by the tokenizer), and
// whether the model bills only output its text can hold. A model leases
// once it is proven, by an answer whose reported output was within its
// text's strict bound: until then a stream of it holds its whole cap, since
// a model on no reasoning list may still bill output it does not stream. A
// model seen to bill more than its text holds is hidden, and holds its
// whole cap from then on.
//
// A model whose tokenizer is public is counted by it once an answer has
// billed no more than the tokenizer's count of its text, and by the strict
// bound again, for good, the moment one bills more. A model counted by a
// proxy (another model's tokenizer: no count of its own is public) is
// counted by it at a scale its answers taught, within the densities they
// showed: proxyProofs answers set the scale (1.1 times the most any billed
// per proxy token) and the density (proxy tokens a byte) up to which it
// holds; a later answer denser than that, billed within the scale, widens
// the density (where the count was near the bill: not text counted a
// token a byte); one within the density billed above the scale ends the
// proxy for good, as does one that bills more than twice the proxy's count
// while it is taught.
// It lives on the store, so it survives reloads.
type outputHistory struct {
	mu sync.Mutex
	// counts are the answers' final counts a token a byte; tokenCounts by
	// the tokenizer (0: not counted by it), each with its margin, so that a
	// first lease is learned from counts as its stream is counted, not from
	// a token a byte once the tokenizer counts the stream.
	counts, tokenCounts [historySize]int64
	n                   int
	// A proxy's evidence so far: the answers, the most billed per proxy
	// token and the densest (both per 1024).
	proxyAnswers             int
	proxyRatio, proxyDensity int64
	// lease, tokensLease (the percentile of tokenCounts, 0 until
	// historyTrusted answers were counted by the tokenizer), proven,
	// hidden, tokensProven, tokensRevoked, scale and density are read on
	// the request path without the lock.
	lease, tokensLease          atomic.Int64
	proven, hidden              atomic.Bool
	tokensProven, tokensRevoked atomic.Bool
	// scale is what the tokenizer's count is multiplied by, per 1024 (1024
	// for a model's own tokenizer), and density the most tokens a byte, per
	// 1024, of a text it is trusted for (a proxy's; 0: any).
	scale, density atomic.Int64
}

// leases reports whether a stream of the model may hold a lease.
func (o *outputHistory) leases() bool { return o.proven.Load() && !o.hidden.Load() }

// countsTokens reports whether a stream of the model is counted by its
// tokenizer.
func (o *outputHistory) countsTokens() bool {
	return o.tokensProven.Load() && !o.tokensRevoked.Load()
}

// answerSeen is what one answer showed and billed.
type answerSeen struct {
	// count is the final count a token a byte (at least what the upstream
	// ran up), bound the strict bound of its text, text its bytes.
	count, bound, text int64
	// tokensCount is the final count as a stream counted by the tokenizer
	// counts it, with its margin (0: not counted by it, or a proxy not yet
	// taught).
	tokensCount int64
	// tokens is the tokenizer's count of the text, and a token a byte of
	// what it did not count (0: not counted); proxy, whether the tokenizer
	// is a proxy.
	tokens int64
	proxy  bool
	// reported is the output the upstream billed.
	reported int64
}

const (
	// proxyProofs answers teach a proxy's scale before it is used.
	proxyProofs = 4
	// maxProxyRatio is the most an answer may bill per proxy token (per
	// 1024) for the proxy to be used: a model that bills more is counted
	// a token a byte.
	maxProxyRatio = 2048
)

// learn records an answer. It reports a change worth an operator's notice
// (a tokenizer's count no longer trusted, a model found hidden), or "".
func (o *outputHistory) learn(a answerSeen) (news string) {
	if a.bound <= 0 || a.reported <= 0 {
		return ""
	}
	wasCounted, wasHidden := o.countsTokens(), o.hidden.Load()
	defer func() {
		switch {
		case o.hidden.Load() && !wasHidden:
			news = "the model billed output its text does not show: its streams hold their whole cap from now on"
		case wasCounted && o.tokensRevoked.Load():
			news = "the model billed more than its tokenizer's count: its streams count a token a byte from now on"
		}
	}()
	switch {
	case a.tokens <= 0:
	case a.proxy:
		o.learnProxy(a)
	case a.reported > a.tokens+usage.OutputOverheadTokens:
		o.tokensRevoked.Store(true)
	default:
		o.scale.Store(1024)
		o.tokensProven.Store(true)
	}
	if a.reported > a.bound {
		o.hidden.Store(true)
		return ""
	}
	o.proven.Store(true)
	o.mu.Lock()
	defer o.mu.Unlock()
	o.counts[o.n%historySize] = a.count
	o.tokenCounts[o.n%historySize] = a.tokensCount
	o.n++
	o.lease.Store(p90(o.counts[:min(o.n, historySize)]))
	o.tokensLease.Store(p90(o.tokenCounts[:min(o.n, historySize)]))
	return ""
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

// tokensCountOf is the count of a text the tokenizer counts as tokens, as a
// stream of the model counts it (without its margin): its own tokenizer's,
// a proxy's at its scale, or 0 for a proxy not taught yet.
func (o *outputHistory) tokensCountOf(tokens int64, proxy bool) int64 {
	if !proxy {
		return tokens + usage.OutputOverheadTokens
	}
	if !o.countsTokens() {
		return 0
	}
	return scaled(tokens, o.scale.Load()) + usage.OutputOverheadTokens
}

// learnProxy weighs an answer counted by a proxy tokenizer.
func (o *outputHistory) learnProxy(a answerSeen) {
	if a.text <= 0 || a.reported > a.bound {
		return // no text to learn from, or output the text does not show
	}
	billed := max(a.reported-usage.OutputOverheadTokens, 0)
	ratio := (billed*1024 + a.tokens - 1) / a.tokens
	density := (a.tokens*1024 + a.text - 1) / a.text
	// An answer shows what the proxy's count is worth at its density only
	// where that count is near the bill: text the meter counted a token a
	// byte (tool-call arguments as written) is dense by the count alone.
	tight := 2*billed >= a.tokens
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.tokensProven.Load() {
		switch {
		case billed > scaled(a.tokens, o.scale.Load()):
			if o.trusts(a.tokens, a.text) {
				o.tokensRevoked.Store(true) // a lost bet, where the proxy was trusted
			}
		case tight:
			o.density.Store(max(o.density.Load(), density))
		}
		return
	}
	if ratio > maxProxyRatio {
		// Billed more than twice what the proxy counts: output the text
		// does not show, likely, which a scale would spread over the
		// text as it streams, while the upstream bills it first.
		o.tokensRevoked.Store(true)
		return
	}
	o.proxyAnswers++
	o.proxyRatio = max(o.proxyRatio, ratio)
	if tight {
		o.proxyDensity = max(o.proxyDensity, density)
	}
	if o.proxyAnswers >= proxyProofs {
		o.scale.Store(o.proxyRatio * 11 / 10)
		o.density.Store(o.proxyDensity)
		o.tokensProven.Store(true)
	}
}

// trusts reports whether a text of the bytes given that the proxy counts
// as tokens is within the densities its answers showed, with 15% to spare
// (a stream's first events and its last differ a little).
func (o *outputHistory) trusts(tokens, text int64) bool {
	return tokens*1024*100 <= o.density.Load()*text*115
}

// scaled is tokens times scale (per 1024), rounded up.
func scaled(tokens, scale int64) int64 { return (tokens*scale + 1023) / 1024 }

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
