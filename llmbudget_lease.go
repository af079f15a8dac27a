package fleetguard

import (
	"context"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/bpe"
	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/safego"
)

// Output leases (README, "Output leases"): a streamed request reserves its
// prompt and a lease of output learned from recent answers of its model, not
// its whole cap, and the lease grows with the stream, atomically across
// every budget of the request. Bytes past the lease wait for the extension;
// a refused extension ends the stream at the lease in the API's own terminal
// form and cancels the upstream request. Output the meter cannot see (hidden
// reasoning, a model not yet proven) and non-streamed answers hold their
// whole cap.
//
// Which requests lease is decided in chooseLease (llmbudget_serve.go); what
// a model's recent answers teach is outputHistory, below.

// lease is the output a streamed request holds, grown with the stream. Its
// methods run on the response's goroutine; an extension runs on its own.
//
// Its running count never falls below what the upstream can bill for what
// it has streamed: the API's own running usage (Gemini) and the strict bound
// of the text (a byte a token, usage.OutputTokenBound), or, for a model
// counted by its own public tokenizer (tokenized), that tokenizer's count of
// each output value the meter read alone, and a token a byte of any text it
// did not read. No history scales it down: a count below those bets that
// the next answer is like the last ones, and a bet lost in a budget's last
// room cannot be given back (README, "The ceiling").
type lease struct {
	h   *LLMBudget
	res *budget.Reservation
	c   *call // the request as estimated: its price, model, prompt, history
	// held is the output held; limit the output the forwarded cap allows,
	// past which nothing needs holding.
	held, limit int64
	// The running count: the output text seen, and the count it makes with
	// the API's own running usage.
	text, count int64
	// tokens is the tokenizer's count of the text: of each value the meter
	// counted (tokensText bytes and tokensSeen tokens at its last reading),
	// and a token a byte of an event's text it did not count whole. It is
	// the count while the model is tokenized, with a margin: twice the
	// largest event's text, in bytes, so that the events an upstream
	// generates while the lease withholds them and before it sees the cut
	// (a busy machine's upstream gets a second one out), which it bills, are
	// held too.
	tokenized                      bool
	tokens, tokensText, tokensSeen int64
	margin                         int64
	// inputExcess is the input the upstream reported beyond the estimate
	// (below it: negative), which the lease holds too.
	inputExcess int64
	pending     chan extension // the extension in flight
	refused     bool
	tight       bool   // an extension was refused: extend by what is needed only
	refusedBy   string // the budget that refused ("" when the store failed)
	// next is the need past which the next extension starts: a quarter of
	// the last extension's step short of the lease's end, so that it is
	// answered before the stream needs it; the end itself while the lease
	// is tight, or while it is the first lease learned from the model's
	// answers (most of its streams end within that).
	next int64
	// step is how far past the need the extension in flight takes the
	// lease.
	step int64
	// The stream and its extension in flight share these: waiting, the
	// stream waits at its lease for the extension; ended, the stream is
	// over. wake tells the extension of either, so that a retry does not sit
	// out its backoff.
	waiting, ended atomic.Bool
	wake           chan struct{}
	// The grant (llmbudget_grant.go): what the stream may forward, as a
	// sweep would settle its reservation should this instance fall silent.
	grant grant
}

const (
	// maxLeaseWait bounds how long a stream waits at its lease for an
	// extension the store does not answer. Before it, a stream waiting at
	// its lease ends there only once a try fails while the breaker is open
	// (a probe got no answer within probeTimeout either): the store is
	// down, not slow. A count of tries cut streams while the store answered
	// every probe (a busy machine, a stampede of reconnects after a short
	// stall), and a cut answer costs its client more than a pause of a
	// second does. The bound covers a store that answers probes and fails
	// extensions (a Cluster node of the key's slot down).
	maxLeaseWait = 2 * time.Second
	// extendBackoff is the first wait between tries of an extension while
	// its stream still has output held ahead of its count; it doubles up to
	// maxExtendBackoff.
	extendBackoff    = 25 * time.Millisecond
	maxExtendBackoff = time.Second
)

