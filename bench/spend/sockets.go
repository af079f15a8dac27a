package main

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/fleetguard/fleetguard/internal/fakellm"
	"github.com/fleetguard/fleetguard/internal/wsframe"
)

// The transports: WebSocket sessions through a second llmbudget on the same
// site (budget "sockets", scope model, the same limit, context_window 32000:
// a Realtime model's window), each in front of an honest stand-in. Each
// session loops until its first refusal, an error event on the open
// session.

var transports = flag.String("transports", "socket,realtime,realtime-audio,live,live-audio", "WebSocket cases, comma-separated: socket (the Responses API's WebSocket mode), realtime (Realtime text turns), realtime-audio (Realtime audio turns answered by its turn detection), live (Gemini Live text turns), live-audio (Gemini Live audio turns answered by its activity detection); empty for none")

// socketWindow is the context window the transports' llmbudget holds for
// a Realtime response's input.
const socketWindow = 32000

// socketUpstreams are the stand-ins the transports run against.
type socketUpstreams struct {
	socket                       *fakellm.Socket
	realtime                     *fakellm.Realtime
	live                         *fakellm.Live
	socketAddr, rtAddr, liveAddr string
	servers                      []*http.Server
}

func startSocketUpstreams() (*socketUpstreams, func(), error) {
	s := &socketUpstreams{
		socket:   &fakellm.Socket{Tokens: *tokens},
		realtime: &fakellm.Realtime{Tokens: *tokens, Window: socketWindow, AudioBytesPerToken: 100},
		live:     &fakellm.Live{Tokens: *tokens, Thinking: 100, Window: socketWindow, AudioBytesPerToken: 100},
	}
	for _, h := range []struct {
		handler http.Handler
		addr    *string
	}{{s.socket, &s.socketAddr}, {s.realtime, &s.rtAddr}, {s.live, &s.liveAddr}} {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, nil, err
		}
		srv := &http.Server{Handler: h.handler}
		go func() { _ = srv.Serve(ln) }()
		s.servers = append(s.servers, srv)
		*h.addr = ln.Addr().String()
	}
	return s, func() {
		for _, srv := range s.servers {
			_ = srv.Close()
		}
	}, nil
}

func (s *socketUpstreams) addrs() map[string]string {
	return map[string]string{"socket": s.socketAddr, "realtime": s.rtAddr, "live": s.liveAddr}
}

// socketRoutes are the site's routes to the transports' stand-ins, budgeted.
func socketRoutes(addrs map[string]string) string {
	return fmt.Sprintf(`		@upgrade header Upgrade websocket
		@realtime path /v1/realtime
		@live path_regexp BidiGenerateContent$
		llmbudget @upgrade {
			budget sockets {
				scope model
				unit tokens
				limit %d
				window 1h
			}
			context_window %d
		}
		reverse_proxy @realtime %s
		reverse_proxy @live %s
		reverse_proxy @upgrade %s`, *limit, socketWindow, addrs["realtime"], addrs["live"], addrs["socket"])
}

// transportCase is one transport's case: a session's path and model, and
// one turn of it (an answer, or an error event when refused).
type transportCase struct {
	name, text, model, path string
	billed                  func() int64
	open                    func(s *session) error
	turn                    func(s *session) (answered bool, err error)
}

