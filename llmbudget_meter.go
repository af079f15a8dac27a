package fleetguard

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
)

// statusClientClosed is the status Caddy's reverse_proxy gives a request whose
// client went away before the response.
const statusClientClosed = 499

// maxUsageCapture bounds the copy of a JSON response kept to read its usage.
// A larger response passes through untouched and keeps its reservation.
const maxUsageCapture = 8 << 20

// meteringWriter passes the response through as it is written and keeps only
// what it needs to read the usage: the status, a bounded copy of a successful
// JSON body, or a usage.Meter for a stream. Writes and flushes reach the client
// at once.
type meteringWriter struct {
	*caddyhttp.ResponseWriterWrapper
	format   usage.Format
	status   int
	meter    *usage.Meter // set for a successful streamed response
	capture  []byte
	overflow bool
	// opaque: the body is encoded (the upstream compressed it although it
	// was not asked to), so its usage cannot be read.
	opaque bool
	// stripUsage drops the usage-only chunk of an OpenAI stream from what the
	// client receives (llmbudget asked for it, the client did not); pending
	// holds the start of an event not complete yet.
	stripUsage bool
	pending    []byte
	scanned    int // how far pending was scanned for an event's end
	// lease, for a leased stream, holds each event back until its output
	// is held (llmbudget_lease.go); truncated: the stream was ended at the
	// lease, and the rest of the upstream's answer is dropped.
	lease            *lease
	cancelUpstream   context.CancelFunc
	truncated        bool
	clientAskedUsage bool
	// responses keeps what a leased Responses stream output, for the
	// response object a truncation ends it with.
	responses *usage.ResponsesOutput
	// tokens, when not nil, is the model's tokenizer (or its proxy): the
	// meter counts the output by it too.
	tokens usage.TokenCounter
}

var (
	_ http.Flusher  = (*meteringWriter)(nil)
	_ io.ReaderFrom = (*meteringWriter)(nil)
)

func newMeteringWriter(w http.ResponseWriter, f usage.Format) *meteringWriter {
	return &meteringWriter{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, format: f}
}

// WriteHeader records the final status; informational 1xx answers pass
// through without counting as the response.
func (w *meteringWriter) WriteHeader(status int) {
	if w.status == 0 && status >= 200 {
		w.status = status
		if ce := w.Header().Get("Content-Encoding"); ce != "" && ce != "identity" {
			w.opaque = true
		} else if status < 300 {
			switch ct, _, _ := mime.ParseMediaType(w.Header().Get("Content-Type")); ct {
			case "text/event-stream":
				w.meter = usage.NewMeter(w.format, usage.SSE)
			case "application/x-ndjson", "application/jsonl", "application/json-seq":
				w.meter = usage.NewMeter(w.format, usage.NDJSON)
			}
			if w.meter != nil && w.tokens != nil {
				w.meter.CountTokens(w.tokens)
			}
		}
		if w.lease != nil && w.meter == nil && status < 300 && !w.holdAllOrRefuse() {
			return
		}
	}
	w.ResponseWriter.WriteHeader(status)
}

// holdAllOrRefuse holds the whole output cap for a leased request answered
// with a body the meter does not read as it passes. A JSON answer passes
// whether or not the cap fits: it is whole already, the upstream bills it,
// and it is charged what it reports. Anything else (no Content-Type,
// text/plain, an encoding) keeps no usage the settle could read, so it
// passes only if the cap fits; else the client gets the budget's refusal
// instead, the upstream request is cancelled, and the reservation is kept.
func (w *meteringWriter) holdAllOrRefuse() bool {
	if w.lease.holdAll() {
		return true
	}
	ct, _, _ := mime.ParseMediaType(w.Header().Get("Content-Type"))
	if !w.opaque && (ct == "application/json" || strings.HasSuffix(ct, "+json")) {
		return true
	}
	w.truncated = true
	w.cancelUpstream()
	metrics.llmTruncations.Inc()
	hdr := w.Header()
	ce := hdr.Get("Content-Encoding")
	for _, k := range []string{"Content-Encoding", "Content-Length", "Content-Type", "Transfer-Encoding"} {
		hdr.Del(k)
	}
	unit := budget.Tokens
	if w.lease.h.hasUSD {
		unit = budget.USD
	}
	status, errType, code := w.lease.h.denialOf(unit)
	msg := fmt.Sprintf("the upstream answered a stream with a body llmbudget cannot meter (Content-Type %q, Content-Encoding %q), and budget %q cannot hold its whole output cap",
		ct, ce, w.lease.refusedBy)
	_ = writeError(w.ResponseWriter, w.format, status, errType, code, msg)
	return false
}

