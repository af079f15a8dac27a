package fleetguard

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"

	"github.com/caddyserver/caddy/v2"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/internal/wsframe"
)

// A Gemini Live session (…BidiGenerateContent upgraded) is budgeted a turn
// at a time, each held at its worst case before it can start
// (llmbudget_turns.go): the model's context window of input, and of output
// the cap forwarded as the setup's generationConfig.maxOutputTokens plus
// the thinking the setup allows (its thinkingConfig.thinkingBudget, else
// liveThinking). A turn the client asks for (clientContent with
// turnComplete, toolResponse, or activityEnd with automatic activity
// detection off) is held before it goes up; while automatic activity
// detection is on (the default), realtimeInput goes up only with a
// standing hold for the turn the server may start from it. Each turn
// settles to the usageMetadata the server reports for it (the largest of a
// turn's snapshots). Live has no error message that keeps a session open:
// a refusal ends it with a close frame naming the reason, as Google's own
// errors do. Audio transcription (billed in ways the turn's usage does not
// show) and any setup field or message llmbudget does not know are
// refused.

// liveThinking is what a Gemini Live turn is held for thinking when the
// setup does not bound it: the largest thinking budget Gemini models take.
const liveThinking = 32768

// live is one budgeted Gemini Live session.
type live struct {
	*turns
	repl *caddy.Replacer
	cap  int64 // the output cap forwarded in the setup

	// under turns.mu
	conn    *socketConn
	setup   bool // the setup went up
	closing bool // a refusal ended the session: nothing more goes up
	// cur is the turn the server is generating, or has ended and not yet
	// reported (done); usage is the largest snapshot it reported.
	cur       *socketResponse
	done      bool
	usage     budget.Usage
	usageSeen bool
}

func (h *LLMBudget) newLive(r *http.Request, repl *caddy.Replacer, c *call) *live {
	capped, _ := h.outputCap(c.req)
	return &live{turns: &turns{h: h, r: r, identity: *c, output: max(capped, 1), audioRates: true, auto: true}, repl: repl, cap: max(capped, 1)}
}

func (s *live) attach(conn *socketConn) []byte {
	s.mu.Lock()
	s.conn = conn
	s.mu.Unlock()
	return nil
}

// liveSetupFields are the setup fields llmbudget knows, as the API reads
// them (proto JSON: lowerCamel or the proto's own names).
var liveSetupFields = fieldSet("model", "generationConfig", "generation_config", "systemInstruction", "system_instruction",
	"tools", "realtimeInputConfig", "realtime_input_config", "sessionResumption", "session_resumption",
	"contextWindowCompression", "context_window_compression", "proactivity", "enableAffectiveDialog", "enable_affective_dialog")

// liveGenerationFields are the generationConfig fields llmbudget knows.
var liveGenerationFields = fieldSet("maxOutputTokens", "max_output_tokens", "temperature", "topP", "top_p", "topK", "top_k",
	"responseModalities", "response_modalities", "speechConfig", "speech_config", "mediaResolution", "media_resolution",
	"presencePenalty", "presence_penalty", "frequencyPenalty", "frequency_penalty", "seed", "thinkingConfig", "thinking_config",
	"candidateCount", "candidate_count", "enableAffectiveDialog", "enable_affective_dialog")

func fieldSet(names ...string) map[string]bool {
	m := make(map[string]bool, len(names))
	for _, n := range names {
		m[n] = true
	}
	return m
}