// extension is the answer to one extension of more output tokens.
type extension struct {
	more    int64
	granted bool
	failed  bool   // the store did not answer
	by      string // the budget that refused it
}

func newLease(h *LLMBudget, res *budget.Reservation, c *call) *lease {
	l := &lease{h: h, res: res, c: c, held: c.leaseSize, limit: c.outputCap, count: usage.OutputTokenBound(0),
		tokenized: c.tokens != nil && c.history.countsTokens(), next: c.leaseSize}
	if !c.learned {
		// A first lease not learned from the model's answers (the least
		// lease) is extended from three quarters of it on.
		l.next -= c.leaseSize / 4
	}
	return l
}

// observe folds one event into the running count. It reports whether the
// event carried output: only such an event waits for the lease (a usage
// report delivers nothing).
func (l *lease) observe(r usage.Reading) (output bool) {
	// An event's text is its tokens only when the meter's counter read all
	// of it (the values it counted hold as many bytes as the meter's
	// text grew by); else a token a byte.
	text, counted := r.OutputTextBytes-l.text, r.OutputTokensText-l.tokensText
	if counted == text {
		l.tokens += r.OutputTokens - l.tokensSeen
	} else {
		l.tokens += max(text, 0)
	}
	l.margin = max(l.margin, 2*text)
	l.tokensText, l.tokensSeen = r.OutputTokensText, r.OutputTokens
	if r.OutputTextBytes > l.text {
		l.text = r.OutputTextBytes
		output = true
	}
	if r.InputKnown {
		l.inputExcess = r.Usage.InputTokens - l.c.req.PromptTokens
	}
	// (The bound is at least a token an event with text: each has a byte.)
	// The API's own running usage (Gemini's) gets the margin too: an
	// upstream bills the events it generates before it sees a cut.
	running := r.Usage.OutputTokens
	if running > 0 {
		running += l.margin
	}
	l.count = max(running, l.bound(), l.count)
	return output
}

// observePending folds n bytes of an event not ended yet into the running
// count, a token a byte beyond the text seen. It reports whether the count
// grew (the bytes wait for the lease).
func (l *lease) observePending(n int64) bool {
	c := usage.OutputTokenBound(l.text + n)
	if c <= l.count {
		return false
	}
	l.count = c
	return true
}

// bound is the count of the text seen: the tokenizer's, and its margin,
// while the model is counted by it (an answer of it that bills more ends
// that for every stream of it, this one included); a proxy tokenizer's at
// its scale while the text is within its density; else the strict bound.
func (l *lease) bound() int64 {
	if !l.tokenized {
		return usage.OutputTokenBound(l.text)
	}
	switch o := l.c.history; {
	case o.tokensRevoked.Load():
	case !l.c.proxy:
		return l.tokens + usage.OutputOverheadTokens + l.margin
	case o.trusts(l.tokens, l.text):
		// Another model's tokenizer, at the scale this model's answers
		// taught, for text no denser than they showed.
		return scaled(l.tokens, o.scale.Load()) + usage.OutputOverheadTokens + l.margin
	}
	return usage.OutputTokenBound(l.text)
}

// need is what the lease must hold for the stream so far: its output count
// and the input the upstream reported beyond the estimate.
func (l *lease) need() int64 { return min(l.count, l.limit) + l.inputExcess }

// ahead is how far past the need an extension takes the lease: as far as
// the need has come, so that the lease doubles what the stream has shown
// and a stream makes a few extensions in its length (about log1.75 of its
// count over its first lease), whatever its event rate; at least a quarter
// of output_lease_min; and at most a quarter of this stream's share of the
// least room its budgets had left at the store's last answer (shared with
// the requests this Caddy has in flight), so that the streams near a
// budget's end together hold little more than they need: a step taken
// from the room others need would have them refused, and cut.
func (l *lease) ahead() int64 {
	least := l.h.outputLeaseMin / 4
	share := l.room() / (4 * max(l.h.engines.inFlight.n.Load(), 1))
	return max(min(l.need(), share), least)
}

