package fleetguard

import (
	"fmt"
	"net/http"
	"strings"

	"golang.org/x/net/http/httpguts"

	"github.com/fleetguard/fleetguard/budget/usage"
)

// A budget is a ceiling only if nothing passes that it does not understand:
// what it cannot read is held at its worst case or refused, never passed as
// if it cost nothing (docs/architecture.md, "A closed world"). This file
// holds those decisions: protocol upgrades, body fields of no known class,
// output past the response, and outputs the meter does not count.

const (
	unknownFieldsHold   = "hold"
	unknownFieldsRefuse = "refuse"
)

// compileUnknown checks the options of what the budget does not understand.
func (h *LLMBudget) compileUnknown() error {
	switch h.UnknownFields {
	case "", unknownFieldsHold, unknownFieldsRefuse:
	default:
		return fmt.Errorf("llmbudget: unknown_fields %q: want hold or refuse", h.UnknownFields)
	}
	h.neutralFields = make(map[string]bool, len(h.NeutralFields))
	for _, f := range h.NeutralFields {
		if f == "" || strings.ContainsAny(f, " \t\"") {
			return fmt.Errorf("llmbudget: neutral_fields: %q is not a field name", f)
		}
		h.neutralFields[f] = true
	}
	for _, p := range h.PassUpgrades {
		if !strings.HasPrefix(p, "/") {
			return fmt.Errorf("llmbudget: pass_upgrades: %q: want a path pattern starting with /", p)
		}
	}
	return nil
}

// isUpgrade reports whether r asks to switch protocols (a WebSocket
// handshake, Connection: upgrade with an Upgrade header) or to tunnel (a
// CONNECT, which is how HTTP/2 and HTTP/3 carry a WebSocket): after it,
// what flows is not a request the budget reads.
func isUpgrade(r *http.Request) bool {
	if strings.EqualFold(r.Method, http.MethodConnect) {
		return true
	}
	return r.Header.Get("Upgrade") != "" && httpguts.HeaderValuesContainsToken(r.Header["Connection"], "upgrade")
}

// screenUpgrade decides a protocol upgrade, on any path: a WebSocket session
// generates as much as its client asks, event after event, through a
// handshake that looks like a read. A path in PassUpgrades is forwarded
// unbudgeted; a session llmbudget meters (the Responses API's WebSocket
// mode, the Realtime API, Gemini Live, over HTTP/1.1) is budgeted a
// response at a time (c.socket); any other (a CONNECT, a WebSocket over
// HTTP/2) is refused.
func (h *LLMBudget) screenUpgrade(r *http.Request, c *call) (budgeted bool, ref *refusal) {
	p := usage.NormalizePath(r.URL.Path)
	for _, pattern := range h.PassUpgrades {
		if globMatch(strings.ToLower(pattern), p) {
			return false, nil
		}
	}
	if c.format == usage.Unknown {
		c.format = usage.FormatFromPath(r.URL.Path)
	}
	if c.format == usage.OpenAIResponses && r.ProtoMajor == 1 && strings.EqualFold(r.Method, http.MethodGet) &&
		strings.EqualFold(r.Header.Get("Upgrade"), "websocket") {
		c.socket = socketResponses
		return true, nil
	}
	if r.ProtoMajor == 1 && strings.EqualFold(r.Method, http.MethodGet) && strings.EqualFold(r.Header.Get("Upgrade"), "websocket") {
		switch {
		case isRealtimePath(p):
			c.socket, c.format = socketRealtime, usage.OpenAIChat
			return true, nil
		case isLivePath(p):
			c.socket, c.format = socketLive, usage.Gemini
			return true, nil
		}
	}
	return false, &refusal{kind: refusedRequest, status: http.StatusForbidden, code: "unbudgeted_upgrade", noRetry: true,
		message: fmt.Sprintf("llmbudget does not meter this protocol upgrade (Upgrade: %q, %s %s), so it does not forward it: a session bills what it generates, unbudgeted; use the HTTP API or a session llmbudget meters (the Responses API's WebSocket mode, the Realtime API, Gemini Live, over HTTP/1.1), or list the path in pass_upgrades to forward it unbudgeted",
			r.Header.Get("Upgrade"), r.Method, p)}
}

// boundUnknown decides what a request holds for what its body asks that the
// budget cannot meter: it refuses output past the response (background)
// and a server's own cap above the cap forwarded, and holds the worst case
// of a field of no known class (or refuses it, by UnknownFields). A request
// asking for output the meter does not count (audio, images) holds its
// whole cap.
func (h *LLMBudget) boundUnknown(c *call) *refusal {
	req := &c.req
	if req.Background {
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "background_not_budgeted", body: c.body, noRetry: true,
			message: "background: true makes the upstream go on generating after the response ends or is cut, which a budget cannot meter; send the request without background"}
	}
	if req.ForeignCap > c.outputCap {
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "output_cap_too_large", body: c.body, noRetry: true,
			message: fmt.Sprintf("%s is %d, more than the output cap this request is held and forwarded with (%d): lower it", req.ForeignCapField, req.ForeignCap, c.outputCap)}
	}
	if req.UncountedOutput != "" {
		c.wholeCap = req.UncountedOutput + " output"
	}
	field := h.unknownField(req.UnknownFields)
	if field == "" {
		return nil
	}
	if h.UnknownFields == unknownFieldsRefuse {
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "unknown_field", body: c.body, noRetry: true,
			message: fmt.Sprintf("field %q is not one llmbudget knows for %s requests, so it cannot bound what the upstream bills for it; remove it (or list it in neutral_fields if it changes nothing billed)", field, c.format)}
	}
	c.wholeCap = "field " + field
	req.PromptTokens = max(req.PromptTokens, h.contextWindow)
	c.holdNote = fmt.Sprintf("(the request has field %q, which llmbudget does not know, so it is held at its worst case: context_window, %d tokens, and its whole output cap)", field, h.contextWindow)
	return nil
}

// isRealtimePath reports whether p is the Realtime API's WebSocket
// endpoint: /v1/realtime (Azure: /openai/realtime), under any prefix.
func isRealtimePath(p string) bool {
	return strings.HasSuffix(p, "/realtime")
}

// isLivePath reports whether p is Gemini Live's WebSocket endpoint
// (…GenerativeService.BidiGenerateContent, its Constrained form for
// ephemeral tokens, Vertex AI's …LlmBidiService/BidiGenerateContent).
func isLivePath(p string) bool {
	return strings.HasSuffix(p, "bidigeneratecontent") || strings.HasSuffix(p, "bidigeneratecontentconstrained")
}

// unknownField is the first of fields the operator did not name neutral.
func (h *LLMBudget) unknownField(fields []string) string {
	for _, f := range fields {
		if !h.neutralFields[f] {
			return f
		}
	}
	return ""
}