// clientMessage decides one client message: the setup (rewritten), a
// turn asked for (held), input (held for, while the server may answer it
// on its own), or a refusal that ends the session.
func (s *live) clientMessage(op byte, payload []byte) []byte {
	s.mu.Lock()
	closing, setup := s.closing, s.setup
	s.mu.Unlock()
	if closing {
		return nil
	}
	var msg map[string]json.RawMessage
	if op != wsframe.OpText && op != wsframe.OpBinary || json.Unmarshal(payload, &msg) != nil || len(msg) != 1 {
		return s.refuse("invalid_request", "llmbudget reads a Live session's client messages as JSON objects of one message each; this one is not")
	}
	if repeatsKey(payload) {
		return s.refuse("ambiguous_request", "the message repeats a key (or gives it in two cases): which one the upstream reads is not defined")
	}
	var kind string
	var body json.RawMessage
	for kind, body = range msg {
	}
	if setup == (kind == "setup") {
		return s.refuse("invalid_request", "a Live session's setup must be its first message, and its only setup")
	}
	switch kind {
	case "setup":
		return s.setupMessage(body)
	case "clientContent", "client_content":
		var cc map[string]json.RawMessage
		_ = json.Unmarshal(body, &cc)
		if string(cc["turnComplete"]) == "true" || string(cc["turn_complete"]) == "true" {
			return s.askFor(payload)
		}
	case "realtimeInput", "realtime_input":
		var in map[string]json.RawMessage
		_ = json.Unmarshal(body, &in)
		s.mu.Lock()
		auto := s.auto
		s.mu.Unlock()
		if !auto && (in["activityEnd"] != nil || in["activity_end"] != nil) {
			return s.askFor(payload)
		}
		if ref := s.holdForAudio(); ref != nil {
			s.refuseWith(ref)
			return nil
		}
	case "toolResponse", "tool_response":
		return s.askFor(payload) // the model goes on
	default:
		return s.refuse("unbudgeted_event", fmt.Sprintf("llmbudget does not forward Live message %q on a budgeted session", kind))
	}
	return wsframe.Append(nil, wsframe.OpText, payload, true)
}

// askFor holds a turn the client asks for, and forwards its message.
func (s *live) askFor(payload []byte) []byte {
	if _, ref := s.ask(); ref != nil {
		s.refuseWith(ref)
		return nil
	}
	return wsframe.Append(nil, wsframe.OpText, payload, true)
}

// setupMessage reads the setup: the model, the thinking it allows, whether
// the server detects activity; and forwards it with its output cap.
func (s *live) setupMessage(body json.RawMessage) []byte {
	var setup map[string]json.RawMessage
	if json.Unmarshal(body, &setup) != nil {
		return s.refuse("invalid_request", "setup must be an object")
	}
	for field := range setup {
		if strings.Contains(strings.ToLower(field), "transcription") && !s.h.neutralFields[field] {
			return s.refuse("unbudgeted_transcription", fmt.Sprintf("llmbudget does not budget audio transcription (%s), whose tokens a turn's usage does not show; send the setup without it", field))
		}
		if !liveSetupFields[field] && !s.h.neutralFields[field] {
			return s.refuse("unknown_field", fmt.Sprintf("setup field %q is not one llmbudget knows, so it cannot bound what the session bills for it; remove it (or list it in neutral_fields if it changes nothing billed)", field))
		}
	}
	gen, ref := s.generationConfig(setup)
	if ref != nil {
		s.refuseWith(ref)
		return nil
	}
	var model string
	_ = json.Unmarshal(setup["model"], &model)
	model = strings.TrimPrefix(model, "models/")
	var ric struct {
		AAD  *struct{ Disabled bool } `json:"automaticActivityDetection"`
		AAD2 *struct{ Disabled bool } `json:"automatic_activity_detection"`
	}
	_ = json.Unmarshal(firstOf(setup, "realtimeInputConfig", "realtime_input_config"), &ric)
	s.mu.Lock()
	s.identity.req.Model, s.identity.dims.Model = model, model
	s.auto = !(ric.AAD != nil && ric.AAD.Disabled || ric.AAD2 != nil && ric.AAD2.Disabled)
	s.setup = true
	s.mu.Unlock()
	delete(setup, "generation_config")
	setup["generationConfig"], _ = json.Marshal(gen)
	out, _ := json.Marshal(map[string]any{"setup": setup})
	return wsframe.Append(nil, wsframe.OpText, out, true)
}

