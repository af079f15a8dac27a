package fleetguard

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"strings"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/fakellm"
	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/internal/wait"
	"github.com/fleetguard/fleetguard/internal/wsframe"
)

const livePath = "/ws/google.ai.generativelanguage.v1beta.GenerativeService.BidiGenerateContent"

// liveBudget is Caddy with a budget of limit tokens in front of a
// fakellm.Live whose model reads a window of 20,000 tokens.
func liveBudget(t *testing.T, prefix string, limit int, up *fakellm.Live) (url string, counter func() int64) {
	t.Helper()
	return sessionBudget(t, prefix, limit, up, "default_max_tokens 3000")
}

// untilTurnOrClose reads up to a turn's end (true) or a close frame
// (false, its code and reason).
func (c *socketClient) untilTurnOrClose() (bool, uint16, string) {
	c.t.Helper()
	for {
		op, payload := c.frame()
		switch {
		case op == wsframe.OpClose && len(payload) >= 2:
			return false, binary.BigEndian.Uint16(payload), string(payload[2:])
		case op == wsframe.OpClose:
			return false, 0, ""
		case strings.Contains(string(payload), `"turnComplete":true`):
			return true, 0, ""
		}
	}
}

// A Gemini Live session through llmbudget is answered a turn at a time,
// each held at its worst case (the window, the cap forwarded as
// maxOutputTokens, the thinking the setup allows) and settled to its
// usageMetadata; the turn that does not fit ends the session with a close
// frame naming the budget, and is not forwarded.
func TestAGeminiLiveSessionIsBudgetedATurnAtATime(t *testing.T) {
	up := &fakellm.Live{Tokens: 2000, Thinking: 800, Window: 20000, AudioBytesPerToken: 1}
	url, counter := liveBudget(t, "live", 60000, up)
	c := dialSocket(t, url, livePath+"?key=k1")
	c.send(`{"setup":{"model":"models/gemini-2.0-flash-live-001","generationConfig":{"responseModalities":["AUDIO"],"thinkingConfig":{"thinkingBudget":500}},"realtimeInputConfig":{"automaticActivityDetection":{"disabled":true}}}}`)
	if op, payload := c.frame(); !strings.Contains(string(payload), "setupComplete") {
		t.Fatalf("the setup: %d %s", op, payload)
	}
	var answered int
	var code uint16
	var reason string
	for range 10 {
		c.send(`{"clientContent":{"turns":[{"role":"user","parts":[{"text":"tell me a story"}]}],"turnComplete":true}}`)
		var ok bool
		if ok, code, reason = c.untilTurnOrClose(); !ok {
			break
		}
		answered++
	}
	got, billed := counter(), up.Billed()
	t.Logf("%d turns answered, then close %d %q; counter %d, billed %d", answered, code, reason, got, billed)
	if answered == 0 || code != 1008 || !strings.Contains(reason, "RESOURCE_EXHAUSTED (token_budget_exceeded)") || got > 60000 || billed > got {
		t.Fatalf("%d answered, close %d %q; counter %d of 60,000, billed %d: want turns answered, then a 1008 close naming RESOURCE_EXHAUSTED, the counter within the limit and the bill within it",
			answered, code, reason, got, billed)
	}
	if up.Turns() != int64(answered) || up.Uncapped() != 0 {
		t.Fatalf("the upstream ran %d turns for %d held, %d uncapped: want only the held, each capped", up.Turns(), answered, up.Uncapped())
	}
}

// A setup llmbudget cannot bound is refused before it goes up: audio
// transcription, a field it does not know.
func TestAGeminiLiveSetupItCannotBoundIsRefused(t *testing.T) {
	up := &fakellm.Live{Tokens: 10}
	url, _ := liveBudget(t, "livesetup", 60000, up)
	for _, setup := range []struct{ body, want string }{
		{`{"setup":{"model":"models/m","outputAudioTranscription":{}}}`, "unbudgeted_transcription"},
		{`{"setup":{"model":"models/m","frobnicate":true}}`, "unknown_field"},
		{`{"clientContent":{"turnComplete":true}}`, "setup must be its first message"},
		{`{"setup":{"model":"models/m","generationConfig":{"maxOutputTokens":10,"max_output_tokens":100000}}}`, "ambiguous_request"},
	} {
		c := dialSocket(t, url, livePath)
		c.send(setup.body)
		if ok, code, reason := c.untilTurnOrClose(); ok || code != 1008 || !strings.Contains(reason, setup.want) {
			t.Errorf("%s: close %d %q, want 1008 naming %s", setup.body, code, reason, setup.want)
		}
	}
	if up.Turns() != 0 {
		t.Fatalf("the upstream answered %d turns of refused setups", up.Turns())
	}
}

