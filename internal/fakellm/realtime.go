package fakellm

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"

	"github.com/fleetguard/fleetguard/internal/wsframe"
)

// Realtime is an honest stand-in for the Realtime API (GET /v1/realtime
// upgraded). A session starts with turn detection on and no output cap
// ("inf"), as the real one; session.update changes both. Every response
// reads the whole conversation (truncated to Window tokens when Window is
// set) and answers Tokens tokens of audio, at most its cap; text items add
// their words to the conversation, audio AudioBytesPerToken decoded bytes a
// token. With turn detection on, every input_audio_buffer.append ends a
// turn: the server commits it and answers it, as its voice activity
// detection would; input_audio_buffer.commit only commits. A
// response.create whose response's metadata names UnavailableModel as its
// "model" (as the real one refuses one it will not run), or any
// event it does not know, gets an error event naming the client's event
// id. Each response is billed its input and output.
type Realtime struct {
	Tokens             int
	Window             int64
	AudioBytesPerToken int

	billed, responses, appends, uncapped atomic.Int64
	maxCap                               atomic.Int64
}

// Billed is every token billed so far, input and output.
func (s *Realtime) Billed() int64 { return s.billed.Load() }

// Responses is how many responses were answered.
func (s *Realtime) Responses() int64 { return s.responses.Load() }

// Appends is how many input_audio_buffer.append events arrived.
func (s *Realtime) Appends() int64 { return s.appends.Load() }

// MaxCap is the largest output cap a response ran with.
func (s *Realtime) MaxCap() int64 { return s.maxCap.Load() }

// Uncapped is how many responses ran with no output cap ("inf").
func (s *Realtime) Uncapped() int64 { return s.uncapped.Load() }

// realtimeSession is one session's state.
type realtimeSession struct {
	send         func(string)
	cap          int64 // 0: inf
	auto         bool
	conversation int64
	n            int
}

func (s *Realtime) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	serveSocket(w, r, wsframe.OpText, func(send func(string)) func([]byte) {
		sess := &realtimeSession{auto: true, send: send}
		send(`{"type":"session.created","session":{"type":"realtime","max_output_tokens":"inf"}}`)
		return func(msg []byte) { s.event(sess, msg) }
	})
}

// event answers one client event.
func (s *Realtime) event(sess *realtimeSession, msg []byte) {
	var ev struct {
		Type    string          `json:"type"`
		EventID string          `json:"event_id"`
		Audio   string          `json:"audio"`
		Session json.RawMessage `json:"session"`
		Item    struct {
			Content []struct {
				Text string `json:"text"`
			} `json:"content"`
		} `json:"item"`
		Response struct {
			MaxOutputTokens json.RawMessage   `json:"max_output_tokens"`
			Metadata        map[string]string `json:"metadata"`
		} `json:"response"`
	}
	if json.Unmarshal(msg, &ev) != nil {
		sess.send(`{"type":"error","error":{"type":"invalid_request_error","code":"invalid_json","message":"not JSON"}}`)
		return
	}
	switch ev.Type {
	case "session.update":
		sess.update(ev.Session)
	case "conversation.item.create":
		for _, c := range ev.Item.Content {
			sess.conversation += Tokens(c.Text)
		}
	case "input_audio_buffer.append":
		s.appends.Add(1)
		audio, _ := base64.StdEncoding.DecodeString(ev.Audio)
		sess.conversation += int64(len(audio) / max(s.AudioBytesPerToken, 1))
		if sess.auto {
			sess.send(`{"type":"input_audio_buffer.committed","item_id":"item_audio"}`)
			s.respond(sess, sess.cap)
		}
	case "input_audio_buffer.commit", "input_audio_buffer.clear", "response.cancel":
	case "response.create":
		if ev.Response.Metadata["model"] == UnavailableModel {
			sess.send(fmt.Sprintf(`{"type":"error","error":{"type":"invalid_request_error","code":"model_not_found","message":"the fake serves no such model","event_id":%q}}`, ev.EventID))
			return
		}
		cap := sess.cap
		if ev.Response.MaxOutputTokens != nil {
			cap = capOf(ev.Response.MaxOutputTokens)
		}
		s.respond(sess, cap)
	default:
		sess.send(fmt.Sprintf(`{"type":"error","error":{"type":"invalid_request_error","code":"unknown_event","message":"unknown event","event_id":%q}}`, ev.EventID))
	}
}

// update applies a session.update: the cap and turn detection.
func (sess *realtimeSession) update(raw json.RawMessage) {
	var session struct {
		MaxOutputTokens json.RawMessage `json:"max_output_tokens"`
		Audio           struct {
			Input map[string]json.RawMessage `json:"input"`
		} `json:"audio"`
	}
	_ = json.Unmarshal(raw, &session)
	if session.MaxOutputTokens != nil {
		sess.cap = capOf(session.MaxOutputTokens)
	}
	if td, ok := session.Audio.Input["turn_detection"]; ok {
		sess.auto = string(td) != "null" && !jsonHasFalse(td, "create_response")
	}
	sess.send(`{"type":"session.updated","session":{"type":"realtime"}}`)
}

// respond answers one response: audio of Tokens tokens at most cap.
func (s *Realtime) respond(sess *realtimeSession, cap int64) {
	if cap == 0 {
		s.uncapped.Add(1)
	}
	for old := s.maxCap.Load(); cap > old && !s.maxCap.CompareAndSwap(old, cap); old = s.maxCap.Load() {
	}
	s.responses.Add(1)
	sess.n++
	id := "resp_" + strconv.Itoa(sess.n)
	in := sess.conversation
	if s.Window > 0 {
		in = min(in, s.Window)
	}
	sess.send(fmt.Sprintf(`{"type":"response.created","response":{"id":%q,"object":"realtime.response","status":"in_progress"}}`, id))
	var out int64
	for ; out < int64(s.Tokens) && (cap == 0 || out < cap); out++ {
		sess.send(fmt.Sprintf(`{"type":"response.output_audio.delta","response_id":%q,"item_id":"item_1","output_index":0,"content_index":0,"delta":"AAAAAAAA"}`, id))
	}
	s.billed.Add(in + out)
	sess.conversation += out
	sess.send(fmt.Sprintf(`{"type":"response.done","response":{"id":%q,"object":"realtime.response","status":"completed","usage":{"total_tokens":%d,"input_tokens":%d,"output_tokens":%d,"input_token_details":{"text_tokens":0,"audio_tokens":%d,"cached_tokens":0},"output_token_details":{"text_tokens":0,"audio_tokens":%d}}}}`,
		id, in+out, in, out, in, out))
}

// capOf is a max_output_tokens value: a number, or "inf" (0).
func capOf(v json.RawMessage) int64 {
	n, err := strconv.ParseInt(string(v), 10, 64)
	if err != nil {
		return 0
	}
	return n
}

// jsonHasFalse reports whether the object obj has field false.
func jsonHasFalse(obj json.RawMessage, field string) bool {
	var m map[string]json.RawMessage
	return json.Unmarshal(obj, &m) == nil && string(m[field]) == "false"
}
