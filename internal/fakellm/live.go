package fakellm

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"sync/atomic"

	"github.com/fleetguard/fleetguard/internal/wsframe"
)

// Live is an honest stand-in for Gemini Live (…BidiGenerateContent
// upgraded). After the setup (answered setupComplete), a turn is answered
// when the client completes one (clientContent with turnComplete), sends a
// toolResponse, or, with automatic activity detection on (the default),
// sends realtimeInput: Tokens tokens of audio (at most the setup's
// maxOutputTokens) in serverContent messages, and Thinking tokens of
// thought (at most the setup's thinkingBudget, which maxOutputTokens does
// not bound), then turnComplete with the turn's usageMetadata. Every turn
// reads the whole conversation (at most Window tokens when Window is set):
// text a token a word, audio AudioBytesPerToken decoded bytes a token. It
// sends its messages as binary frames, as Google's does. Each turn is billed
// its input and output.
type Live struct {
	Tokens, Thinking   int
	Window             int64
	AudioBytesPerToken int

	billed, turns, inputs, uncapped atomic.Int64
}

// Billed is every token billed so far.
func (s *Live) Billed() int64 { return s.billed.Load() }

// Turns is how many turns were answered.
func (s *Live) Turns() int64 { return s.turns.Load() }

// Inputs is how many realtimeInput messages arrived.
func (s *Live) Inputs() int64 { return s.inputs.Load() }

// Uncapped is how many turns ran with no maxOutputTokens.
func (s *Live) Uncapped() int64 { return s.uncapped.Load() }

type liveSession struct {
	send                   func(string)
	cap, thinking          int64
	auto                   bool
	conversation, turnsRun int64
}

func (s *Live) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	serveSocket(w, r, wsframe.OpBinary, func(send func(string)) func([]byte) {
		sess := &liveSession{auto: true, thinking: -1, send: send}
		return func(msg []byte) { s.message(sess, msg) }
	})
}

// message answers one client message.
func (s *Live) message(sess *liveSession, msg []byte) {
	var m struct {
		Setup *struct {
			GenerationConfig struct {
				MaxOutputTokens int64 `json:"maxOutputTokens"`
				ThinkingConfig  *struct {
					ThinkingBudget *int64 `json:"thinkingBudget"`
				} `json:"thinkingConfig"`
			} `json:"generationConfig"`
			RealtimeInputConfig struct {
				AutomaticActivityDetection struct{ Disabled bool } `json:"automaticActivityDetection"`
			} `json:"realtimeInputConfig"`
		} `json:"setup"`
		ClientContent *struct {
			Turns []struct {
				Parts []struct{ Text string } `json:"parts"`
			} `json:"turns"`
			TurnComplete bool `json:"turnComplete"`
		} `json:"clientContent"`
		RealtimeInput *struct {
			Audio *struct{ Data string } `json:"audio"`
		} `json:"realtimeInput"`
		ToolResponse json.RawMessage `json:"toolResponse"`
	}
	if json.Unmarshal(msg, &m) != nil {
		return
	}
	switch {
	case m.Setup != nil:
		g := m.Setup.GenerationConfig
		sess.cap = g.MaxOutputTokens
		if g.ThinkingConfig != nil && g.ThinkingConfig.ThinkingBudget != nil {
			sess.thinking = *g.ThinkingConfig.ThinkingBudget
		}
		sess.auto = !m.Setup.RealtimeInputConfig.AutomaticActivityDetection.Disabled
		sess.send(`{"setupComplete":{}}`)
	case m.ClientContent != nil:
		for _, t := range m.ClientContent.Turns {
			for _, p := range t.Parts {
				sess.conversation += Tokens(p.Text)
			}
		}
		if m.ClientContent.TurnComplete {
			s.turn(sess)
		}
	case m.RealtimeInput != nil:
		s.inputs.Add(1)
		if m.RealtimeInput.Audio != nil {
			audio, _ := base64.StdEncoding.DecodeString(m.RealtimeInput.Audio.Data)
			sess.conversation += int64(len(audio) / max(s.AudioBytesPerToken, 1))
		}
		if sess.auto {
			s.turn(sess)
		}
	case m.ToolResponse != nil:
		s.turn(sess)
	}
}

// turn answers one turn.
func (s *Live) turn(sess *liveSession) {
	s.turns.Add(1)
	if sess.cap == 0 {
		s.uncapped.Add(1)
	}
	in := sess.conversation
	if s.Window > 0 {
		in = min(in, s.Window)
	}
	var out int64
	for ; out < int64(s.Tokens) && (sess.cap == 0 || out < sess.cap); out++ {
		sess.send(`{"serverContent":{"modelTurn":{"parts":[{"inlineData":{"mimeType":"audio/pcm;rate=24000","data":"AAAA"}}]}}}`)
	}
	thoughts := int64(s.Thinking)
	if sess.thinking >= 0 {
		thoughts = min(thoughts, sess.thinking)
	}
	s.billed.Add(in + out + thoughts)
	sess.conversation += out
	sess.send(fmt.Sprintf(`{"serverContent":{"turnComplete":true},"usageMetadata":{"promptTokenCount":%d,"responseTokenCount":%d,"thoughtsTokenCount":%d,"totalTokenCount":%d,"promptTokensDetails":[{"modality":"AUDIO","tokenCount":%d}],"responseTokensDetails":[{"modality":"AUDIO","tokenCount":%d}]}}`,
		in, out, thoughts, in+out+thoughts, in, out))
}