func (s *socketUpstreams) cases() []transportCase {
	var cases []transportCase
	audio := base64.StdEncoding.EncodeToString(make([]byte, 100**tokens)) // -tokens of the stand-in's audio
	for _, name := range strings.Split(*transports, ",") {
		switch name {
		case "":
		case "socket":
			cases = append(cases, transportCase{name: name, text: "english", model: "gpt-4o-socket", path: "/v1/responses", billed: s.socket.Billed,
				open: func(*session) error { return nil },
				turn: func(ss *session) (bool, error) {
					ss.send(fmt.Sprintf(`{"type":"response.create","model":"gpt-4o-socket","input":"go","max_output_tokens":%d}`, *capTok))
					return ss.until("response.completed")
				}})
		case "realtime":
			cases = append(cases, transportCase{name: name, text: "english", model: "gpt-realtime-text", path: "/v1/realtime?model=gpt-realtime-text", billed: s.realtime.Billed,
				open: func(ss *session) error {
					ss.send(`{"type":"session.update","session":{"type":"realtime","audio":{"input":{"turn_detection":null}}}}`)
					_, err := ss.until("session.updated")
					return err
				},
				turn: func(ss *session) (bool, error) {
					ss.send(`{"type":"conversation.item.create","item":{"type":"message","role":"user","content":[{"type":"input_text","text":"go on"}]}}`)
					ss.send(`{"type":"response.create"}`)
					return ss.until("response.done")
				}})
		case "realtime-audio":
			cases = append(cases, transportCase{name: name, text: "audio", model: "gpt-realtime-audio", path: "/v1/realtime?model=gpt-realtime-audio", billed: s.realtime.Billed,
				open: func(*session) error { return nil },
				turn: func(ss *session) (bool, error) {
					ss.send(`{"type":"input_audio_buffer.append","audio":"` + audio + `"}`)
					return ss.until("response.done")
				}})
		case "live", "live-audio":
			model, setup, input := "gemini-live-text", `{"setup":{"model":"models/gemini-live-text","generationConfig":{"thinkingConfig":{"thinkingBudget":200}},"realtimeInputConfig":{"automaticActivityDetection":{"disabled":true}}}}`,
				`{"clientContent":{"turns":[{"role":"user","parts":[{"text":"go on"}]}],"turnComplete":true}}`
			if name == "live-audio" {
				model, setup, input = "gemini-live-audio", `{"setup":{"model":"models/gemini-live-audio","generationConfig":{"thinkingConfig":{"thinkingBudget":200}}}}`,
					`{"realtimeInput":{"audio":{"mimeType":"audio/pcm;rate=16000","data":"`+audio+`"}}}`
			}
			cases = append(cases, transportCase{name: name, text: map[bool]string{true: "audio", false: "english"}[name == "live-audio"], model: model,
				path: "/ws/google.ai.generativelanguage.v1beta.GenerativeService.BidiGenerateContent", billed: s.live.Billed,
				open: func(ss *session) error {
					ss.send(setup)
					_, err := ss.until("setupComplete")
					return err
				},
				turn: func(ss *session) (bool, error) {
					ss.send(input)
					return ss.until("turnComplete")
				}})
		default:
			fmt.Printf("-transports: unknown case %q\n", name)
		}
	}
	return cases
}

// run opens -clients sessions at once, each taking turns until its first
// refusal, and returns the case's row.
func (t transportCase) run(ctx context.Context, c *caddyProc) (row string, held bool, err error) {
	before := t.billed()
	var (
		mu        sync.Mutex
		firstWave int
		firstErr  error
		wg        sync.WaitGroup
	)
	for range *clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ss, err := dialSession(c.site, t.path)
			if err == nil {
				defer ss.conn.Close()
				err = t.open(ss)
			}
			for turn := 0; err == nil && ctx.Err() == nil; turn++ {
				var answered bool
				if answered, err = t.turn(ss); !answered {
					break
				}
				if turn == 0 {
					mu.Lock()
					firstWave++
					mu.Unlock()
				}
			}
			if err != nil {
				mu.Lock()
				firstErr = err
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return "", false, firstErr
	}
	var used int64
	for prev := int64(-1); ctx.Err() == nil; prev = used {
		time.Sleep(300 * time.Millisecond)
		if used, err = c.usedOf("sockets", t.model); err != nil || used == prev {
			break
		}
	}
	if err != nil {
		return "", false, err
	}
	billed := t.billed() - before
	row, held = rowOf(t.name, t.model, t.text, "-", firstWave, billed, used, billed)
	return row, held, nil
}

// session is a WebSocket client.
type session struct {
	conn net.Conn
	br   *bufio.Reader
	p    wsframe.Parser
	buf  []byte
}

func dialSession(site, path string) (*session, error) {
	host := strings.TrimPrefix(site, "http://")
	conn, err := net.Dial("tcp", host)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer spend\r\n\r\n", path, host)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err == nil && resp.StatusCode != http.StatusSwitchingProtocols {
		err = fmt.Errorf("handshake: %s", resp.Status)
	}
	if err != nil {
		conn.Close()
		return nil, err
	}
	return &session{conn: conn, br: br, buf: make([]byte, 64<<10)}, nil
}

func (s *session) send(event string) {
	_, _ = s.conn.Write(wsframe.Append(nil, wsframe.OpText, []byte(event), true))
}

// until reads events up to one of type done (true; a Live message that
// has the member done) or an error event or a close frame (false).
func (s *session) until(done string) (bool, error) {
	_ = s.conn.SetReadDeadline(time.Now().Add(60 * time.Second))
	for {
		f, ok, err := s.p.Next()
		if err != nil {
			return false, err
		}
		if !ok {
			s.p.Keep()
			n, err := s.br.Read(s.buf)
			if err != nil {
				return false, err
			}
			s.p.Feed(append([]byte(nil), s.buf[:n]...))
			continue
		}
		if f.Opcode == wsframe.OpClose {
			return false, nil // Gemini Live ends the session to refuse
		}
		if f.IsControl() {
			continue
		}
		var ev struct{ Type string }
		_ = json.Unmarshal(f.Payload, &ev)
		switch {
		case ev.Type == done || ev.Type == "" && strings.Contains(string(f.Payload), `"`+done+`"`):
			return true, nil
		case ev.Type == "error":
			return false, nil
		}
	}
}
