package fleetguard

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/wsframe"
)

// A WebSocket session of the Responses API (its WebSocket mode: GET
// /v1/responses upgraded, then response.create client events whose fields
// are those of POST /v1/responses) is budgeted one response at a time: each
// response.create is estimated and reserved like a request body, forwarded
// with its output cap, and refused with an error event (the socket stays
// open) when it does not fit; the server's events of each response are
// metered and settle it to the usage its response.completed reports. Each
// response holds its whole cap (no lease), so the upstream can bill no more
// than is held whatever it streams. A continuation of the socket's last
// response (previous_response_id) holds the input and output that response
// reported, not the context window. Any other client message, and a
// message that is not text, is refused with an error event: the closed
// world holds on the socket too.

// serveSocket forwards the upgrade with its messages metered, and keeps the
// reservation of every response still in flight when the session ends.
func (h *LLMBudget) serveSocket(w http.ResponseWriter, r *http.Request, repl *caddy.Replacer, next caddyhttp.Handler, c *call) error {
	h.identify(r, repl, c)
	if ref := h.requireScopes(c); ref != nil {
		return h.refuse(w, r, repl, next, c, ref)
	}
	// The messages must be readable: no permessage-deflate.
	r.Header.Del("Sec-WebSocket-Extensions")
	var s socketSession
	switch c.socket {
	case socketRealtime:
		s = h.newRealtime(r, repl, c)
	case socketLive:
		s = h.newLive(r, repl, c)
	default:
		s = &socket{h: h, r: r, repl: repl, identity: *c}
	}
	defer s.end()
	return next.ServeHTTP(&socketWriter{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, s: s, maxClientMessage: h.maxRequestBody}, r)
}

// socketKind is the protocol of a budgeted WebSocket session.
type socketKind uint8

const (
	notSocket       socketKind = iota
	socketResponses            // the Responses API's WebSocket mode
	socketRealtime             // the Realtime API
	socketLive                 // Gemini Live
)

// socketSession is a protocol's reading of a budgeted session: what of each
// client message goes up, the metering of each server message, and what
// the session keeps when it ends.
type socketSession interface {
	// clientMessage is what of a client message goes up, framed: the
	// message (possibly rewritten) or nothing.
	clientMessage(op byte, payload []byte) []byte
	// serverEvent meters one message of the upstream.
	serverEvent(payload []byte)
	// attach gives the session its connection once the proxy has it, and
	// returns frames of the session's own to send up before the client's.
	attach(conn *socketConn) []byte
	end()
}

// socket is one budgeted session.
type socket struct {
	h        *LLMBudget
	r        *http.Request
	repl     *caddy.Replacer
	identity call // the principal and team of the handshake

	mu sync.Mutex
	// responses are the responses forwarded and not yet settled, in the
	// order their response.create events went up.
	responses []*socketResponse
	// last is the socket's last completed response: a continuation of it
	// holds what it reported as input and output.
	lastID     string
	lastTokens int64
	conn       *socketConn
}

// socketResponse is one forwarded response.create and what its events
// reported; res is nil for one forwarded unbudgeted.
type socketResponse struct {
	c       call
	res     *budget.Reservation
	meter   *usage.Meter
	id      string
	created bool   // the server announced it (response.created)
	eventID string // the client event that asked for it (Realtime)
}

// socketWriter hands reverse_proxy a connection whose messages are read.
type socketWriter struct {
	*caddyhttp.ResponseWriterWrapper
	s                socketSession
	maxClientMessage int64 // max_request_body
}

// Hijack takes the client's connection, with the bytes the server had read
// past the handshake, through the meter.
func (w *socketWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, brw, err := http.NewResponseController(w.ResponseWriter).Hijack()
	if err != nil {
		return nil, nil, err
	}
	sc := &socketConn{Conn: conn, s: w.s}
	sc.in.Max, sc.out.Max = int(w.maxClientMessage), maxSocketMessage
	sc.ready = w.s.attach(sc)
	if n := brw.Reader.Buffered(); n > 0 {
		early, _ := brw.Peek(n)
		if err := sc.fromClient(append([]byte(nil), early...)); err != nil {
			conn.Close()
			return nil, nil, err
		}
	}
	return sc, bufio.NewReadWriter(bufio.NewReader(sc), bufio.NewWriter(sc)), nil
}