// generationConfig is the setup's generationConfig with maxOutputTokens at
// most s.cap; it sets what a turn holds for output.
func (s *live) generationConfig(setup map[string]json.RawMessage) (map[string]json.RawMessage, *refusal) {
	gen := map[string]json.RawMessage{}
	_ = json.Unmarshal(firstOf(setup, "generationConfig", "generation_config"), &gen)
	for field := range gen {
		if !liveGenerationFields[field] && !s.h.neutralFields[field] {
			return nil, &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "unknown_field",
				message: fmt.Sprintf("generationConfig field %q is not one llmbudget knows; remove it (or list it in neutral_fields if it changes nothing billed)", field)}
		}
	}
	if n := firstOf(gen, "candidateCount", "candidate_count"); n != nil && string(n) != "1" {
		return nil, &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "invalid_request", message: "a Live session answers one candidate: candidateCount must be 1"}
	}
	capped := s.cap
	if v := firstOf(gen, "maxOutputTokens", "max_output_tokens"); v != nil {
		var n int64
		if json.Unmarshal(v, &n) == nil && n > 0 {
			capped = min(n, s.cap)
		}
	}
	delete(gen, "max_output_tokens")
	gen["maxOutputTokens"], _ = json.Marshal(capped)
	// (Both spellings of a field in one message are refused before: repeatsKey.)
	var thinking map[string]json.RawMessage
	_ = json.Unmarshal(firstOf(gen, "thinkingConfig", "thinking_config"), &thinking)
	think := int64(liveThinking)
	if b := int64(-1); json.Unmarshal(firstOf(thinking, "thinkingBudget", "thinking_budget"), &b) == nil && b >= 0 {
		think = b
	}
	s.mu.Lock()
	s.output = capped + think
	s.mu.Unlock()
	return gen, nil
}

// firstOf is the first of the fields present in m.
func firstOf(m map[string]json.RawMessage, fields ...string) json.RawMessage {
	for _, f := range fields {
		if v, ok := m[f]; ok {
			return v
		}
	}
	return nil
}

// liveServerMessage is what of a server message the budget reads.
type liveServerMessage struct {
	ServerContent *struct {
		ModelTurn    json.RawMessage `json:"modelTurn"`
		TurnComplete bool            `json:"turnComplete"`
		Interrupted  bool            `json:"interrupted"`
	} `json:"serverContent"`
	ToolCall      json.RawMessage `json:"toolCall"`
	UsageMetadata *liveUsage      `json:"usageMetadata"`
}

// liveMarks are the members of a server message that end a turn or
// report its usage.
var liveMarks = marks("usageMetadata", "turnComplete", "interrupted", "toolCall")

// serverEvent meters one server message: model output begins a turn (the
// first hold asked for, else the standing one); a turn that ended settles
// at its usage.
func (s *live) serverEvent(payload []byte) {
	s.mu.Lock()
	generating := s.cur != nil && !s.done
	s.mu.Unlock()
	if generating && !mentionsAny(payload, liveMarks) {
		return // more of the turn in progress: nothing to decide
	}
	var m liveServerMessage
	if json.Unmarshal(payload, &m) != nil {
		return
	}
	generating = m.ToolCall != nil || m.ServerContent != nil && m.ServerContent.ModelTurn != nil
	s.mu.Lock()
	defer s.mu.Unlock()
	if generating && (s.cur == nil || s.done) {
		s.settleCur()
		s.mu.Unlock()
		resp := s.begin()
		s.mu.Lock()
		s.cur, s.done, s.usage, s.usageSeen = resp, false, budget.Usage{}, false
	}
	if s.cur == nil {
		return
	}
	if u := m.UsageMetadata; u != nil {
		s.usage, s.usageSeen = u.max(s.usage), true
	}
	if m.ToolCall != nil || m.ServerContent != nil && (m.ServerContent.TurnComplete || m.ServerContent.Interrupted) {
		s.done = true
	}
	if s.done && s.usageSeen {
		s.settleCur()
	}
}