func (w *meteringWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if w.truncated {
		return len(p), nil // the rest of an answer ended at its lease
	}
	if w.lease != nil && w.meter != nil {
		return len(p), w.passLeased(p)
	}
	if w.stripUsage && w.meter != nil {
		w.observe(p)
		if len(w.pending)+len(p) > usage.MaxEventBytes {
			return len(p), w.giveUpStripping(p)
		}
		return len(p), w.passEvents(p)
	}
	n, err := w.ResponseWriter.Write(p)
	w.observe(p[:n])
	return n, err
}

// passEvents writes the complete SSE events of pending+p to the client, each
// as it completes, except the usage-only chunk; an incomplete event waits for
// its end (so the chunk can be recognised whole), every other byte passes at
// once.
func (w *meteringWriter) passEvents(p []byte) error {
	w.pending = append(w.pending, p...)
	for {
		end := w.eventEnd()
		if end < 0 {
			return nil
		}
		if ev := w.pending[:end]; !usage.IsUsageOnlyChunk(ev) {
			if _, err := w.ResponseWriter.Write(ev); err != nil {
				return err
			}
		}
		w.consume(end)
	}
}

// consume drops the first n bytes of pending, and reuses its room from the
// start once it is empty.
func (w *meteringWriter) consume(n int) {
	if n == len(w.pending) {
		w.pending = w.pending[:0]
		return
	}
	w.pending = w.pending[n:]
}

// passLeased writes the complete events of pending+p to the client, each
// once its output is held: an event that would take the running count past
// the lease waits for an extension, and ends the stream if it is refused.
// An event longer than usage.MaxEventBytes passes in parts, each counted.
func (w *meteringWriter) passLeased(p []byte) error {
	if w.truncated {
		return nil
	}
	w.pending = append(w.pending, p...)
	for !w.truncated {
		end := w.eventEnd()
		if end < 0 {
			if len(w.pending) <= usage.MaxEventBytes {
				return nil
			}
			end, w.scanned = len(w.pending), 0
		}
		if err := w.passLeasedEvent(w.pending[:end]); err != nil {
			return err
		}
		w.consume(end)
	}
	return nil
}

// eventEnd is the length of the first complete event in pending (an SSE
// event, or an NDJSON line), or -1; it remembers how far it scanned.
func (w *meteringWriter) eventEnd() int {
	if w.meter.Framing() == usage.NDJSON {
		i := bytes.IndexByte(w.pending[w.scanned:], '\n')
		if i < 0 {
			w.scanned = len(w.pending)
			return -1
		}
		end := w.scanned + i + 1
		w.scanned = 0
		return end
	}
	end := usage.EventEnd(w.pending, w.scanned)
	if end < 0 {
		w.scanned = len(w.pending)
		return -1
	}
	w.scanned = 0
	return end
}

// passLeasedEvent counts ev and writes it if its output is held; else it
// ends the stream with the API's terminal form.
func (w *meteringWriter) passLeasedEvent(ev []byte) error {
	w.meter.Write(ev)
	if w.lease.observe(w.meter.Reading()) && !w.lease.admit() {
		return w.truncate(ev)
	}
	if w.format == usage.OpenAIResponses {
		// What reaches the client, for the response object a cut ends with.
		if w.responses == nil {
			w.responses = new(usage.ResponsesOutput)
		}
		w.responses.Observe(ev)
	}
	if w.stripUsage && usage.IsUsageOnlyChunk(ev) {
		return nil
	}
	_, err := w.ResponseWriter.Write(ev)
	return err
}