// maxSocketMessage bounds an upstream message the socket reads (its frames
// are bounded alike).
const maxSocketMessage = 16 << 20

// socketConn is the client's connection: what the proxy reads of it passes
// message by message, each response.create once it is reserved; what the
// proxy writes to it is metered.
type socketConn struct {
	net.Conn
	s socketSession

	// client → upstream, read by the proxy's goroutine
	in    wsframe.Parser
	rbuf  []byte
	ready []byte // released bytes the proxy has not read
	msg   []byte // the payload of the message being read, unmasked
	msgOp byte

	// upstream → client, written by the proxy's goroutine and by refusals
	wmu    sync.Mutex
	out    wsframe.Parser
	outMsg []byte
	queued []byte // error events of ours, written at the next frame boundary
}

// Read gives the proxy the client's bytes, a message once it is released.
func (c *socketConn) Read(p []byte) (int, error) {
	for len(c.ready) == 0 {
		if c.rbuf == nil {
			c.rbuf = make([]byte, 32<<10)
		}
		n, err := c.Conn.Read(c.rbuf)
		if n > 0 {
			if perr := c.fromClient(c.rbuf[:n]); perr != nil {
				return 0, perr
			}
		}
		if err != nil {
			if len(c.ready) > 0 {
				break
			}
			return 0, err
		}
	}
	n := copy(p, c.ready)
	c.ready = c.ready[n:]
	return n, nil
}

// fromClient reads the client's frames in b: control frames pass at once,
// a message once the socket has decided it (clientMessage).
func (c *socketConn) fromClient(b []byte) error {
	c.in.Feed(b)
	defer c.in.Keep()
	for {
		f, ok, err := c.in.Next()
		if err != nil {
			return fmt.Errorf("llmbudget: a client message on the socket: %w", err)
		}
		if !ok {
			return nil
		}
		if f.IsControl() {
			c.ready = append(c.ready, f.Raw...)
			continue
		}
		if f.Opcode != wsframe.OpContinuation {
			c.msgOp = f.Opcode
		}
		if f.RSV != 0 {
			c.msgOp = 0 // an extension's frame: not a message llmbudget reads
		}
		if c.msg = append(c.msg, f.Payload...); len(c.msg) > c.in.Max {
			return fmt.Errorf("llmbudget: a client message on the socket is over max_request_body (%d bytes)", c.in.Max)
		}
		if f.Fin {
			c.ready = append(c.ready, c.s.clientMessage(c.msgOp, c.msg)...)
			c.msg = c.msg[:0]
		}
	}
}

// Write passes the upstream's bytes to the client and meters its messages;
// an error event of ours waiting for a frame's end follows it.
func (c *socketConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	n, err := c.Conn.Write(p)
	if perr := c.fromUpstream(p[:n]); perr != nil && err == nil {
		err = perr // the session ends: its responses keep what they hold
	}
	if err == nil && len(c.queued) > 0 && c.out.Pending() == 0 {
		_, err = c.Conn.Write(c.queued)
		c.queued = c.queued[:0]
	}
	return n, err
}

// fromUpstream meters the upstream's messages in b. A frame or message it
// cannot read (over maxSocketMessage) ends the session: past it, neither
// the messages nor the frames' boundaries are known.
func (c *socketConn) fromUpstream(b []byte) error {
	c.out.Feed(b)
	defer c.out.Keep()
	for {
		f, ok, err := c.out.Next()
		if err != nil {
			return fmt.Errorf("llmbudget: an upstream message on the socket: %w", err)
		}
		if !ok {
			return nil
		}
		if f.IsControl() {
			continue
		}
		if c.outMsg = append(c.outMsg, f.Payload...); len(c.outMsg) > maxSocketMessage {
			return fmt.Errorf("llmbudget: an upstream message on the socket is over %d bytes", maxSocketMessage)
		}
		if f.Fin {
			c.s.serverEvent(c.outMsg)
			c.outMsg = c.outMsg[:0]
		}
	}
}