// room is the least output, in tokens, that the request's budgets had room
// for at the store's last answer (the reserve's or an extension's); in
// shadow mode, where no limit holds a stream back, no bound.
func (l *lease) room() int64 {
	const probe = 1 << 20 // tokens, priced once to convert each budget's unit
	room := int64(math.MaxInt64)
	if l.h.Shadow {
		return room
	}
	unit := l.spendOf(probe)
	for i := range l.res.Holds {
		h := &l.res.Holds[i]
		per := h.Budget.Amount(unit)
		if per <= 0 {
			continue
		}
		left := max(h.Budget.LimitNow()-h.Used, 0)
		room = min(room, int64(float64(left)*probe/float64(per)))
	}
	return room
}

// spendOf is what more output tokens cost, at the rates of the reservation:
// its tier's and its prompt's.
func (l *lease) spendOf(more int64) budget.Spend {
	spend := budget.Spend{Tokens: more}
	if l.h.hasUSD {
		spend.CostMicros = l.c.rates.CostMicros(budget.Usage{OutputTokens: more})
	}
	return spend
}

// admit reports whether the output counted so far may reach the client:
// within the lease, or once an extension covers it (waiting for it if it
// must). An extension starts when the need passes next, a quarter of the
// last step short of the lease's end, and takes the lease a step past the
// need, a step being about as much as the need (ahead): the lease grows
// about 1.75 times an extension, so a stream makes a few store calls at
// any event rate, and holds at most about twice its count. A first lease
// learned from the model's answers is extended only once the stream needs
// more: most end within it, with no extension. Once one is refused the
// lease is tight: it is extended only by what an event needs, when it needs
// it, so a stream near the limit spends the budget to its last tokens. It
// is false when a tight extension was refused, or one failed.
func (l *lease) admit() bool {
	if l.pending != nil {
		select {
		case ext := <-l.pending:
			l.apply(ext)
		default:
		}
	}
	full := l.full()
	if l.held >= full {
		return l.granted() // the forwarded cap bounds the rest
	}
	if l.pending == nil && !l.refused && l.need() > min(l.next, l.held) {
		l.extend()
	}
	for l.need() > l.held && l.held < full {
		if l.pending == nil {
			return false
		}
		l.waitExtension()
		if l.need() > l.held && !l.refused && l.held < full {
			l.extend()
		}
	}
	return l.granted()
}

// waitExtension waits for the extension in flight, telling it that the
// stream waits.
func (l *lease) waitExtension() {
	l.waiting.Store(true)
	select {
	case l.wake <- struct{}{}:
	default:
	}
	l.apply(<-l.pending)
	l.waiting.Store(false)
}

// full is the most the lease needs to hold: the output the forwarded cap
// allows, and the input the upstream reported beyond the estimate.
func (l *lease) full() int64 { return l.limit + max(l.inputExcess, 0) }

func (l *lease) apply(ext extension) {
	l.pending = nil
	switch {
	case ext.granted:
		l.held += ext.more
		l.next = l.held - l.step/4
	case l.h.Shadow || ext.failed && l.h.FailOpen:
		// Shadow mode enforces nothing, and fail_open admits while the store
		// fails: the stream runs on unleased, and settles to what it reports.
		l.held = l.full()
	case !ext.failed && !l.tight:
		l.tight = true // a budget is nearly spent: ask for what is needed only
		l.next = l.held
	default:
		l.refused, l.refusedBy = true, ext.by
	}
}

// extend asks, off the byte path, for enough more output to cover the need
// and a step beyond it (a tight lease: the need only), up to the forwarded
// cap.
func (l *lease) extend() {
	more := l.need() - l.held
	l.step = 0
	if !l.tight {
		l.step = l.ahead()
		more += l.step
	}
	more = min(more, l.full()-l.held)
	ch := make(chan extension, 1)
	l.pending = ch
	if l.wake == nil {
		l.wake = make(chan struct{}, 1)
	}
	go l.ask(ch, more, l.spendOf(more))
}