// truncate ends the stream at its lease: the API's terminal form instead of
// withheld (the event that did not fit), the upstream request cancelled.
func (w *meteringWriter) truncate(withheld []byte) error {
	w.truncated = true
	w.cancelUpstream()
	l := w.lease
	metrics.llmTruncations.Inc()
	if h := l.h; h.events.wants(eventLLMBudgetTruncated) {
		h.events.emit(eventLLMBudgetTruncated, map[string]any{
			"budget": l.refusedBy, "reservation": l.res.ID, "held_output": l.held, "model": l.c.req.Model,
		})
	}
	r := w.meter.Reading()
	u := budget.Usage{InputTokens: l.c.req.PromptTokens, OutputTokens: l.held}
	if r.InputKnown {
		u = u.WithInputOf(r.Usage)
	}
	if _, err := w.ResponseWriter.Write(usage.Truncation(w.format, withheld, w.responses, u, w.clientAskedUsage)); err != nil {
		return err
	}
	_ = http.NewResponseController(w.ResponseWriter).Flush()
	return nil
}

// giveUpStripping ends the usage chunk's removal when an event grows past
// usage.MaxEventBytes without ending: what is held and p pass to the client
// at once, and so does the rest of the response. No usage chunk is that
// large, and holding an event that never ends would grow without bound. The
// meter still reads the whole stream.
func (w *meteringWriter) giveUpStripping(p []byte) error {
	metrics.llmOversizedEvents.Inc()
	w.stripUsage, w.scanned = false, 0
	pending := w.pending
	w.pending = nil
	if _, err := w.ResponseWriter.Write(pending); err != nil {
		return err
	}
	_, err := w.ResponseWriter.Write(p)
	return err
}

// ReadFrom copies through Write so that the body is observed; the wrapped
// writer's own ReadFrom would bypass it.
func (w *meteringWriter) ReadFrom(r io.Reader) (int64, error) {
	return io.Copy(writeOnly{w}, r)
}

// Flush sends what was written to the client now.
func (w *meteringWriter) Flush() {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	_ = http.NewResponseController(w.ResponseWriter).Flush()
}

func (w *meteringWriter) observe(p []byte) {
	switch {
	case w.status < 200 || w.status >= 300 || w.opaque:
	case w.meter != nil:
		w.meter.Write(p)
	case w.overflow:
	case len(w.capture)+len(p) > maxUsageCapture:
		w.overflow, w.capture = true, nil
	default:
		w.capture = append(w.capture, p...)
	}
}

// drain writes out what is left of an incomplete last event when the
// response ends (a stream that did not end with a blank line).
func (w *meteringWriter) drain() {
	if w.lease != nil && w.meter != nil {
		if len(w.pending) > 0 && !w.truncated {
			_ = w.passLeasedEvent(w.pending)
		}
		w.pending = nil
		return
	}
	if len(w.pending) > 0 && !usage.IsUsageOnlyChunk(w.pending) {
		_, _ = w.ResponseWriter.Write(w.pending)
	}
	w.pending = nil
}

// outcome is how a response ended, for the settle.
type outcome struct {
	source usageSource
	usage  budget.Usage
}

// usageSource is where a settle's usage comes from, the usage_source label.
type usageSource uint8

const (
	// sourceReleased: the upstream answered an error, or could not be
	// reached: nothing to bill, the reservation is released.
	sourceReleased usageSource = iota
	// sourceReserved: a success with no readable usage: the reservation is
	// kept, never free.
	sourceReserved
	// sourceAbandoned: the client went away after the request was
	// forwarded, before a response: the upstream bills it, so the
	// reservation is kept.
	sourceAbandoned
	// sourceReported: the upstream reported the usage.
	sourceReported
	// sourceEstimated: a stream cut before its usage report, charged the
	// prompt and the output seen.
	sourceEstimated
)

// usageSources are every usageSource.
var usageSources = [...]usageSource{sourceReleased, sourceReserved, sourceAbandoned, sourceReported, sourceEstimated}

func (s usageSource) String() string {
	return [...]string{"released", "reserved", "abandoned", "reported", "estimated"}[s]
}

// keepsReservation reports whether the settle charges what was reserved
// (the usage is unknown, and the upstream bills the request).
func (s usageSource) keepsReservation() bool { return s == sourceReserved || s == sourceAbandoned }

// charged reports whether the settle charges usage that was read.
func (s usageSource) charged() bool { return s == sourceReported || s == sourceEstimated }

