package fleetguard

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/safego"
)

// Output leases (DESIGN.md "Output leases"): a streamed request reserves its
// prompt and a lease of output learned from recent answers of its model, not
// its whole cap, and the lease grows with the stream, atomically across
// every budget of the request. Bytes past the lease wait for the extension;
// a refused extension ends the stream at the lease in the API's own terminal
// form and cancels the upstream request. Output the meter cannot see (hidden
// reasoning) and non-streamed answers hold their whole cap.

const (
	// DefaultOutputLeaseMin is the smallest output lease, and the first one
	// of a model with no history.
	DefaultOutputLeaseMin = 256
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

// DefaultReasoningModels are the model patterns that reason by default and
// bill reasoning tokens they do not stream: OpenAI's o-series and GPT-5,
// Gemini 2.5 and 3 (thinking on by default), xAI's Grok 3 mini and Grok 4, and
// any "thinking" model. A * matches any run of characters; a pattern matches
// the model as named or after its last "/" (openai/o3 via a router).
var DefaultReasoningModels = []string{"o1*", "o3*", "o4*", "gpt-5*", "codex-*", "gemini-2.5-*", "gemini-3*", "grok-3-mini*", "grok-4*", "*thinking*"}

// compileLeases checks the lease options.
func (h *LLMBudget) compileLeases() error {
	h.outputLeases = h.OutputLeases == nil || *h.OutputLeases
	if h.OutputLeaseMin < 0 || h.OutputLeaseMin > usage.MaxOutputCap {
		return fmt.Errorf("llmbudget: output_lease_min: must be between 1 and %d", usage.MaxOutputCap)
	}
	h.outputLeaseMin = cmp.Or(h.OutputLeaseMin, DefaultOutputLeaseMin)
	h.reasoningModels = DefaultReasoningModels
	if h.ReasoningModels != nil {
		h.reasoningModels = make([]string, len(h.ReasoningModels))
		for i, p := range h.ReasoningModels {
			if strings.TrimSpace(p) == "" {
				return errors.New("llmbudget: reasoning_models: a pattern is empty")
			}
			h.reasoningModels[i] = strings.ToLower(p)
		}
	}
	return nil
}

// leasable reports whether the output of c can be leased: a single streamed
// answer whose every token the meter sees.
func (h *LLMBudget) leasable(r *http.Request, format usage.Format, c *call) bool {
	if !h.outputLeases || !c.req.Stream || c.req.N != 1 || c.req.NoOutput || c.req.Reasoning || c.outputCap <= h.outputLeaseMin {
		return false
	}
	switch format {
	case usage.Gemini:
		// Streamed as SSE only with alt=sse; else a JSON array the meter
		// does not read as it passes.
		return strings.EqualFold(r.URL.Query().Get("alt"), "sse") && !h.isReasoningModel(c.req.Model)
	case usage.OpenAIChat, usage.OpenAICompletions, usage.OpenAIResponses, usage.Anthropic, usage.Ollama:
		return !h.isReasoningModel(c.req.Model)
	}
	return false
}

func (h *LLMBudget) isReasoningModel(model string) bool {
	model = strings.ToLower(model)
	base := model[strings.LastIndexByte(model, '/')+1:]
	for _, p := range h.reasoningModels {
		if globMatch(p, model) || globMatch(p, base) {
			return true
		}
	}
	return false
}

// globMatch matches s against pattern, where * matches any run of
// characters (including none) and everything else matches itself.
func globMatch(pattern, s string) bool {
	parts := strings.Split(pattern, "*")
	if len(parts) == 1 {
		return pattern == s
	}
	if !strings.HasPrefix(s, parts[0]) {
		return false
	}
	s = s[len(parts[0]):]
	for _, part := range parts[1 : len(parts)-1] {
		i := strings.Index(s, part)
		if i < 0 {
			return false
		}
		s = s[i+len(part):]
	}
	return strings.HasSuffix(s, parts[len(parts)-1])
}

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

// lease is the output a streamed request holds, grown with the stream. Its
// methods run on the response's goroutine; an extension runs on its own.
type lease struct {
	h       *LLMBudget
	res     *budget.Reservation
	price   budget.Price
	history *outputHistory
	model   string // as the request names it
	prompt  int64  // the prompt's estimate
	// held is the output held; limit the output the forwarded cap allows,
	// past which nothing needs holding.
	held, limit int64
	// ratio scales the text bound down to what this model's answers use (1:
	// the bound as is).
	ratio float64
	// The running count: text seen, its bytes above ASCII, events with text,
	// and the count they make with the API's own running usage.
	text, high, deltas, count int64
	pending                   chan extension // the extension in flight
	refused                   bool
	tight                     bool   // an extension was refused: extend by what is needed only
	refusedBy                 string // the budget that refused ("" when the store failed)
}

// extension is the answer to one extension of more output tokens.
type extension struct {
	more    int64
	granted bool
	failed  bool   // the store did not answer
	by      string // the budget that refused it
}

func newLease(h *LLMBudget, res *budget.Reservation, c *call) *lease {
	l := &lease{h: h, res: res, price: c.price, history: c.history, model: c.req.Model, prompt: c.req.PromptTokens,
		held: c.lease, limit: c.outputCap, ratio: 1}
	if bits := c.history.ratio.Load(); bits != 0 {
		l.ratio = math.Float64frombits(bits)
	}
	return l
}

// observe folds one event into the running count, which never falls below
// the API's own running usage (Gemini streams one) nor one token per event
// with text. It reports whether the event carried output: only such an
// event waits for the lease (a usage report delivers nothing).
func (l *lease) observe(ev []byte, r usage.Reading) (output bool) {
	if r.OutputTextBytes > l.text {
		l.text = r.OutputTextBytes
		l.high += usage.HighBytes(ev)
		l.deltas++
		output = true
	}
	bound := usage.OutputTokenBound(l.text, l.high)
	scaled := int64(math.Ceil(float64(bound) * l.ratio))
	l.count = max(r.Usage.OutputTokens, scaled, l.deltas, l.count)
	return output
}

// step is how far ahead of the count a lease is extended.
func (l *lease) step() int64 { return max(l.h.outputLeaseMin/4, l.held/4) }

// admit reports whether the output counted so far may reach the client:
// within the lease, or once an extension covers it (waiting for it if it
// must). An extension starts when the count nears the lease, so the wait is
// rare. Once one is refused the lease is tight: it is extended only by what
// an event needs, when it needs it, so a stream near the limit spends the
// budget to its last tokens. It is false when a tight extension was refused,
// or one failed.
func (l *lease) admit() bool {
	if l.pending != nil {
		select {
		case ext := <-l.pending:
			l.apply(ext)
		default:
		}
	}
	if l.held >= l.limit {
		return true // the forwarded cap bounds the rest
	}
	if l.pending == nil && !l.refused && (l.count > l.held || !l.tight && l.count+l.step() > l.held) {
		l.extend()
	}
	for l.count > l.held {
		if l.pending == nil {
			return false
		}
		l.apply(<-l.pending)
		if l.count > l.held && !l.refused && l.held < l.limit {
			l.extend()
		}
	}
	return true
}

func (l *lease) apply(ext extension) {
	l.pending = nil
	switch {
	case ext.granted:
		l.held += ext.more
	case l.h.Shadow || ext.failed && l.h.FailOpen:
		// Shadow mode enforces nothing, and fail_open admits while the store
		// fails: the stream runs on unleased, and settles to what it reports.
		l.held = l.limit
	case !ext.failed && !l.tight:
		l.tight = true // a budget is nearly spent: ask for what is needed only
	default:
		l.refused, l.refusedBy = true, ext.by
	}
}

// extend asks, off the byte path, for enough more output to cover the count
// and a step beyond it (a tight lease: the count only), up to the forwarded
// cap.
func (l *lease) extend() {
	more := l.count - l.held
	if !l.tight {
		more += l.step()
	}
	more = min(more, l.limit-l.held)
	spend := budget.Spend{Tokens: more}
	if l.h.hasUSD {
		spend.CostMicros = l.price.CostMicros(budget.Usage{OutputTokens: more})
	}
	ch := make(chan extension, 1)
	l.pending = ch
	h, res := l.h, l.res
	go func() {
		ext := extension{more: more, failed: true} // until the store answers
		defer func() { ch <- ext }()
		defer safego.Recover("llmbudget lease", h.store.reportPanic)
		ctx, cancel := context.WithTimeout(context.Background(), h.storeTimeout)
		defer cancel()
		denial, err := h.store.budgets.Extend(ctx, res, spend)
		switch {
		case err != nil:
			metrics.llmLeaseExtensions.WithLabelValues("failed").Inc()
			msg := "extending an output lease failed; the stream ends at its lease"
			if h.FailOpen || h.Shadow {
				msg = "extending an output lease failed; the stream goes on unleased (fail_open or shadow)"
			}
			h.logger.Warn(msg, zap.String("reservation", res.ID), zap.Error(err))
		case denial != nil:
			ext.failed, ext.by = false, denial.Budget.Name
			metrics.llmLeaseExtensions.WithLabelValues("refused").Inc()
		default:
			ext.failed, ext.granted = false, true
			metrics.llmLeaseExtensions.WithLabelValues("granted").Inc()
		}
	}()
}

// learn tells the model's history how this answer ended: reported output
// tokens, counted as l.count.
func (l *lease) learn(reported int64) {
	l.history.learn(l.count, usage.OutputTokenBound(l.text, l.high), reported)
}

// holdAll extends the lease to the whole cap, waiting for the answer: for an
// answer whose output cannot be counted as it passes. Refused, the answer
// passes all the same (it cannot be cut) and is charged what it reports.
func (l *lease) holdAll() {
	l.count = max(l.count, l.limit)
	_ = l.admit()
}

// wait ends the extension in flight, if any, before the settle reads the
// reservation.
func (l *lease) wait() {
	if l.pending != nil {
		l.apply(<-l.pending)
	}
}