// settleCur settles the current turn (under turns.mu): to its usage, or
// its whole hold when it reported none.
func (s *live) settleCur() {
	if s.cur == nil {
		return
	}
	out := outcome{source: sourceReserved}
	if s.usageSeen {
		out = outcome{usage: s.usage, source: sourceReported}
	}
	settleSocketResponse(s.h, s.cur, out)
	s.cur = nil
}

// end settles the turn in progress (kept whole unless it reported its
// usage) and what the turns keep.
func (s *live) end() {
	s.mu.Lock()
	s.settleCur()
	s.mu.Unlock()
	s.turns.end()
}

// refuse ends the session with a close frame naming the reason.
func (s *live) refuse(code, message string) []byte {
	s.refuseWith(&refusal{kind: refusedRequest, status: http.StatusBadRequest, code: code, message: message})
	return nil
}

// refuseWith counts a refusal and ends the session with a close frame
// (1008, policy violation) whose reason is the API's status, the code and
// the message, as far as a close frame's 123 bytes go.
func (s *live) refuseWith(ref *refusal) {
	rec := &bufferedAnswer{hdr: http.Header{}}
	_ = s.h.answer(rec, s.repl, &s.identity, ref)
	var body geminiError
	_ = json.Unmarshal(rec.body.Bytes(), &body)
	reason := fmt.Sprintf("%s (%s): %s", body.Error.Status, ref.code, strings.TrimSuffix(body.Error.Message, " ("+ref.code+")"))
	if len(reason) > 123 {
		reason = strings.ToValidUTF8(reason[:123], "")
	}
	s.mu.Lock()
	s.closing = true
	conn := s.conn
	s.mu.Unlock()
	if conn != nil {
		conn.send(wsframe.Append(nil, wsframe.OpClose, append(binary.BigEndian.AppendUint16(nil, 1008), reason...), false))
	}
}

// liveUsage is a Live turn's usageMetadata.
type liveUsage struct {
	PromptTokenCount        int64               `json:"promptTokenCount"`
	CachedContentTokenCount int64               `json:"cachedContentTokenCount"`
	ResponseTokenCount      int64               `json:"responseTokenCount"`
	ToolUsePromptTokenCount int64               `json:"toolUsePromptTokenCount"`
	ThoughtsTokenCount      int64               `json:"thoughtsTokenCount"`
	PromptTokensDetails     []liveModalityCount `json:"promptTokensDetails"`
	ResponseTokensDetails   []liveModalityCount `json:"responseTokensDetails"`
}

type liveModalityCount struct {
	Modality   string `json:"modality"`
	TokenCount int64  `json:"tokenCount"`
}

func audioOf(details []liveModalityCount) int64 {
	var n int64
	for _, d := range details {
		if d.Modality == "AUDIO" {
			n += d.TokenCount
		}
	}
	return n
}

// max is the larger of u and a usage seen before, field by field: a turn's
// snapshots only grow.
func (u *liveUsage) max(seen budget.Usage) budget.Usage {
	return budget.Usage{
		InputTokens:       max(seen.InputTokens, u.PromptTokenCount+u.ToolUsePromptTokenCount),
		CachedInputTokens: max(seen.CachedInputTokens, u.CachedContentTokenCount),
		AudioInputTokens:  max(seen.AudioInputTokens, audioOf(u.PromptTokensDetails)),
		OutputTokens:      max(seen.OutputTokens, u.ResponseTokenCount+u.ThoughtsTokenCount),
		ReasoningTokens:   max(seen.ReasoningTokens, u.ThoughtsTokenCount),
		AudioOutputTokens: max(seen.AudioOutputTokens, audioOf(u.ResponseTokensDetails)),
	}
}