// ask makes one extension of more output tokens, spend in the budgets'
// units, and sends its answer on ch. A store that does not answer is tried
// again, the same extension (the store applies it once), for as long as the
// stream has output held ahead of its count, which is its own slack: it
// waits for nothing meanwhile. Once the stream waits at its lease, a try
// that fails ends the extension, and the stream at its lease, if the store
// is known down (the breaker is open) or the stream has waited
// maxLeaseWait. So a slow or failed call slows only the stream whose
// extension it was, and cuts a stream only in an outage; the breaker opens
// on a failed probe, not on this (budget.Engine.Extend).
func (l *lease) ask(ch chan<- extension, more int64, spend budget.Spend) {
	h, res := l.h, l.res
	ext := extension{more: more, failed: true} // until the store answers
	defer func() { ch <- ext }()
	defer safego.Recover("llmbudget lease", h.engines.reportPanic)
	backoff := extendBackoff
	var waitingSince time.Time
	for ; ; backoff = min(2*backoff, maxExtendBackoff) {
		tried := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), h.storeTimeout)
		denial, err := h.engines.budgets.Extend(ctx, res, spend)
		cancel()
		switch {
		case err == nil && denial != nil:
			ext.failed, ext.by = false, denial.Budget.Name
			metrics.llmLeaseExtensions.WithLabelValues("refused").Inc()
			return
		case err == nil:
			ext.failed, ext.granted = false, true
			metrics.llmLeaseExtensions.WithLabelValues("granted").Inc()
			return
		}
		if l.ended.Load() {
			return // the stream is over: nothing waits for this answer
		}
		waiting := l.waiting.Load()
		if waiting && waitingSince.IsZero() {
			waitingSince = time.Now()
		}
		if waiting && (h.engines.budgets.Down() || time.Since(waitingSince) >= maxLeaseWait) {
			metrics.llmLeaseExtensions.WithLabelValues("failed").Inc()
			msg := "extending an output lease failed; the stream ends at its lease"
			if h.FailOpen || h.Shadow {
				msg = "extending an output lease failed; the stream goes on unleased (fail_open or shadow)"
			}
			h.logger.Warn(msg, zap.String("reservation", res.ID), zap.Error(err))
			return
		}
		// Waiting, the next try goes at once, but at most one a
		// store_timeout: a refused connection fails at once.
		pause := backoff
		if waiting {
			pause = h.storeTimeout - time.Since(tried)
		}
		if pause > 0 {
			t := time.NewTimer(pause)
			select {
			case <-t.C:
			case <-l.wake:
			}
			t.Stop()
		}
	}
}

// holdAll extends the lease to the whole cap, waiting for the answer: for an
// answer whose output cannot be counted as it passes. It reports whether the
// whole cap is held (meteringWriter.holdAllOrRefuse decides what passes).
func (l *lease) holdAll() bool {
	was := l.count
	l.count = max(l.count, l.limit)
	if l.admit() && l.held >= l.full() {
		return true
	}
	// The rest of the room may still hold what the stream needs, event by
	// event: the lease goes on tight, from the count it had.
	l.count, l.refused, l.tight = was, false, true
	return false
}

// wait ends the extension in flight, if any, before the settle reads the
// reservation: the stream is over, so a retry waits no more.
func (l *lease) wait() {
	if l.pending != nil {
		l.ended.Store(true)
		select {
		case l.wake <- struct{}{}:
		default:
		}
		l.apply(<-l.pending)
	}
}

// charge is the output a stream that ended without its usage is charged
// at most: what the lease holds, less the input the upstream reported beyond
// the estimate, so that the settle charges what the reservation holds.
func (l *lease) charge() int64 { return max(l.held-l.inputExcess, 0) }

