package fleetguard

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/redistest"
)

// closedWorldSite is Caddy on a real Redis with one global token budget "g"
// of limit tokens in front of a fake upstream, with the llmbudget options
// given; reserved reads what an admitted response's RateLimit item says the
// request holds.
type closedWorldSite struct {
	url     string
	up      *upstream
	counter func() int64
	limit   int64
}

func newClosedWorldSite(t *testing.T, limit int64, options ...string) *closedWorldSite {
	t.Helper()
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	port := freePort(t)
	prefix := fmt.Sprintf("closed%d", port)
	startCaddy(t, llmCaddyfile(port, up.URL, "fleetguard {\n redis "+srv.URL()+"\n prefix "+prefix+"\n }",
		fmt.Sprintf("budget g {\n limit %d\n window 1h\n unit tokens\n }\n ratelimit_scopes global\n output_leases off\n %s", limit, strings.Join(options, "\n "))))
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { rc.Close() })
	return &closedWorldSite{url: fmt.Sprintf("http://127.0.0.1:%d", port), up: up, limit: limit,
		counter: func() int64 { return budgetCounter(t, rc, prefix, "g") }}
}

// held is what an admitted request held, read from its RateLimit item
// against the counter before it.
func (s *closedWorldSite) held(t *testing.T, resp *http.Response, before int64) int64 {
	t.Helper()
	r, _, _ := strings.Cut(strings.TrimPrefix(resp.Header.Get("RateLimit"), `"g";r=`), ";")
	return s.limit - before - mustInt(t, r)
}

// A protocol upgrade on a budgeted handler is never a read: a WebSocket
// session generates what its events ask for. One llmbudget does not meter
// (the Responses API's WebSocket mode, the Realtime API and Gemini Live
// are: llmbudget_socket_test.go, llmbudget_realtime_test.go,
// llmbudget_live_test.go) is
// refused, on a path llmbudget budgets or not, and nothing reaches the
// upstream, unless its path is listed in pass_upgrades.
func TestUpgradesAreRefusedUnlessPassed(t *testing.T) {
	s := newClosedWorldSite(t, 100_000, "pass_upgrades /ws/passed/*")
	for _, path := range []string{
		"/v1/audio/stream", // a WebSocket API llmbudget does not know
		"/v1/chat/completions",
	} {
		hits := s.up.Hits()
		resp, body := handshake(t, s.url, path)
		if resp.StatusCode != http.StatusForbidden || decodeError(t, body).Error.Code != "unbudgeted_upgrade" || s.up.Hits() != hits {
			t.Errorf("a WebSocket handshake to %s: %d %s (upstream hits %d → %d), want 403 unbudgeted_upgrade, not forwarded", path, resp.StatusCode, body, hits, s.up.Hits())
		}
		if resp.Header.Get("X-Should-Retry") != "false" {
			t.Errorf("%s: x-should-retry %q, want false: retrying cannot help", path, resp.Header.Get("X-Should-Retry"))
		}
	}
	hits := s.up.Hits()
	if resp, body := handshake(t, s.url, "/ws/passed/live"); resp.StatusCode != http.StatusSwitchingProtocols || s.up.Hits() != hits+1 {
		t.Errorf("an upgrade to a path in pass_upgrades: %d %s (upstream hits %d → %d), want it forwarded and switched", resp.StatusCode, body, hits, s.up.Hits())
	}
	// A plain read still passes, and a write to a path llmbudget does not
	// budget is refused like a POST there.
	hits = s.up.Hits()
	if resp, body := do(t, http.MethodGet, s.url+"/v1/models", ""); resp.StatusCode == http.StatusForbidden || s.up.Hits() != hits+1 {
		t.Errorf("GET /v1/models: %d %s, want it forwarded", resp.StatusCode, body)
	}
	if resp, body := do(t, http.MethodPut, s.url+"/v1/audio/speech", `{"input":"hello"}`, "Content-Type: application/json"); resp.StatusCode != http.StatusNotFound || decodeError(t, body).Error.Code != "unbudgeted_path" {
		t.Errorf("PUT to an unknown path: %d %s, want 404 unbudgeted_path", resp.StatusCode, body)
	}
	if got := s.counter(); got != 0 {
		t.Errorf("counter %d after refusals and reads, want 0", got)
	}
}