// outcome decides what the response used: promptEstimate and outputCap are
// the reservation's input estimate and output cap (an estimate never charges
// more output than was reserved); gone says the client went away.
func (w *meteringWriter) outcome(promptEstimate, outputCap int64, gone bool) outcome {
	// Nothing reached the client, which went away: 499 is what Caddy's
	// reverse_proxy writes for a client that closed the request.
	if gone && (w.status == 0 || w.status == statusClientClosed) {
		return outcome{source: sourceAbandoned}
	}
	if w.status == 0 || w.status < 200 || w.status >= 300 {
		return outcome{source: sourceReleased}
	}
	if w.meter == nil {
		if w.overflow || w.opaque {
			return outcome{source: sourceReserved}
		}
		if u, ok := usage.FromJSON(w.format, w.capture); ok {
			return outcome{usage: u, source: sourceReported}
		}
		return outcome{source: sourceReserved}
	}
	w.meter.Close()
	r := w.meter.Reading()
	switch {
	case r.Complete:
		return outcome{usage: r.Usage, source: sourceReported}
	case r.Bytes == 0 && gone:
		// The client left before the first byte; the upstream had started.
		return outcome{source: sourceAbandoned}
	case r.Bytes == 0:
		// A stream that ended before any output: nothing was delivered.
		return outcome{source: sourceReleased}
	}
	// The stream ended (or the client left) after output started but before
	// a usage event: charge the prompt plus the output seen so far.
	u := budget.Usage{InputTokens: promptEstimate, ServiceTier: r.Usage.ServiceTier}
	if r.InputKnown {
		u = u.WithInputOf(r.Usage)
	}
	// The strict bound of the text, or the lease's count (the tokenizer's
	// for a tokenized model): the upstream bills no more for it.
	if w.lease != nil {
		u.OutputTokens = max(r.Usage.OutputTokens, w.lease.count, w.lease.bound())
	} else {
		u.OutputTokens = max(r.Usage.OutputTokens, usage.OutputTokenBound(r.OutputTextBytes))
	}
	u.OutputTokens = min(u.OutputTokens, outputCap)
	return outcome{usage: u, source: sourceEstimated}
}

// finish decides, once, what the response used and hands the settle to the
// background. It runs deferred, so it also runs when the client goes away,
// the upstream fails or a later handler panics.
func (h *LLMBudget) finish(r *http.Request, res *budget.Reservation, mw *meteringWriter, c *call) {
	mw.drain()
	promptEstimate, outputCap := c.req.PromptTokens, c.outputCap*c.req.N
	if l := mw.lease; l != nil {
		// The extension in flight ends before the settle reads the
		// reservation; what is held bounds an estimate.
		l.wait()
		outputCap = l.charge()
	}
	out := mw.outcome(promptEstimate, outputCap, r.Context().Err() != nil)
	if out.source == sourceEstimated && out.usage.ServiceTier == budget.StandardTier {
		// No tier said: the one reserved for, the worst it asked for.
		out.usage.ServiceTier = c.req.ServiceTier
	}
	if c.history != nil && mw.meter != nil && out.source == sourceReported && !mw.truncated {
		// What the answer showed against what it billed, leased or not
		// (a model on probation holds its cap until it is proven).
		read := mw.meter.Reading()
		bound := usage.OutputTokenBound(read.OutputTextBytes)
		a := answerSeen{count: max(bound, read.Usage.OutputTokens), bound: bound, text: read.OutputTextBytes,
			proxy: c.proxy, reported: out.usage.OutputTokens}
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
		if news := c.history.learn(a); news != "" {
			h.logger.Warn(news, zap.String("model", c.req.Model), zap.Int64("reported_output", a.reported),
				zap.Int64("text_bytes", a.text), zap.Int64("tokenizer_count", a.tokens), zap.Bool("proxy", a.proxy))
		}
	}
	spend, err := c.price.SpendOf(out.usage)
	if err != nil {
		// No request uses that much, or less than nothing: the report is
		// broken or hostile, so the usage is unknown and the reservation
		// stands, as for a response that reports none.
		metrics.llmInvalidUsage.Inc()
		h.logger.Warn("the upstream reported usage out of range; the reservation is kept",
			zap.String("reservation", res.ID), zap.Error(err))
		out, spend = outcome{source: sourceReserved}, budget.Spend{}
	}
	reserved := promptEstimate + outputCap
	// The response reaches the client first: the settle runs after this
	// handler has returned, off the response path.
	h.store.settleLater(func() { h.settle(res, out, spend, reserved, c.model) })
}

type writeOnly struct{ io.Writer }