// proxyCounter counts text for a model by another's tokenizer: its tokens,
// and half a token more for each byte outside ASCII. Tokenizers differ most
// on scripts other than Latin (cl100k bills CJK at twice o200k's count);
// the extra weight makes such text denser than any English answer, so a
// proxy taught by English answers does not count it at their scale (the
// density check of outputHistory.trusts), and one taught by such answers
// holds them with room to spare.
type proxyCounter struct{ c *bpe.Counter }

func (p proxyCounter) Count(text []byte) int64 {
	var wide int64
	for _, b := range text {
		if b >= 0x80 {
			wide++
		}
	}
	return p.c.Count(text) + wide/2
}

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
	// leaseSize (the percentile of counts), tokensLeaseSize (of tokenCounts, 0 until
	// historyTrusted answers were counted by the tokenizer), proven,
	// hidden, tokensProven, tokensRevoked, scale and density are read on
	// the request path without the lock.
	leaseSize, tokensLeaseSize  atomic.Int64
	proven, hidden              atomic.Bool
	tokensProven, tokensRevoked atomic.Bool
	// scale is what the tokenizer's count is multiplied by, per 1024 (1024
	// for a model's own tokenizer), and density the most tokens a byte, per
	// 1024, of a text it is trusted for (a proxy's; 0: any).
	scale, density atomic.Int64
	// The fleet's learning (llmbudget_learned.go): fleetLease and
	// fleetTokensLease are the first leases the fleet learned, below which
	// this instance's own do not fall; load reads the store's when the
	// instance first meets the model; dirty: learned since the last merge.
	fleetLease, fleetTokensLease int64
	load                         sync.Once
	dirty                        atomic.Bool
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

// answerOf is what an answer the upstream billed reported tokens for showed
// of its output, for its model's history: its text, and its count by the
// tokenizer as a stream of the model counts it.
func answerOf(mw *meteringWriter, c *call, reported int64) answerSeen {
	read := mw.meter.Reading()
	bound := usage.OutputTokenBound(read.OutputTextBytes)
	a := answerSeen{count: max(bound, read.Usage.OutputTokens), bound: bound, text: read.OutputTextBytes,
		proxy: c.proxy, reported: reported}
	if mw.tokens != nil {
		// The tokenizer's count, and a token a byte of what it did
		// not count.
		a.tokens = read.OutputTokens + max(read.OutputTextBytes-read.OutputTokensText, 0)
		a.tokensCount = c.history.tokensCountOf(a.tokens, c.proxy)
	}
	if l := mw.lease; l != nil && mw.tokens != nil {
		a.tokens = l.tokens
		switch n := c.history.tokensCountOf(a.tokens, c.proxy); {
		case l.tokenized:
			// As the stream counted: by the tokenizer with its margin,
			// or a token a byte where a proxy's was not trusted for
			// its text (denser than the answers that taught it): a
			// first lease learned from English answers alone would
			// cut a wave of CJK streams short, each charged its hold.
			a.tokensCount = max(l.count, read.Usage.OutputTokens)
		case n > 0:
			// As a tokenized stream would count: with its margin.
			a.tokensCount = max(n+l.margin, read.Usage.OutputTokens)
		}
	}
	return a
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
	defer o.dirty.Store(true)
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
	o.leaseSize.Store(max(p90(o.counts[:min(o.n, historySize)]), o.fleetLease))
	o.tokensLeaseSize.Store(max(p90(o.tokenCounts[:min(o.n, historySize)]), o.fleetTokensLease))
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
	// The scale is learned from the whole bill per proxy token: an
	// overhead taken out of a short answer's bill would teach a scale that
	// long answers, which bill the same rate on many more tokens, pass.
	// billed, without the overhead a stream's count adds anyway, is what
	// a bet on the scale is judged by.
	billed := max(a.reported-usage.OutputOverheadTokens, 0)
	ratio := (a.reported*1024 + a.tokens - 1) / a.tokens
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
	if (billed*1024+a.tokens-1)/a.tokens > maxProxyRatio {
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