// event sends an event of ours to the client, at a frame boundary of the
// upstream's stream.
func (c *socketConn) event(payload []byte) {
	c.send(wsframe.Append(nil, wsframe.OpText, payload, false))
}

// send sends a frame of ours to the client, at a frame boundary of the
// upstream's stream.
func (c *socketConn) send(frame []byte) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.out.Pending() > 0 {
		c.queued = append(c.queued, frame...)
		return
	}
	_, _ = c.Conn.Write(frame)
}

// attach keeps the connection, for the error events of refusals.
func (s *socket) attach(conn *socketConn) []byte {
	s.mu.Lock()
	s.conn = conn
	s.mu.Unlock()
	return nil
}

// clientMessage is what of a client message goes up: a response.create
// reserved, with its cap, or nothing (a refusal's error event goes back).
func (s *socket) clientMessage(op byte, payload []byte) []byte {
	var ev struct {
		Type string `json:"type"`
	}
	if op != wsframe.OpText || json.Unmarshal(payload, &ev) != nil {
		s.refuseMessage(&refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "invalid_request",
			message: "llmbudget reads the socket's client events as JSON text messages; this one is not"}, &s.identity)
		return nil
	}
	if ev.Type != "response.create" {
		s.refuseMessage(&refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "unbudgeted_event",
			message: fmt.Sprintf("llmbudget does not forward client event %q on a budgeted socket: it budgets response.create only", ev.Type)}, &s.identity)
		return nil
	}
	return s.create(payload)
}

// create reserves a response.create and returns its frame to forward, its
// output cap in it; or refuses it.
func (s *socket) create(payload []byte) []byte {
	c := s.identity
	c.path, c.body = "/v1/responses", withoutType(payload)
	res, ref := s.gate(&c)
	if ref != nil {
		if s.h.enforced(ref) {
			s.refuseMessage(ref, &c)
			return nil
		}
		// Unbudgeted, as the client sent it; its place in the order keeps
		// the events of the responses after it theirs.
		s.enqueue(&socketResponse{c: c, meter: usage.NewMeter(usage.OpenAIResponses, usage.NDJSON)})
		return wsframe.Append(nil, wsframe.OpText, payload, true)
	}
	s.enqueue(&socketResponse{c: c, res: res, meter: usage.NewMeter(usage.OpenAIResponses, usage.NDJSON)})
	return wsframe.Append(nil, wsframe.OpText, withType(c.forward), true)
}

// enqueue adds a forwarded response.create to the responses in flight.
func (s *socket) enqueue(resp *socketResponse) {
	s.mu.Lock()
	s.responses = append(s.responses, resp)
	s.mu.Unlock()
}

// gate runs a response.create through the phases of a request: parse, the
// continuation of the socket's last response, bound, price, reserve. A
// socket's response holds its whole cap.
func (s *socket) gate(c *call) (*budget.Reservation, *refusal) {
	h := s.h
	if ref := h.parse(c); ref != nil {
		return nil, ref
	}
	s.continuation(c)
	if ref := h.bound(c); ref != nil {
		return nil, ref
	}
	if ref := h.priceEstimate(c); ref != nil {
		return nil, ref
	}
	res, ref := h.reserve(s.r, c)
	if ref == nil {
		h.countAll(decisionAdmitted)
	}
	return res, ref
}

