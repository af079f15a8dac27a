package wsframe

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// Frames written by Append read back whole through a Parser fed in any
// split, masked or not, of every length class; control frames are told.
func TestFramesReadBackAtAnySplit(t *testing.T) {
	payloads := [][]byte{nil, []byte("hi"), bytes.Repeat([]byte("x"), 125), bytes.Repeat([]byte("y"), 126),
		bytes.Repeat([]byte("z"), 70_000)}
	for _, mask := range []bool{false, true} {
		var wire []byte
		for _, p := range payloads {
			wire = Append(wire, OpText, p, mask)
		}
		wire = Append(wire, OpPing, []byte("p"), mask)
		for _, split := range []int{1, 3, 7, 1000, len(wire)} {
			var p Parser
			var got [][]byte
			var raw []byte
			var last Frame
			scratch := make([]byte, split) // the caller's buffer, reused
			for rest := wire; len(rest) > 0; {
				n := min(split, len(rest))
				p.Feed(scratch[:copy(scratch, rest[:n])])
				rest = rest[n:]
				for {
					f, ok, err := p.Next()
					if err != nil {
						t.Fatal(err)
					}
					if !ok {
						break
					}
					if f.Masked != mask || !f.Fin {
						t.Fatalf("masked %v fin %v, want masked %v, final", f.Masked, f.Fin, mask)
					}
					got = append(got, append([]byte(nil), f.Payload...))
					raw = append(raw, f.Raw...)
					last = f
					last.Payload = append([]byte(nil), f.Payload...)
				}
				p.Keep()
				for i := range scratch {
					scratch[i] = 0xFF // the caller reuses its buffer
				}
			}
			if len(got) != len(payloads)+1 || !bytes.Equal(raw, wire) || p.Pending() != 0 {
				t.Fatalf("mask %v split %d: %d frames, raw equal %v, pending %d", mask, split, len(got), bytes.Equal(raw, wire), p.Pending())
			}
			for i, want := range payloads {
				if !bytes.Equal(got[i], want) {
					t.Fatalf("mask %v split %d: frame %d payload differs", mask, split, i)
				}
			}
			if !last.IsControl() || string(last.Payload) != "p" {
				t.Fatalf("the ping read as %+v", last)
			}
		}
	}
}

// A frame over the limit is an error, before its payload is kept.
func TestAFrameOverTheLimitIsAnError(t *testing.T) {
	p := Parser{Max: 100}
	p.Feed(Append(nil, OpText, []byte(strings.Repeat("a", 101)), true)[:12])
	if _, _, err := p.Next(); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("err %v, want ErrTooLarge", err)
	}
}
