package fleetguard

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/fakellm"
	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/internal/wait"
	"github.com/fleetguard/fleetguard/internal/wsframe"
)

// socketUpstream is fakellm.Socket served on a local address.
type socketUpstream struct {
	*fakellm.Socket
	url string
}

func newSocketUpstream(t *testing.T, answerTokens int) *socketUpstream {
	t.Helper()
	up := &socketUpstream{Socket: &fakellm.Socket{Tokens: answerTokens}}
	srv := httptest.NewServer(up.Socket)
	t.Cleanup(srv.Close)
	up.url = srv.URL
	return up
}

// socketClient is a WebSocket client of the Responses API's WebSocket mode
// through Caddy.
type socketClient struct {
	t    *testing.T
	conn net.Conn
	br   *bufio.Reader
	p    wsframe.Parser
}

func dialSocket(t *testing.T, url, path string) *socketClient {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Extensions: permessage-deflate\r\nAuthorization: Bearer k1\r\n\r\n", path)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("handshake: %s", resp.Status)
	}
	if ext := resp.Header.Get("Sec-WebSocket-Extensions"); ext != "" {
		t.Fatalf("the upstream negotiated %q: llmbudget must keep messages readable", ext)
	}
	return &socketClient{t: t, conn: conn, br: br}
}

func (c *socketClient) send(event string) {
	c.t.Helper()
	if _, err := c.conn.Write(wsframe.Append(nil, wsframe.OpText, []byte(event), true)); err != nil {
		c.t.Fatal(err)
	}
}

// next is the next server event's type and payload.
func (c *socketClient) next() (string, []byte) {
	c.t.Helper()
	_, payload := c.frame()
	var ev struct{ Type string }
	_ = json.Unmarshal(payload, &ev)
	return ev.Type, payload
}

// frame is the next frame's opcode and payload.
func (c *socketClient) frame() (byte, []byte) {
	c.t.Helper()
	_ = c.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 32<<10)
	for {
		f, ok, err := c.p.Next()
		if err != nil {
			c.t.Fatal(err)
		}
		if ok {
			return f.Opcode, append([]byte(nil), f.Payload...)
		}
		c.p.Keep()
		n, err := c.br.Read(buf)
		if err != nil {
			c.t.Fatalf("reading the socket: %v", err)
		}
		c.p.Feed(append([]byte(nil), buf[:n]...))
	}
}

// until reads events up to one of the types given, and returns it.
func (c *socketClient) until(types ...string) (string, []byte) {
	c.t.Helper()
	for {
		typ, payload := c.next()
		for _, want := range types {
			if typ == want {
				return typ, payload
			}
		}
	}
}

// A Responses WebSocket session through llmbudget: ten response.create of
// answers of 5,000 tokens under a budget of 10,000 are served until the
// budget runs out, each forwarded with its cap and settled to its usage;
// the rest get an error event and the socket stays open; the counter stays
// within the limit and the upstream's bill within the counter.
func TestAResponsesSocketIsBudgetedAResponseAtATime(t *testing.T) {
	up := newSocketUpstream(t, 5000)
	srv := redistest.Start(t)
	port := freePort(t)
	prefix := fmt.Sprintf("socket%d", port)
	startCaddy(t, llmCaddyfile(port, up.url, "fleetguard {\n redis "+srv.URL()+"\n prefix "+prefix+"\n }", "budget g {\n limit 10000\n window 1h\n unit tokens\n }\n default_max_tokens 3000"))
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { rc.Close() })
	url := fmt.Sprintf("http://127.0.0.1:%d", port)

	c := dialSocket(t, url, "/v1/responses")
	var completed, refused int
	for range 10 {
		c.send(`{"type":"response.create","model":"gpt-4o","input":"write 5,000 words"}`)
		switch typ, payload := c.until("response.completed", "error"); typ {
		case "response.completed":
			completed++
		default:
			var ev struct {
				Status int
				Error  struct{ Code, Message string }
			}
			if json.Unmarshal(payload, &ev) != nil || ev.Status != http.StatusTooManyRequests || ev.Error.Code != "token_budget_exceeded" {
				t.Fatalf("a refusal reads %s, want an error event with status 429 and code token_budget_exceeded", payload)
			}
			refused++
		}
	}
	counter := budgetCounter(t, rc, prefix, "g")
	if completed == 0 || refused == 0 || counter > 10000 || up.Billed() > counter {
		t.Fatalf("%d completed, %d refused; counter %d of 10000, billed %d: want both, the counter within the limit and the bill within the counter",
			completed, refused, counter, up.Billed())
	}
	t.Logf("%d completed, %d refused; counter %d, billed %d", completed, refused, counter, up.Billed())
	if up.Events() != int64(completed) {
		t.Fatalf("the upstream received %d events for %d admitted: a refused response.create was forwarded", up.Events(), completed)
	}
}