// With automatic activity detection on (the default), the server answers
// the audio it hears: each turn is held before its audio goes up.
func TestGeminiLiveAudioIsHeldBeforeItGoesUp(t *testing.T) {
	up := &fakellm.Live{Tokens: 1000, Window: 20000, AudioBytesPerToken: 1}
	url, counter := liveBudget(t, "liveaudio", 60000, up)
	c := dialSocket(t, url, livePath)
	c.send(`{"setup":{"model":"models/gemini-2.0-flash-live-001","generationConfig":{"thinkingConfig":{"thinkingBudget":0}}}}`)
	c.frame()
	audio := base64.StdEncoding.EncodeToString(make([]byte, 2000))
	var answered int
	for range 10 {
		c.send(`{"realtimeInput":{"audio":{"mimeType":"audio/pcm;rate=16000","data":"` + audio + `"}}}`)
		if ok, _, _ := c.untilTurnOrClose(); !ok {
			break
		}
		answered++
	}
	got, billed := counter(), up.Billed()
	t.Logf("%d turns answered; counter %d, billed %d", answered, got, billed)
	if answered == 0 || answered == 10 || got > 60000 || billed > got || up.Inputs() != int64(answered) {
		t.Fatalf("%d answered (upstream heard %d inputs); counter %d of 60,000, billed %d: want some answered, then the session ended, refused audio not forwarded, the counter within the limit and the bill within it",
			answered, up.Inputs(), got, billed)
	}
}

// A store stall longer than the client's timeout refuses the turn caught in
// it: Live ends the session (1008, UNAVAILABLE) and the turn is not
// forwarded; a new session is served once the store answers, and nothing
// refused was charged.
func TestAGeminiLiveTurnInAStoreStallIsRefusedAndNotCharged(t *testing.T) {
	up := &fakellm.Live{Tokens: 50, Window: 2000}
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	url, counter := sessionBudgetOn(t, srv, "livestall", 500000, up, "")
	setup := `{"setup":{"model":"models/gemini-2.0-flash-live-001","generationConfig":{"thinkingConfig":{"thinkingBudget":0}},"realtimeInputConfig":{"automaticActivityDetection":{"disabled":true}}}}`
	turn := `{"clientContent":{"turns":[{"role":"user","parts":[{"text":"hi"}]}],"turnComplete":true}}`
	c := dialSocket(t, url, livePath)
	c.send(setup)
	c.frame()
	c.send(turn)
	if ok, code, reason := c.untilTurnOrClose(); !ok {
		t.Fatalf("before the stall: close %d %q", code, reason)
	}
	rc := stallRedis(t, srv, "1")
	c.send(turn)
	if ok, code, reason := c.untilTurnOrClose(); ok || code != 1008 || !strings.Contains(reason, "budget_store_unavailable") || up.Turns() != 1 {
		t.Fatalf("during the stall: turn %v, close %d %q (upstream turns %d): want the session closed naming the store, the turn not forwarded", ok, code, reason, up.Turns())
	}
	wait.Poll(5*time.Second, func() bool { return rc.Ping(context.Background()).Err() == nil })
	served := wait.Poll(10*time.Second, func() bool {
		c := dialSocket(t, url, livePath)
		c.send(setup)
		c.frame()
		c.send(turn)
		ok, _, _ := c.untilTurnOrClose()
		return ok
	})
	if !served {
		t.Fatal("no session was served after the stall")
	}
	if got, billed := counter(), up.Billed(); got != billed {
		t.Fatalf("counter %d, billed %d: a refused turn must not be charged", got, billed)
	}
}
