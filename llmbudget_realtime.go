package fleetguard

import (
	"cmp"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/internal/wsframe"
)

// A Realtime API session (GET /v1/realtime?model=… upgraded) is budgeted a
// response at a time, each held at its worst case, so what the upstream
// bills never passes what is held whatever the session says or speaks:
//
//   - input: the conversation the upstream reads for a response is at most
//     the model's context window (it truncates to it, or fails), which the
//     price table gives (max_input_tokens; context_window when it is
//     larger or unknown); audio and text alike, priced at the dearer rate;
//   - output: the session's and every response's cap is forwarded as
//     realtimeCap at most (the session's default, "inf", is replaced at
//     the start by a session.update of ours), and held whole: audio is not
//     counted as it streams.
//
// A response the client asks for (response.create) is reserved before it
// goes up and refused with an error event (the session stays open) when it
// does not fit. A response the server starts on its own from the audio it
// hears (turn detection, on by default) is held before that audio goes up:
// while turn detection may create responses, an input_audio_buffer.append
// is forwarded only with a standing hold for the next such response, and
// refused when none fits. Each response settles to the usage its
// response.done reports. Input audio transcription bills a model the
// session does not report per response, so it is refused; so is every
// other client event or session field llmbudget does not know.
//
// The one residual: a response the server starts from audio that went up
// before the standing hold it would have used was taken is charged past
// the limit (it is billed, never lost).

// realtimeCap is the largest output cap the Realtime API accepts for a
// response (max_output_tokens: an integer up to 4096, or "inf").
const realtimeCap = 4096

// realtime is one budgeted Realtime session.
type realtime struct {
	*turns
	repl *caddy.Replacer
	// beta: the session speaks the beta protocol (OpenAI-Beta:
	// realtime=v1), whose cap field is max_response_output_tokens.
	beta bool
	cap  int64 // every response's output cap, forwarded and held

	conn   *socketConn
	live   map[string]*socketResponse // created, by response id (under turns.mu)
	events int                        // client events given an id of ours
}

// newRealtime reads a Realtime handshake: the model from its query
// (?model=, or Azure's ?deployment=), the protocol version.
func (h *LLMBudget) newRealtime(r *http.Request, repl *caddy.Replacer, c *call) *realtime {
	q := r.URL.Query()
	model := q.Get("model")
	if d := q.Get("deployment"); d != "" {
		model, c.req.Deployment = d, true
		if m, ok := h.deployments[d]; ok {
			model = m
		}
	}
	c.req.Model, c.dims.Model = model, model
	capped, _ := h.outputCap(c.req)
	capped = min(max(capped, 1), realtimeCap)
	return &realtime{
		turns: &turns{h: h, r: r, identity: *c, output: capped, audioRates: true, auto: true},
		repl:  repl,
		beta: strings.Contains(r.Header.Get("OpenAI-Beta"), "realtime=v1") ||
			strings.Contains(r.Header.Get("Sec-WebSocket-Protocol"), "openai-beta.realtime-v1"),
		cap:  capped,
		live: map[string]*socketResponse{},
	}
}

// capField is the session's and a response's output cap field.
func (s *realtime) capField() string {
	if s.beta {
		return "max_response_output_tokens"
	}
	return "max_output_tokens"
}

// attach sends up, before any event of the client's, a session.update that
// caps every response at s.cap: the session's own default is "inf".
func (s *realtime) attach(conn *socketConn) []byte {
	s.mu.Lock()
	s.conn = conn
	s.mu.Unlock()
	session := fmt.Sprintf(`{%q:%d}`, s.capField(), s.cap)
	if !s.beta {
		session = fmt.Sprintf(`{"type":"realtime",%q:%d}`, s.capField(), s.cap)
	}
	return wsframe.Append(nil, wsframe.OpText, []byte(`{"type":"session.update","session":`+session+`}`), true)
}

// clientMessage decides one client event: forwarded as it is, forwarded
// rewritten (a cap, an event id of ours), or refused with an error event.
func (s *realtime) clientMessage(op byte, payload []byte) []byte {
	var ev map[string]json.RawMessage
	if op != wsframe.OpText || json.Unmarshal(payload, &ev) != nil {
		return s.refuse("invalid_request", "llmbudget reads the session's client events as JSON text messages; this one is not")
	}
	if repeatsKey(payload) {
		return s.refuse("ambiguous_request", "the event repeats a key (or gives it in two cases): which one the upstream reads is not defined")
	}
	var typ string
	_ = json.Unmarshal(ev["type"], &typ)
	switch typ {
	case "session.update":
		return s.sessionUpdate(ev)
	case "response.create":
		return s.responseCreate(ev)
	case "input_audio_buffer.append":
		if ref := s.holdForAudio(); ref != nil {
			s.refuseWith(ref, &s.identity)
			return nil
		}
	case "input_audio_buffer.commit", "input_audio_buffer.clear", "conversation.item.create", "conversation.item.retrieve",
		"conversation.item.truncate", "conversation.item.delete", "response.cancel", "output_audio_buffer.clear":
		// Input the next response reads (held at the context window) or
		// an end to output: nothing billed of its own.
	default:
		return s.refuse("unbudgeted_event", fmt.Sprintf("llmbudget does not forward client event %q on a budgeted Realtime session", typ))
	}
	return wsframe.Append(nil, wsframe.OpText, payload, true)
}