// A continuation of the socket's last response holds what that response
// reported, not the context window; a client event llmbudget does not
// budget is refused with an error event, and not forwarded.
func TestASocketContinuationHoldsWhatItContinues(t *testing.T) {
	up := newSocketUpstream(t, 200)
	url, _, counter := budgetOnRedisUpstream(t, redistest.Start(t), "continue", up.url)
	c := dialSocket(t, url, "/v1/responses")
	c.send(`{"type":"response.create","model":"gpt-4o","input":"hello","max_output_tokens":300}`)
	_, done := c.until("response.completed", "error")
	var ev struct {
		Type     string
		Response struct{ ID string }
	}
	if json.Unmarshal(done, &ev) != nil || ev.Type != "response.completed" {
		t.Fatalf("the first response: %s", done)
	}
	c.send(fmt.Sprintf(`{"type":"response.create","model":"gpt-4o","input":"more","previous_response_id":%q,"max_output_tokens":300}`, ev.Response.ID))
	if typ, payload := c.until("response.completed", "error"); typ != "response.completed" {
		t.Fatalf("a continuation of the socket's response: %s, want it served (held at what it continues, not the context window)", payload)
	}
	// A response.create the upstream refuses is released: it generated
	// nothing.
	c.send(`{"type":"response.create","model":"` + fakellm.UnavailableModel + `","input":"x","max_output_tokens":300}`)
	if typ, payload := c.until("response.completed", "error"); typ != "error" || !strings.Contains(string(payload), "model_not_found") {
		t.Fatalf("a model the upstream refuses: %s, want its error event", payload)
	}
	before := up.Events()
	c.send(`{"type":"response.steer","input":"faster"}`)
	if typ, payload := c.until("response.completed", "error"); typ != "error" || !strings.Contains(string(payload), "unbudgeted_event") || up.Events() != before {
		t.Fatalf("response.steer: %s (upstream events %d → %d), want an unbudgeted_event error, not forwarded", payload, before, up.Events())
	}
	if got, billed := counter(), up.Billed(); got != billed {
		t.Fatalf("counter %d, billed %d: each response settles to its usage", got, billed)
	}
}

// budgetOnRedisUpstream is a budget of 500,000 tokens (less than the
// context window) on srv in front of the upstream given.
func budgetOnRedisUpstream(t *testing.T, srv *redistest.Server, prefix, upstream string) (url string, _ struct{}, counter func() int64) {
	t.Helper()
	port := freePort(t)
	url = fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, llmCaddyfile(port, upstream, "fleetguard {\n redis "+srv.URL()+"\n prefix "+prefix+"\n }", "budget g {\n limit 500000\n window 1h\n unit tokens\n }"))
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { rc.Close() })
	return url, struct{}{}, func() int64 { return budgetCounter(t, rc, prefix, "g") }
}

