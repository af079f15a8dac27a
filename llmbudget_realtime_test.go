package fleetguard

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/fakellm"
	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/internal/wait"
)

// realtimeBudget is Caddy with a budget of limit tokens in front of a
// fakellm.Realtime whose model reads a window of 20,000 tokens and answers
// answer tokens of audio; counter reads the budget's counter.
func realtimeBudget(t *testing.T, prefix string, limit, answer int) (url string, up *fakellm.Realtime, counter func() int64) {
	t.Helper()
	up = &fakellm.Realtime{Tokens: answer, Window: 20000, AudioBytesPerToken: 1}
	url, counter = sessionBudget(t, prefix, limit, up, "")
	return url, up, counter
}

// sessionBudget is Caddy with a budget g of limit tokens and
// context_window 20000 (and the options given) on a Redis of its own, in
// front of up; counter reads g's counter.
func sessionBudget(t *testing.T, prefix string, limit int, up http.Handler, options string) (url string, counter func() int64) {
	t.Helper()
	return sessionBudgetOn(t, redistest.Start(t), prefix, limit, up, options)
}

// sessionBudgetOn is sessionBudget on the Redis given.
func sessionBudgetOn(t *testing.T, srv *redistest.Server, prefix string, limit int, up http.Handler, options string) (url string, counter func() int64) {
	t.Helper()
	upSrv := httptest.NewServer(up)
	t.Cleanup(upSrv.Close)
	port := freePort(t)
	startCaddy(t, llmCaddyfile(port, upSrv.URL, "fleetguard {\n redis "+srv.URL()+"\n prefix "+prefix+"\n }",
		fmt.Sprintf("budget g {\n unit tokens\n limit %d\n window 1h\n }\n context_window 20000\n %s", limit, options)))
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { rc.Close() })
	return fmt.Sprintf("http://127.0.0.1:%d", port), func() int64 { return budgetCounter(t, rc, prefix, "g") }
}

// errorCode is an error event's status and code.
func errorCode(t *testing.T, payload []byte) (int, string) {
	t.Helper()
	var ev struct {
		Status int
		Error  struct{ Code string }
	}
	if json.Unmarshal(payload, &ev) != nil {
		t.Fatalf("an error event that is not JSON: %s", payload)
	}
	return ev.Status, ev.Error.Code
}

// A Realtime session through llmbudget is served a response at a time, each
// held at its worst case (the window of 20,000 tokens and the cap of 4,096
// llmbudget forwards in place of the session's "inf") and settled to the
// usage its response.done reports, until the budget is spent; then
// response.create gets an error event (429), is not forwarded, and the
// session stays open. What llmbudget does not know is refused with an
// error event and not forwarded: another client event, a session field,
// input audio transcription.
func TestARealtimeSessionIsBudgetedAResponseAtATime(t *testing.T) {
	url, up, counter := realtimeBudget(t, "realtime", 60000, 3000)
	c := dialSocket(t, url, "/v1/realtime?model=gpt-realtime")
	c.until("session.created")
	c.send(`{"type":"session.update","session":{"type":"realtime","max_output_tokens":"inf","audio":{"input":{"turn_detection":null}}}}`)
	c.until("session.updated")
	for _, refused := range []struct{ event, code string }{
		{`{"type":"transcription_session.update","session":{}}`, "unbudgeted_event"},
		{`{"type":"session.update","session":{"type":"realtime","n":4}}`, "unknown_field"},
		{`{"type":"session.update","session":{"type":"realtime","audio":{"input":{"transcription":{"model":"whisper-1"}}}}}`, "unbudgeted_transcription"},
		// A response smuggled past the budget as audio, for an upstream
		// that keeps the first of two keys.
		{`{"type":"response.create","type":"input_audio_buffer.append","audio":""}`, "ambiguous_request"},
		{`{"type":"session.update","session":{"type":"realtime","max_output_tokens":10,"Max_Output_Tokens":"inf"}}`, "ambiguous_request"},
	} {
		c.send(refused.event)
		if _, payload := c.until("error"); !strings.Contains(string(payload), refused.code) {
			t.Fatalf("%s: %s, want an error event with code %s", refused.event, payload, refused.code)
		}
	}
	var completed, refused int
	for range 8 {
		c.send(`{"type":"conversation.item.create","item":{"type":"message","role":"user","content":[{"type":"input_text","text":"tell me a long story"}]}}`)
		c.send(`{"type":"response.create","response":{"max_output_tokens":"inf"}}`)
		switch typ, payload := c.until("response.done", "error"); typ {
		case "response.done":
			completed++
		default:
			if status, code := errorCode(t, payload); status != http.StatusTooManyRequests || code != "token_budget_exceeded" {
				t.Fatalf("a refusal reads %s, want status 429 and code token_budget_exceeded", payload)
			}
			refused++
		}
	}
	got, billed := counter(), up.Billed()
	t.Logf("%d completed, %d refused; counter %d, billed %d; upstream caps: max %d, uncapped %d", completed, refused, got, billed, up.MaxCap(), up.Uncapped())
	if completed == 0 || refused == 0 || got > 60000 || billed > got {
		t.Fatalf("%d completed, %d refused; counter %d of 60,000, billed %d: want both, the counter within the limit and the bill within it", completed, refused, got, billed)
	}
	if up.Responses() != int64(completed) || up.Uncapped() != 0 || up.MaxCap() != realtimeCap {
		t.Fatalf("the upstream ran %d responses for %d admitted, %d uncapped, caps up to %d: want only the admitted, each capped at %d",
			up.Responses(), completed, up.Uncapped(), up.MaxCap(), realtimeCap)
	}
	// An upstream's error about a response.create releases its hold.
	before := counter()
	c.send(`{"type":"response.create","response":{"metadata":{"model":"` + fakellm.UnavailableModel + `"}}}`)
	if typ, payload := c.until("response.done", "error"); typ != "error" {
		t.Fatalf("a response the upstream refuses: %s", payload)
	}
	if after := counter(); after != before {
		t.Fatalf("counter %d → %d after a response.create the upstream refused: its hold must be released", before, after)
	}
}

