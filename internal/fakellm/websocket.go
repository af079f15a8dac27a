package fakellm

import (
	"crypto/sha1"
	"encoding/base64"
	"fmt"
	"net/http"
	"strings"

	"github.com/fleetguard/fleetguard/internal/wsframe"
)

// isSocket reports whether r opens a WebSocket.
func isSocket(r *http.Request) bool { return strings.EqualFold(r.Header.Get("Upgrade"), "websocket") }

// serveSocket accepts a WebSocket session (no extension negotiated), starts
// it with a send that writes a message of the opcode given, and hands each
// client message to the answer start returns; it answers a ping with a pong
// and a close with a close, and returns when the session ends.
func serveSocket(w http.ResponseWriter, r *http.Request, opcode byte, start func(send func(string)) (answer func(msg []byte))) {
	if !isSocket(r) {
		http.Error(w, "websocket only", http.StatusBadRequest)
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	sum := sha1.Sum([]byte(r.Header.Get("Sec-WebSocket-Key") + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"))
	fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n", base64.StdEncoding.EncodeToString(sum[:]))
	if brw.Flush() != nil {
		return
	}
	answer := start(func(m string) { _, _ = conn.Write(wsframe.Append(nil, opcode, []byte(m), false)) })
	var p wsframe.Parser
	var msg []byte
	buf := make([]byte, 64<<10)
	for {
		k, err := brw.Read(buf)
		if err != nil {
			return
		}
		p.Feed(buf[:k])
		for {
			f, ok, err := p.Next()
			if err != nil {
				return
			}
			if !ok {
				break
			}
			switch {
			case f.Opcode == wsframe.OpClose:
				_, _ = conn.Write(wsframe.Append(nil, wsframe.OpClose, f.Payload, false))
				return
			case f.Opcode == wsframe.OpPing:
				_, _ = conn.Write(wsframe.Append(nil, wsframe.OpPong, f.Payload, false))
				continue
			case f.IsControl():
				continue
			}
			if msg = append(msg, f.Payload...); f.Fin {
				answer(msg)
				msg = msg[:0]
			}
		}
		p.Keep()
	}
}