// realtimeSessionFields are the session fields llmbudget knows: none of
// them can make a response bill past its hold, but for transcription
// (refused) and the caps (rewritten).
var realtimeSessionFields = map[string]bool{
	"type": true, "object": true, "id": true, "model": true, "instructions": true, "audio": true,
	"output_modalities": true, "modalities": true, "tools": true, "tool_choice": true, "temperature": true,
	"max_output_tokens": true, "max_response_output_tokens": true, "tracing": true, "truncation": true,
	"prompt": true, "include": true, "voice": true, "speed": true, "input_audio_format": true,
	"output_audio_format": true, "input_audio_noise_reduction": true, "turn_detection": true,
	"input_audio_transcription": true, "expires_at": true, "client_secret": true,
}

// sessionUpdate forwards a session.update with its cap at most s.cap, and
// learns whether turn detection may start responses.
func (s *realtime) sessionUpdate(ev map[string]json.RawMessage) []byte {
	var session map[string]json.RawMessage
	if json.Unmarshal(ev["session"], &session) != nil {
		return s.refuse("invalid_request", "session.update needs a session object")
	}
	for field := range session {
		if !realtimeSessionFields[field] && !s.h.neutralFields[field] {
			return s.refuse("unknown_field", fmt.Sprintf("session field %q is not one llmbudget knows, so it cannot bound what the session bills for it; remove it (or list it in neutral_fields if it changes nothing billed)", field))
		}
	}
	var typ string
	_ = json.Unmarshal(session["type"], &typ)
	var input struct {
		Transcription json.RawMessage `json:"transcription"`
		TurnDetection json.RawMessage `json:"turn_detection"`
	}
	var audio struct {
		Input json.RawMessage `json:"input"`
	}
	_ = json.Unmarshal(session["audio"], &audio)
	_ = json.Unmarshal(audio.Input, &input)
	transcription := cmp.Or(string(input.Transcription), string(session["input_audio_transcription"]))
	if typ == "transcription" || (transcription != "" && transcription != "null") {
		return s.refuse("unbudgeted_transcription", "llmbudget does not budget input audio transcription (a model billed apart from the session's responses): send the session without it")
	}
	detection := input.TurnDetection
	if detection == nil {
		detection = session["turn_detection"]
	}
	if detection != nil {
		var td struct {
			CreateResponse *bool `json:"create_response"`
		}
		_ = json.Unmarshal(detection, &td)
		s.setAuto(string(detection) != "null" && (td.CreateResponse == nil || *td.CreateResponse))
	}
	for _, f := range []string{"max_output_tokens", "max_response_output_tokens"} {
		if _, ok := session[f]; ok {
			session[f] = s.capped(session[f])
		}
	}
	ev["session"], _ = json.Marshal(session)
	out, _ := json.Marshal(ev)
	return wsframe.Append(nil, wsframe.OpText, out, true)
}

// realtimeResponseFields are the fields of a response.create's response
// llmbudget knows.
var realtimeResponseFields = map[string]bool{
	"conversation": true, "input": true, "instructions": true, "metadata": true, "output_modalities": true,
	"modalities": true, "tools": true, "tool_choice": true, "temperature": true, "max_output_tokens": true,
	"max_response_output_tokens": true, "audio": true, "prompt": true, "voice": true, "output_audio_format": true,
}

// responseCreate reserves a response the client asks for and forwards it
// with its cap at most s.cap and an event id of ours (an upstream's error
// about it names that id), or refuses it.
func (s *realtime) responseCreate(ev map[string]json.RawMessage) []byte {
	var response map[string]json.RawMessage
	if raw := ev["response"]; raw != nil && string(raw) != "null" && json.Unmarshal(raw, &response) != nil {
		return s.refuse("invalid_request", "response.create's response must be an object")
	}
	for field := range response {
		if !realtimeResponseFields[field] && !s.h.neutralFields[field] {
			return s.refuse("unknown_field", fmt.Sprintf("response field %q is not one llmbudget knows, so it cannot bound what the response bills for it; remove it (or list it in neutral_fields if it changes nothing billed)", field))
		}
	}
	resp, ref := s.ask()
	if ref != nil {
		s.refuseWith(ref, &s.identity)
		return nil
	}
	for _, f := range []string{"max_output_tokens", "max_response_output_tokens"} {
		if _, ok := response[f]; ok {
			response[f] = s.capped(response[f])
		}
	}
	if response != nil {
		ev["response"], _ = json.Marshal(response)
	}
	s.mu.Lock()
	s.events++
	resp.eventID = cmp.Or(jsonString(ev["event_id"]), "fleetguard_"+strconv.Itoa(s.events))
	s.mu.Unlock()
	ev["event_id"], _ = json.Marshal(resp.eventID)
	out, _ := json.Marshal(ev)
	return wsframe.Append(nil, wsframe.OpText, out, true)
}