// With turn detection on (the session's default), the server starts a
// response from the audio it hears, with no response.create: each turn is
// held before its audio goes up, and audio that finds no room is refused
// with an error event, not forwarded.
func TestRealtimeAudioIsHeldBeforeItGoesUp(t *testing.T) {
	url, up, counter := realtimeBudget(t, "rtaudio", 60000, 2000)
	c := dialSocket(t, url, "/v1/realtime?model=gpt-realtime")
	c.until("session.created")
	audio := base64.StdEncoding.EncodeToString(make([]byte, 2_000)) // 2,000 tokens of the fake's audio
	var answered, refused int
	for range 8 {
		c.send(`{"type":"input_audio_buffer.append","audio":"` + audio + `"}`)
		switch typ, payload := c.until("response.done", "error"); typ {
		case "response.done":
			answered++
		default:
			if status, code := errorCode(t, payload); status != http.StatusTooManyRequests || code != "token_budget_exceeded" {
				t.Fatalf("audio refused with %s, want status 429 and code token_budget_exceeded", payload)
			}
			refused++
		}
	}
	got, billed := counter(), up.Billed()
	t.Logf("%d turns answered, %d appends refused; counter %d, billed %d", answered, refused, got, billed)
	if answered == 0 || refused == 0 || got > 60000 || billed > got {
		t.Fatalf("%d answered, %d refused; counter %d of 60,000, billed %d: want both, the counter within the limit and the bill within it", answered, refused, got, billed)
	}
	if up.Appends() != int64(answered) || up.Uncapped() != 0 {
		t.Fatalf("the upstream heard %d appends for %d held, and ran %d responses uncapped: want refused audio not forwarded, every response capped (the session's default is inf)",
			up.Appends(), answered, up.Uncapped())
	}
}

// A store stall longer than the client's timeout refuses the response.create
// caught in it with a 503 error event, not forwarded, and the session goes
// on: once the store answers, responses are served again, and nothing
// refused was charged.
func TestARealtimeSessionOutlivesAStoreStall(t *testing.T) {
	up := &fakellm.Realtime{Tokens: 50, Window: 2000}
	upSrv := httptest.NewServer(up)
	t.Cleanup(upSrv.Close)
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	port := freePort(t)
	startCaddy(t, llmCaddyfile(port, upSrv.URL, "fleetguard {\n redis "+srv.URL()+"\n prefix rtstall\n }",
		"budget g {\n unit tokens\n limit 500000\n window 1h\n }\n context_window 2000"))
	c := dialSocket(t, fmt.Sprintf("http://127.0.0.1:%d", port), "/v1/realtime?model=gpt-realtime")
	c.until("session.created")
	c.send(`{"type":"session.update","session":{"type":"realtime","audio":{"input":{"turn_detection":null}}}}`)
	c.until("session.updated")
	create := `{"type":"response.create"}`
	c.send(create)
	if typ, payload := c.until("response.done", "error"); typ != "response.done" {
		t.Fatalf("before the stall: %s", payload)
	}
	rc := stallRedis(t, srv, "1")
	before := up.Responses()
	c.send(create)
	if typ, payload := c.until("response.done", "error"); typ != "error" || !strings.Contains(string(payload), `"status":503`) || up.Responses() != before {
		t.Fatalf("during the stall: %s (upstream responses %d → %d), want a 503 error event, not forwarded", payload, before, up.Responses())
	}
	wait.Poll(5*time.Second, func() bool { return rc.Ping(context.Background()).Err() == nil })
	served := wait.Poll(10*time.Second, func() bool {
		c.send(create)
		typ, _ := c.until("response.done", "error")
		return typ == "response.done"
	})
	if !served {
		t.Fatal("the session served nothing after the stall")
	}
	if got, billed := budgetCounter(t, rc, "rtstall", "g"), up.Billed(); got != billed {
		t.Fatalf("counter %d, billed %d: a refused response.create must not be charged", got, billed)
	}
}
