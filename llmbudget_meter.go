package fleetguard

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"mime"
	"net/http"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
)

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
	lease          *lease
	cancelUpstream context.CancelFunc
	truncated      bool
	// responses keeps what a leased Responses stream output, for the
	// response object a truncation ends it with.
	responses *usage.ResponsesOutput
	// tokens, when not nil, is the model's tokenizer (or its proxy): the
	// meter counts the output by it too.
	tokens usage.TokenCounter
	// rawBytes, for a leased request answered with a body the meter does
	// not read as it passes (JSON, text, no Content-Type), counts that body:
	// each of its bytes is held as a token of output before it passes.
	rawBytes int64
	raw      bool
}

var (
	_ http.Flusher  = (*meteringWriter)(nil)
	_ io.ReaderFrom = (*meteringWriter)(nil)
)

// newMeteringWriter is the writer of an admitted request's response, and
// the request to forward: for a leased stream, one whose context the lease
// cancels when it cuts the stream, so that the upstream stops generating
// (and billing); finish releases it.
func newMeteringWriter(w http.ResponseWriter, r *http.Request, h *LLMBudget, res *budget.Reservation, c *call) (*meteringWriter, *http.Request) {
	mw := &meteringWriter{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, format: c.format,
		// The client did not ask for the usage chunk (or said no): it still
		// settles the budget, but the client does not see it.
		stripUsage: c.injectedUsage}
	if c.tokens != nil {
		mw.tokens = c.tokens
		if c.proxy {
			mw.tokens = proxyCounter{c.tokens}
		}
	}
	if c.leaseSize == 0 {
		return mw, r
	}
	ctx, cancel := context.WithCancel(r.Context())
	mw.lease, mw.cancelUpstream = newLease(h, res, c), cancel
	mw.lease.startGrant()
	return mw, r.WithContext(ctx)
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
// with a body the meter does not read as it passes (JSON, text, no
// Content-Type, an event stream under another label, an encoding). Where
// the whole cap does not fit, an unencoded body passes with each of its
// bytes held as a token of output before it passes (passRaw): no billed
// token is shorter than a byte, so whatever the body is, what passed is
// held, and it ends where the budget does. An encoded body's bytes bound
// nothing: the client gets the budget's refusal instead, the upstream
// request is cancelled, and the reservation is kept.
func (w *meteringWriter) holdAllOrRefuse() bool {
	if w.lease.holdAll() {
		return true
	}
	if !w.opaque {
		w.raw = true
		return true
	}
	ct, _, _ := mime.ParseMediaType(w.Header().Get("Content-Type"))
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
	if w.raw {
		return len(p), w.passRaw(p)
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
			if w.holdPending() {
				w.meter.Write(w.pending) // received, if not passed: the settle charges it
				return w.truncate(w.pending)
			}
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

// passRaw writes p once the lease holds every byte of the body so far as a
// token of output; when its extension is refused the body ends there and
// the upstream request is cancelled. The settle charges the usage the whole
// body reports, or keeps what the lease holds.
func (w *meteringWriter) passRaw(p []byte) error {
	w.rawBytes += int64(len(p))
	if w.lease.observe(usage.Reading{OutputTextBytes: w.rawBytes, Bytes: w.rawBytes}) && !w.lease.admit() {
		w.truncated = true
		w.cancelUpstream()
		metrics.llmTruncations.Inc()
		return nil
	}
	n, err := w.ResponseWriter.Write(p)
	w.observe(p[:n])
	return err
}

// unterminatedBytes is how much of an event not ended yet a leased stream
// takes in before it holds those bytes as output: the upstream bills what it
// generates whether or not it ends its events (an NDJSON body labelled as
// an event stream ends none), so past this, bytes that end no event are
// held a token a byte as they come, never metered only once they end.
const unterminatedBytes = 512

// holdPending holds the bytes of an event not ended yet, past
// unterminatedBytes, as output; it reports whether the lease could not hold
// them (the stream is cut there).
func (w *meteringWriter) holdPending() (cut bool) {
	if len(w.pending) <= unterminatedBytes {
		return false
	}
	return w.lease.observePending(int64(len(w.pending))) && !w.lease.admit()
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
	if _, err := w.ResponseWriter.Write(usage.Truncation(w.format, withheld, w.responses, u, l.c.req.IncludeUsage)); err != nil {
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

type writeOnly struct{ io.Writer }

// endTruncated lets a stream ended at its lease finish cleanly: cancelled,
// the upstream request makes reverse_proxy abort the response
// (http.ErrAbortHandler), which would cut the client's connection after the
// terminal form it already has. Any other panic goes on.
func endTruncated(mw *meteringWriter) {
	if !mw.truncated {
		return
	}
	if v := recover(); v != nil && v != http.ErrAbortHandler {
		panic(v)
	}
}