// capped is a cap field's value at most s.cap ("inf" is s.cap).
func (s *realtime) capped(v json.RawMessage) json.RawMessage {
	n, err := strconv.ParseInt(string(v), 10, 64)
	if err != nil || n <= 0 || n > s.cap {
		n = s.cap
	}
	return strconv.AppendInt(nil, n, 10)
}

// serverEvent meters one server event: a response created takes the hold
// asked for first, else the standing one; response.done settles it.
func (s *realtime) serverEvent(payload []byte) {
	if mentionsAny(payload, realtimeMarks) {
		s.decide(payload) // else a delta, most of a session: nothing to decide
	}
}

// decide acts on a server event of a type the session decides on.
func (s *realtime) decide(payload []byte) {
	var ev struct {
		Type     string `json:"type"`
		Response struct {
			ID    string         `json:"id"`
			Usage *realtimeUsage `json:"usage"`
		} `json:"response"`
		Error struct {
			EventID string `json:"event_id"`
		} `json:"error"`
	}
	if json.Unmarshal(payload, &ev) != nil {
		return
	}
	switch ev.Type {
	case "input_audio_buffer.committed":
		s.inputTaken()
	case "response.created":
		resp := s.begin()
		s.mu.Lock()
		s.live[ev.Response.ID] = resp
		s.mu.Unlock()
	case "response.done":
		s.mu.Lock()
		resp := s.live[ev.Response.ID]
		delete(s.live, ev.Response.ID)
		s.mu.Unlock()
		if resp == nil {
			return
		}
		out := outcome{source: sourceReserved}
		if u := ev.Response.Usage; u != nil {
			out = outcome{usage: u.usage(), source: sourceReported}
		}
		s.settle(resp, out)
	case "error":
		// The upstream refused a response.create: nothing began.
		s.drop(func(resp *socketResponse) bool { return resp.eventID != "" && resp.eventID == ev.Error.EventID })
	}
}

// settle settles one response of the session off the session's path.
func (s *realtime) settle(resp *socketResponse, out outcome) { settleSocketResponse(s.h, resp, out) }

// end keeps what every response created holds (the upstream bills it),
// and what the turns keep.
func (s *realtime) end() {
	s.mu.Lock()
	live := s.live
	s.live = map[string]*socketResponse{}
	s.mu.Unlock()
	for _, resp := range live {
		s.settle(resp, outcome{source: sourceAbandoned})
	}
	s.turns.end()
}

// refuse answers a client event with an error event and forwards nothing.
func (s *realtime) refuse(code, message string) []byte {
	s.refuseWith(&refusal{kind: refusedRequest, status: http.StatusBadRequest, code: code, message: message}, &s.identity)
	return nil
}

func (s *realtime) refuseWith(ref *refusal, c *call) {
	s.mu.Lock()
	conn := s.conn
	s.mu.Unlock()
	refuseOnSocket(s.h, s.repl, conn, ref, c)
}

// realtimeMarks are the server event types the session decides on.
var realtimeMarks = marks("input_audio_buffer.committed", "response.created", "response.done", "error")

// realtimeUsage is a Realtime response's usage (response.done).
type realtimeUsage struct {
	InputTokens       int64 `json:"input_tokens"`
	OutputTokens      int64 `json:"output_tokens"`
	InputTokenDetails struct {
		CachedTokens int64 `json:"cached_tokens"`
		AudioTokens  int64 `json:"audio_tokens"`
	} `json:"input_token_details"`
	OutputTokenDetails struct {
		AudioTokens int64 `json:"audio_tokens"`
	} `json:"output_token_details"`
}

func (u *realtimeUsage) usage() budget.Usage {
	return budget.Usage{
		InputTokens: u.InputTokens, CachedInputTokens: u.InputTokenDetails.CachedTokens,
		AudioInputTokens: u.InputTokenDetails.AudioTokens,
		OutputTokens:     u.OutputTokens, AudioOutputTokens: u.OutputTokenDetails.AudioTokens,
	}
}

// jsonString is a JSON string's value, or "".
func jsonString(raw json.RawMessage) string {
	var s string
	_ = json.Unmarshal(raw, &s)
	return s
}