// continuation bounds the input of a response that continues the socket's
// last one by what that one reported: its input and output, which the
// upstream reads again, besides the new input the body shows.
func (s *socket) continuation(c *call) {
	if c.req.HiddenInput != "previous_response_id" {
		return
	}
	var body struct {
		PreviousResponseID string `json:"previous_response_id"`
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if json.Unmarshal(c.body, &body) == nil && body.PreviousResponseID != "" && body.PreviousResponseID == s.lastID {
		c.req.PromptTokens += s.lastTokens
		c.req.HiddenInput = ""
	}
}

// refuseMessage counts a refusal and answers it with an error event.
func (s *socket) refuseMessage(ref *refusal, c *call) {
	s.mu.Lock()
	conn := s.conn
	s.mu.Unlock()
	refuseOnSocket(s.h, s.repl, conn, ref, c)
}

// refuseOnSocket counts a refusal of a client event and answers it with an
// error event in the API's shape: {"type":"error","status":429,"error":{...}}.
func refuseOnSocket(h *LLMBudget, repl *caddy.Replacer, conn *socketConn, ref *refusal, c *call) {
	if ref.kind == refusedBudget {
		ref.now = time.Now()
	}
	rec := &bufferedAnswer{hdr: http.Header{}}
	_ = h.answer(rec, repl, c, ref)
	body := bytes.TrimSpace(rec.body.Bytes())
	if len(body) < 2 || body[0] != '{' || conn == nil {
		return
	}
	ev := fmt.Appendf(nil, `{"type":"error","status":%d,`, rec.status)
	conn.event(append(ev, body[1:]...))
}

// serverEvent meters one event of the upstream: it belongs to the oldest
// response not settled; its terminal event settles it.
func (s *socket) serverEvent(payload []byte) {
	var typ, id string
	if mentionsAny(payload, responsesMarks) {
		typ, id = responseEventOf(payload) // else a delta: the meter reads it
	}
	s.mu.Lock()
	if len(s.responses) == 0 {
		s.mu.Unlock()
		return // nothing in flight: an event that bills nothing
	}
	resp := s.responses[0]
	_, _ = resp.meter.Write(payload)
	_, _ = resp.meter.Write([]byte{'\n'})
	switch typ {
	case "response.created":
		resp.created, resp.id = true, id
		s.mu.Unlock()
		return
	case "response.completed", "response.incomplete", "response.failed":
	case "error":
		// The upstream refused a response.create: the first one it has
		// not started (it takes them in order, one at a time), which
		// generated nothing. An error with every response started is
		// about one of them, which settles at its own end.
		for i, r := range s.responses {
			if !r.created {
				s.responses = append(s.responses[:i], s.responses[i+1:]...)
				s.mu.Unlock()
				s.settle(r, outcome{source: sourceReleased})
				return
			}
		}
		s.mu.Unlock()
		return
	default:
		s.mu.Unlock()
		return
	}
	s.responses = s.responses[1:]
	r := resp.meter.Reading()
	out := outcome{source: sourceReserved}
	if r.Complete {
		out = outcome{usage: r.Usage, source: sourceReported}
		s.lastID, s.lastTokens = cmp.Or(id, resp.id), r.Usage.InputTokens+r.Usage.OutputTokens
	}
	s.mu.Unlock()
	s.settle(resp, out)
}

// responseEventOf is an event's type and its response's id.
func responseEventOf(payload []byte) (typ, id string) {
	var ev struct {
		Type     string `json:"type"`
		Response struct {
			ID string `json:"id"`
		} `json:"response"`
	}
	_ = json.Unmarshal(payload, &ev)
	return ev.Type, ev.Response.ID
}

// responsesMarks are the event types the socket decides on; an event with
// none of them (a delta, most of a stream) is not decoded.
var responsesMarks = marks("response.created", "response.completed", "response.incomplete", "response.failed", "error")

// marks are the JSON strings of names, quoted as an event carries them.
func marks(names ...string) [][]byte {
	out := make([][]byte, len(names))
	for i, n := range names {
		out[i] = []byte(`"` + n + `"`)
	}
	return out
}

// mentionsAny reports whether payload holds any of the marks: an event of a
// type the session decides on always does (a string in the event's text
// holds its quotes escaped, so at worst it is decoded for nothing). An
// event that begins with its type, as OpenAI's do, is judged by it alone.
func mentionsAny(payload []byte, marks [][]byte) bool {
	if typ, ok := leadingType(payload); ok {
		for _, m := range marks {
			if bytes.Equal(typ, m) {
				return true
			}
		}
		return false
	}
	for _, m := range marks {
		if bytes.Contains(payload, m) {
			return true
		}
	}
	return false
}

// leadingType is the quoted type of an event that begins {"type":"…"
// with no escape in it.
func leadingType(payload []byte) ([]byte, bool) {
	const prefix = `{"type":`
	if !bytes.HasPrefix(payload, []byte(prefix)) || len(payload) < len(prefix)+2 || payload[len(prefix)] != '"' {
		return nil, false
	}
	rest := payload[len(prefix)+1:]
	end := bytes.IndexAny(rest, `"\`)
	if end < 0 || rest[end] != '"' {
		return nil, false
	}
	return payload[len(prefix) : len(prefix)+end+2], true
}

// repeatsKey reports whether the JSON value v has an object that gives a
// key twice, or in two spellings: two cases (Go's decoder reads keys in
// any case) or proto JSON's two (turnComplete, turn_complete). Decoders
// differ on which one they keep, and a client event forwarded as it was
// sent must be read the way the upstream reads it.
func repeatsKey(v []byte) bool {
	type level struct {
		keys    map[string]bool // nil: an array
		wantKey bool
	}
	var stack []level
	dec := json.NewDecoder(bytes.NewReader(v))
	for {
		tok, err := dec.Token()
		if err != nil {
			return false // the end (a value that is not JSON is refused apart)
		}
		var top *level
		if len(stack) > 0 {
			top = &stack[len(stack)-1]
		}
		switch t := tok.(type) {
		case json.Delim:
			switch t {
			case '{':
				stack = append(stack, level{keys: map[string]bool{}, wantKey: true})
			case '[':
				stack = append(stack, level{})
			default:
				stack = stack[:len(stack)-1]
				if len(stack) > 0 && stack[len(stack)-1].keys != nil {
					stack[len(stack)-1].wantKey = true
				}
			}
		case string:
			if top != nil && top.keys != nil && top.wantKey {
				k := strings.ToLower(strings.ReplaceAll(t, "_", ""))
				if top.keys[k] {
					return true
				}
				top.keys[k], top.wantKey = true, false
				continue
			}
			if top != nil && top.keys != nil {
				top.wantKey = true
			}
		default:
			if top != nil && top.keys != nil {
				top.wantKey = true
			}
		}
	}
}

// settle settles one response of the socket off the socket's path.
func (s *socket) settle(resp *socketResponse, out outcome) { settleSocketResponse(s.h, resp, out) }

// settleSocketResponse settles one response of a session off the session's
// path (one forwarded unbudgeted, in shadow mode or fail_open, has nothing
// to settle).
func settleSocketResponse(h *LLMBudget, resp *socketResponse, out outcome) {
	if resp.res == nil {
		return
	}
	c := &resp.c
	spend, err := c.price.SpendOf(out.usage)
	if err != nil {
		metrics.llmInvalidUsage.Inc()
		out, spend = outcome{source: sourceReserved}, budget.Spend{}
	}
	reserved := c.req.PromptTokens + c.outputCap*c.req.N
	dims := c.dims
	h.engines.settleLater(func() { h.settle(resp.res, out, spend, reserved, c.model, dims) })
}

// end keeps the reservation of every response still in flight when the
// session ends: the upstream had its response.create.
func (s *socket) end() {
	s.mu.Lock()
	left := s.responses
	s.responses = nil
	s.mu.Unlock()
	for _, resp := range left {
		s.settle(resp, outcome{source: sourceAbandoned})
	}
}

// withoutType is a client event's body without its "type" member: the
// fields of POST /v1/responses.
func withoutType(event []byte) []byte {
	out := make([]byte, 0, len(event))
	out = append(out, '{')
	usage.EachMember(event, func(key string, member []byte) {
		if key == "type" {
			return
		}
		if len(out) > 1 {
			out = append(out, ',')
		}
		out = append(out, member...)
	})
	return append(out, '}')
}

// withType is a request body as a response.create event.
func withType(body []byte) []byte {
	out := append([]byte(nil), `{"type":"response.create"`...)
	if rest := bytes.TrimSpace(body[1:]); len(rest) > 1 {
		out = append(out, ',')
		out = append(out, rest...)
		return out
	}
	return append(out, '}')
}

// bufferedAnswer keeps an answer written as an HTTP response.
type bufferedAnswer struct {
	hdr    http.Header
	status int
	body   bytes.Buffer
}

func (b *bufferedAnswer) Header() http.Header { return b.hdr }

func (b *bufferedAnswer) Write(p []byte) (int, error) { return b.body.Write(p) }

func (b *bufferedAnswer) WriteHeader(status int) { b.status = status }