// A field no table knows may make the upstream bill more than the estimate,
// so the request holds its worst case (the context window and its whole
// cap); fields known to change nothing billed cost nothing; with
// unknown_fields refuse, the field is named in a 400.
func TestUnknownFieldsHoldTheWorstCase(t *testing.T) {
	s := newClosedWorldSite(t, 10_000_000, "context_window 200000")
	base := s.counter()
	resp, body := chat(t, s.url, `{"model":"gpt-4o","max_tokens":200,"messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("a known request: %d %s", resp.StatusCode, body)
	}
	plain := s.held(t, resp, base)
	tests := []struct {
		name, body string
		worst      bool
	}{
		{"neutral fields", `{"model":"gpt-4o","max_tokens":200,"messages":[{"role":"user","content":"hi"}],"user":"u1","metadata":{"a":"b"},"store":false,"temperature":0.2,"top_p":1,"seed":3,"parallel_tool_calls":true}`, false},
		{"an unknown field", `{"model":"gpt-4o","max_tokens":200,"messages":[{"role":"user","content":"hi"}],"frobnicate":true}`, true},
		{"a known field in another case", `{"model":"gpt-4o","max_tokens":200,"messages":[{"role":"user","content":"hi"}],"Temperature":1}`, true},
		{"a field of another API", `{"model":"gpt-4o","max_tokens":200,"messages":[{"role":"user","content":"hi"}],"contents":[]}`, true},
	}
	for _, tt := range tests {
		before := s.counter()
		resp, body := chat(t, s.url, tt.body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", tt.name, resp.StatusCode, body)
		}
		held := s.held(t, resp, before)
		switch {
		case tt.worst && held < 200_000+200:
			t.Errorf("%s: held %d, want at least the context window and the cap (200,200)", tt.name, held)
		case !tt.worst && held != plain:
			t.Errorf("%s: held %d, want %d, what the same request holds without them", tt.name, held, plain)
		}
	}

	s = newClosedWorldSite(t, 10_000_000, "unknown_fields refuse", "neutral_fields top_a")
	hits := s.up.Hits()
	resp, body = chat(t, s.url, `{"model":"gpt-4o","max_tokens":200,"messages":[{"role":"user","content":"hi"}],"frobnicate":true}`)
	if e := decodeError(t, body).Error; resp.StatusCode != http.StatusBadRequest || e.Code != "unknown_field" || !strings.Contains(e.Message, `"frobnicate"`) || s.up.Hits() != hits {
		t.Errorf("unknown_fields refuse: %d %s, want 400 unknown_field naming the field, not forwarded", resp.StatusCode, body)
	}
	if resp, body := chat(t, s.url, `{"model":"gpt-4o","max_tokens":200,"messages":[{"role":"user","content":"hi"}],"top_a":0.1}`); resp.StatusCode != http.StatusOK {
		t.Errorf("a field listed in neutral_fields: %d %s, want it served", resp.StatusCode, body)
	}
}

// What the upstream generates past the response, or more of than the
// request's one cap, is held or refused: background work is refused, every
// prompt of a legacy completion holds its outputs, a server's own cap is
// held like the API's and refused above the cap forwarded, and audio
// output holds the whole cap.
func TestOutputTheMeterCannotSeeIsHeldOrRefused(t *testing.T) {
	s := newClosedWorldSite(t, 10_000_000, "max_output_tokens 1000")
	hits := s.up.Hits()
	resp, body := do(t, http.MethodPost, s.url+"/v1/responses", `{"model":"gpt-4o","input":"hi","background":true,"stream":true}`, "Content-Type: application/json")
	if resp.StatusCode != http.StatusBadRequest || decodeError(t, body).Error.Code != "background_not_budgeted" || s.up.Hits() != hits {
		t.Errorf("background: true: %d %s, want 400 background_not_budgeted, not forwarded", resp.StatusCode, body)
	}
	if resp, body := do(t, http.MethodPost, s.url+"/v1/responses", `{"model":"gpt-4o","input":"hi","background":false,"max_output_tokens":100}`, "Content-Type: application/json"); resp.StatusCode != http.StatusOK {
		t.Errorf("background: false: %d %s, want it served", resp.StatusCode, body)
	}

	prompts := `"` + strings.Repeat(`p", "`, 19) + `p"`
	before := s.counter()
	resp, body = do(t, http.MethodPost, s.url+"/v1/completions", `{"model":"gpt-3.5-turbo-instruct","max_tokens":500,"prompt":[`+prompts+`]}`, "Content-Type: application/json")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("20 prompts: %d %s", resp.StatusCode, body)
	}
	if held := s.held(t, resp, before); held < 20*500 {
		t.Errorf("legacy completions with 20 prompts held %d, want at least 20 answers of 500", held)
	}

	before = s.counter()
	resp, body = chat(t, s.url, `{"model":"gpt-4o","max_tokens":100,"n_predict":800,"messages":[{"role":"user","content":"hi"}]}`)
	if held := s.held(t, resp, before); resp.StatusCode != http.StatusOK || held < 800 {
		t.Errorf("n_predict 800 beside max_tokens 100: %d, held %d, want the larger cap held", resp.StatusCode, held)
	}
	resp, body = chat(t, s.url, `{"model":"gpt-4o","n_predict":5000,"messages":[{"role":"user","content":"hi"}]}`)
	if e := decodeError(t, body).Error; resp.StatusCode != http.StatusBadRequest || !strings.Contains(e.Message, "n_predict") {
		t.Errorf("n_predict above max_output_tokens: %d %s, want 400 naming n_predict", resp.StatusCode, body)
	}
	resp, body = chat(t, s.url, `{"model":"gpt-4o","n_predict":-1,"messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "n_predict") {
		t.Errorf("n_predict -1 (unbounded): %d %s, want 400 naming n_predict", resp.StatusCode, body)
	}
}

// Audio output is not counted as it streams: a request asking for it holds
// its whole cap even where leases would hold less.
func TestAudioOutputHoldsTheWholeCap(t *testing.T) {
	url, _, counter := budgetOnRedis(t, redistest.Start(t), "audio")
	proveModels(nil, "gpt-4o") // its answers showed all they billed: it leases
	held := func(body string) int64 {
		before := counter()
		resp, b := chat(t, url, body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		r, _, _ := strings.Cut(strings.TrimPrefix(resp.Header.Get("RateLimit"), `"g";r=`), ";")
		return 100000000 - before - mustInt(t, r)
	}
	text := held(`{"model":"gpt-4o","max_tokens":3000,"stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	audio := held(`{"model":"gpt-4o","max_tokens":3000,"stream":true,"modalities":["text","audio"],"audio":{"voice":"alloy","format":"pcm16"},"messages":[{"role":"user","content":"hi"}]}`)
	if text >= 3000 || audio < 3000 {
		t.Errorf("a text stream held %d (want a lease, under the cap of 3000), an audio one %d (want the whole cap)", text, audio)
	}
}

// handshake sends a WebSocket handshake for path on its own connection and
// reads the answer within 10 s: a refusal's whole body, or a 101's head.
func handshake(t *testing.T, url, path string) (*http.Response, string) {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n", path)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("handshake %s: %v", path, err)
	}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return resp, ""
	}
	body, _ := io.ReadAll(resp.Body)
	return resp, string(body)
}
