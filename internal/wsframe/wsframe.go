// Package wsframe reads and writes the frames of a WebSocket connection (RFC
// 6455) as its bytes pass, for a proxy that meters the messages of a session
// without terminating it: Parser takes the bytes of one direction in any
// split and gives back whole frames, their payload unmasked; Append writes a
// frame. Extensions (permessage-deflate) are not read: a proxy that reads
// messages keeps them from being negotiated.
package wsframe

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
)

// Opcodes of RFC 6455, section 5.2.
const (
	OpContinuation byte = 0x0
	OpText         byte = 0x1
	OpBinary       byte = 0x2
	OpClose        byte = 0x8
	OpPing         byte = 0x9
	OpPong         byte = 0xA
)

// Frame is one frame as it was on the wire (Raw) and as it reads (the rest).
type Frame struct {
	Fin    bool
	RSV    byte // the three reserved bits, as the high bits of a byte
	Opcode byte
	Masked bool
	// Payload is the application data, unmasked.
	Payload []byte
	// Raw is the whole frame as it was on the wire, its payload masked if
	// it was.
	Raw []byte
}

// IsControl reports whether the frame is a control frame (close, ping, pong).
func (f *Frame) IsControl() bool { return f.Opcode&0x8 != 0 }

// ErrTooLarge is the error of a frame whose payload is over the parser's
// limit.
var ErrTooLarge = errors.New("websocket frame too large")

// Parser takes the bytes of one direction of a connection and gives back its
// frames. It copies only the start of a frame that a Feed's bytes end
// within (Keep), at most its limit and a header's; an unmasked payload is
// read where it lies.
type Parser struct {
	buf []byte
	// aliased: buf is the caller's bytes, not yet kept.
	aliased bool
	// Max is the largest payload accepted; 0 means 16 MiB.
	Max int
}

// Feed adds the next bytes of the direction. Until Keep, the parser reads
// them where they lie: the caller calls Next until it reports no frame, then
// Keep, before it reuses b.
func (p *Parser) Feed(b []byte) {
	if len(p.buf) == 0 {
		p.buf, p.aliased = b, true
		return
	}
	p.Keep()
	p.buf = append(p.buf, b...)
}

// Keep copies the bytes of a frame not yet whole out of the caller's.
func (p *Parser) Keep() {
	if p.aliased {
		p.buf, p.aliased = append([]byte(nil), p.buf...), false
	}
}

// Pending is how many bytes of a frame not yet whole the parser holds: 0 at a
// frame's boundary.
func (p *Parser) Pending() int { return len(p.buf) }

// Next returns the next whole frame, or ok false when the bytes fed end
// within one. The frame's slices are valid until the next call of Feed,
// Next or Keep, and the caller's bytes until then. A frame over the limit is an error, and so is every call after it.
func (p *Parser) Next() (f Frame, ok bool, err error) {
	b := p.buf
	if len(b) < 2 {
		return Frame{}, false, nil
	}
	f.Fin, f.RSV, f.Opcode = b[0]&0x80 != 0, b[0]&0x70, b[0]&0x0F
	f.Masked = b[1]&0x80 != 0
	n, i := uint64(b[1]&0x7F), 2
	switch n {
	case 126:
		if len(b) < 4 {
			return Frame{}, false, nil
		}
		n, i = uint64(binary.BigEndian.Uint16(b[2:])), 4
	case 127:
		if len(b) < 10 {
			return Frame{}, false, nil
		}
		n, i = binary.BigEndian.Uint64(b[2:]), 10
	}
	limit := uint64(p.Max)
	if limit == 0 {
		limit = 16 << 20
	}
	if n > limit {
		return Frame{}, false, fmt.Errorf("%w: %d bytes, the limit is %d", ErrTooLarge, n, limit)
	}
	var key [4]byte
	if f.Masked {
		if len(b) < i+4 {
			return Frame{}, false, nil
		}
		copy(key[:], b[i:i+4])
		i += 4
	}
	end := i + int(n)
	if len(b) < end {
		return Frame{}, false, nil
	}
	f.Raw = b[:end:end]
	f.Payload = b[i:end:end]
	if f.Masked {
		// Raw stays as it was on the wire.
		f.Payload = append([]byte(nil), f.Payload...)
		for j := range f.Payload {
			f.Payload[j] ^= key[j&3]
		}
	}
	p.buf = b[end:]
	if len(p.buf) == 0 && !p.aliased {
		p.buf = b[:0] // reuse the room from its start
	}
	return f, true, nil
}

// Append appends a frame of opcode, final, with payload to dst: masked with a
// random key when mask is true (a client's frames must be, a server's must
// not be).
func Append(dst []byte, opcode byte, payload []byte, mask bool) []byte {
	b1 := byte(0)
	if mask {
		b1 = 0x80
	}
	dst = append(dst, 0x80|opcode)
	switch n := len(payload); {
	case n < 126:
		dst = append(dst, b1|byte(n))
	case n <= 0xFFFF:
		dst = append(dst, b1|126)
		dst = binary.BigEndian.AppendUint16(dst, uint16(n))
	default:
		dst = append(dst, b1|127)
		dst = binary.BigEndian.AppendUint64(dst, uint64(n))
	}
	if !mask {
		return append(dst, payload...)
	}
	var key [4]byte
	_, _ = rand.Read(key[:])
	dst = append(dst, key[:]...)
	start := len(dst)
	dst = append(dst, payload...)
	for j := range payload {
		dst[start+j] ^= key[j&3]
	}
	return dst
}