// A Redis stall longer than store_timeout during a session: the
// response.create caught in it gets an error event (status 503) and is not
// forwarded, the socket stays open, and once Redis answers the next one is
// served; the counter ends equal to what the upstream billed for the
// responses served, nothing for the one refused.
func TestASocketOutlivesAStoreStall(t *testing.T) {
	up := newSocketUpstream(t, 50)
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	url, _, counter := budgetOnRedisUpstream(t, srv, "socketstall", up.url)
	c := dialSocket(t, url, "/v1/responses")
	create := `{"type":"response.create","model":"gpt-4o","input":"hi","max_output_tokens":100}`
	c.send(create)
	if typ, payload := c.until("response.completed", "error"); typ != "response.completed" {
		t.Fatalf("before the stall: %s", payload)
	}
	rc := stallRedis(t, srv, "1")
	before := up.Events()
	c.send(create)
	typ, payload := c.until("response.completed", "error")
	if typ != "error" || !strings.Contains(string(payload), `"status":503`) || up.Events() != before {
		t.Fatalf("during the stall: %s (upstream events %d → %d), want a 503 error event, not forwarded", payload, before, up.Events())
	}
	wait.Poll(5*time.Second, func() bool { return rc.Ping(context.Background()).Err() == nil })
	// The breaker lets a request through once Redis answers its probe.
	served := wait.Poll(10*time.Second, func() bool {
		c.send(create)
		typ, _ := c.until("response.completed", "error")
		return typ == "response.completed"
	})
	if !served {
		t.Fatal("the socket served nothing after the stall")
	}
	if got, billed := counter(), up.Billed(); got != billed {
		t.Fatalf("counter %d, billed %d: a refused response.create must not be charged", got, billed)
	}
}

// stallRedis sleeps srv for the seconds given (DEBUG SLEEP; srv started
// with --enable-debug-command yes) and returns once it no longer answers,
// with a client that waits it out.
func stallRedis(t *testing.T, srv *redistest.Server, seconds string) *redis.Client {
	t.Helper()
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr()}) // no timeout: it sleeps the server
	t.Cleanup(func() { rc.Close() })
	stalled := make(chan struct{})
	go func() {
		close(stalled)
		_ = rc.Do(context.Background(), "DEBUG", "SLEEP", seconds).Err()
	}()
	<-stalled
	probe := redis.NewClient(&redis.Options{Addr: srv.Addr(), ReadTimeout: 20 * time.Millisecond, MaxRetries: -1})
	defer probe.Close()
	if !wait.Poll(5*time.Second, func() bool { return probe.Ping(context.Background()).Err() != nil }) {
		t.Fatal("Redis did not stall")
	}
	return rc
}

// A response.create forwarded unbudgeted (shadow mode: a refusal is not
// enforced) keeps its place among the socket's responses: the events of the
// budgeted one after it settle that one, at its own usage.
func TestASocketResponseForwardedUnbudgetedKeepsItsPlace(t *testing.T) {
	up := newSocketUpstream(t, 50)
	srv := redistest.Start(t)
	port := freePort(t)
	prefix := fmt.Sprintf("socketshadow%d", port)
	startCaddy(t, llmCaddyfile(port, up.url, "fleetguard {\n redis "+srv.URL()+"\n prefix "+prefix+"\n }",
		"budget g {\n limit 100000\n window 1h\n unit tokens\n }\n shadow\n unknown_fields refuse"))
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { rc.Close() })
	c := dialSocket(t, fmt.Sprintf("http://127.0.0.1:%d", port), "/v1/responses")
	long := strings.Repeat("a long prompt ", 200)
	// A: refused for its unknown field, which shadow mode forwards
	// unbudgeted; B, sent before A's answer: budgeted.
	c.send(`{"type":"response.create","model":"gpt-4o","input":"` + long + `","frobnicate":1,"max_output_tokens":50}`)
	c.send(`{"type":"response.create","model":"gpt-4o","input":"hi","max_output_tokens":50}`)
	for range 2 {
		if typ, payload := c.until("response.completed", "error"); typ != "response.completed" {
			t.Fatalf("%s, want both served", payload)
		}
	}
	wantB := fakellm.Tokens(`"hi"`) + 50
	if got := budgetCounter(t, rc, prefix, "g"); got != wantB {
		t.Fatalf("counter %d, want B's bill %d alone (the upstream billed %d for both): A's events were charged to B", got, wantB, up.Billed())
	}
}
