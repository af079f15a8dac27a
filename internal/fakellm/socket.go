package fakellm

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync/atomic"

	"github.com/fleetguard/fleetguard/internal/wsframe"
)

// Socket is an honest stand-in for the Responses API's WebSocket mode (GET
// /v1/responses upgraded): each response.create client event is answered
// with response.created, text of Tokens tokens (a token a word, at most the
// event's max_output_tokens) in response.output_text.delta events and
// response.completed with its usage, and billed its input (a continued
// response's input and output too, as the upstream reads them again) and
// output; any other client event, and a response.create of
// UnavailableModel, gets an error event. It negotiates no
// extension.
type Socket struct {
	Tokens         int
	billed, events atomic.Int64
}

// UnavailableModel is a model the socket refuses with an error event, as an
// upstream refuses a response.create it will not serve.
const UnavailableModel = "unavailable-model"

// Billed is every token billed so far, input and output.
func (s *Socket) Billed() int64 { return s.billed.Load() }

// Events is how many client messages arrived.
func (s *Socket) Events() int64 { return s.events.Load() }

func (s *Socket) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	serveSocket(w, r, wsframe.OpText, func(send func(string)) func([]byte) {
		conversation := map[string]int64{} // a response's id → its input and output
		n := 0
		return func(msg []byte) {
			s.events.Add(1)
			n++
			s.answer(send, msg, fmt.Sprintf("resp_%d", n), conversation)
		}
	})
}

// answer answers one client message.
func (s *Socket) answer(send func(string), msg []byte, id string, conversation map[string]int64) {
	var ev struct {
		Type               string `json:"type"`
		Model              string `json:"model"`
		Input              any    `json:"input"`
		MaxOutputTokens    int64  `json:"max_output_tokens"`
		PreviousResponseID string `json:"previous_response_id"`
	}
	if json.Unmarshal(msg, &ev) != nil || ev.Type != "response.create" {
		send(`{"type":"error","error":{"type":"invalid_request_error","code":"unknown_event","message":"the fake answers response.create only"}}`)
		return
	}
	if ev.Model == UnavailableModel {
		send(`{"type":"error","error":{"type":"invalid_request_error","code":"model_not_found","message":"the fake serves no such model"}}`)
		return
	}
	input, _ := json.Marshal(ev.Input)
	in := Tokens(string(input)) + conversation[ev.PreviousResponseID]
	send(fmt.Sprintf(`{"type":"response.created","response":{"id":%q,"object":"response","status":"in_progress","output":[]}}`, id))
	var out int64
	for ; out < int64(s.Tokens) && (ev.MaxOutputTokens == 0 || out < ev.MaxOutputTokens); out++ {
		send(fmt.Sprintf(`{"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"content_index":0,"delta":%q}`, "ledger "))
	}
	s.billed.Add(in + out)
	conversation[id] = in + out
	send(fmt.Sprintf(`{"type":"response.completed","response":{"id":%q,"object":"response","status":"completed","output":[],"usage":{"input_tokens":%d,"output_tokens":%d,"total_tokens":%d}}}`, id, in, out, in+out))
}
