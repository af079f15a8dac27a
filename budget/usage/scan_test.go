package usage

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
)

// plainByte is the byte-at-a-time definition of a plain string byte.
var plainByte = func() (t [256]bool) {
	for c := 0x20; c < 0x80; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// TestPlainPrefix8 compares the eight-at-a-time count with the byte table on
// every byte value at every position, after plain and after special bytes,
// and on random words.
func TestPlainPrefix8(t *testing.T) {
	want := func(w []byte) int {
		n := 0
		for n < len(w) && plainByte[w[n]] {
			n++
		}
		return n
	}
	check := func(w []byte) {
		if got := plainPrefix8(binary.LittleEndian.Uint64(w)); got != want(w) {
			t.Fatalf("plainPrefix8(%q) = %d, want %d", w, got, want(w))
		}
	}
	for _, fill := range []byte{'a', 0, '"', 0xff, 0x1f, 0x20, 0x7f, 0x80} {
		for pos := 0; pos < 8; pos++ {
			for c := 0; c < 256; c++ {
				w := []byte("abcdefgh")
				for i := pos + 1; i < 8; i++ {
					w[i] = fill
				}
				w[pos] = byte(c)
				check(w)
			}
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 200000 {
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], r.Uint64())
		for i := range w { // mostly printable, like JSON text
			if r.IntN(4) > 0 {
				w[i] = byte(0x20 + r.IntN(0x5f))
			}
		}
		check(w[:])
	}
}

// TestDigitsEnd compares the eight-at-a-time digit scan with a byte loop on
// every byte value at every position.
func TestDigitsEnd(t *testing.T) {
	want := func(b []byte, i int) int {
		for i < len(b) && '0' <= b[i] && b[i] <= '9' {
			i++
		}
		return i
	}
	for _, fill := range []byte{'5', 0, 0xff, '/', ':', 0xb9, 0xba} {
		for pos := 0; pos < 12; pos++ {
			for c := 0; c < 256; c++ {
				b := []byte("012345678901")
				for i := pos + 1; i < len(b); i++ {
					b[i] = fill
				}
				b[pos] = byte(c)
				if got := digitsEnd(b, 0); got != want(b, 0) {
					t.Fatalf("digitsEnd(%q) = %d, want %d", b, got, want(b, 0))
				}
			}
		}
	}
}

// TestMemberMatchesAnyForm: the fast paths of member read every form of
// member, at every distance from the text's end, as memberAnyForm does.
func TestMemberMatchesAnyForm(t *testing.T) {
	keys := []string{"", "a", "id", "usage", "content", "abcdefg", "abcdefgh", "abcdefghi",
		"completion_tokens", "prompt_tokens_details", "completion_tokens_details",
		"cache_creation_input_tokens", "abcdefghijklmnopqrstuvwxyz0123456789",
		`a\"b`, `\u0069d`, "a b", "a!b", "#$%&", "abcdefgh ijk", "abcdefghijk!", "a~\x7f", "caf\u00e9", "a\x01b", "abcdefgh\\n", "abcdefghijklmnop\"", "x\x7fy"}
	forms := []string{`%s"%s":1}`, `%s"%s": 1}`, `%s"%s" :1}`, `%s"%s":  1}`, `%s"%s":` + "\n1}", `%s "%s":1}`, `%s"%s"1}`, `%s"%s":`, `%s"%s": `, `%s"%s`}
	for _, key := range keys {
		for _, form := range forms {
			for k := range 2 {
				sep := ""
				if k > 0 {
					sep = ","
				}
				text := fmt.Sprintf(form, sep, key)
				for pad := range 40 {
					b := []byte(text + strings.Repeat(" ", pad))
					fast, slow := scanner{b: b}, scanner{b: b}
					fk, fok := fast.member(k)
					sk, sok := slow.memberAnyForm(k)
					if string(fk) != string(sk) || fok != sok || fast.i != slow.i || fast.failed != slow.failed {
						t.Fatalf("%q, member %d: member gives %q %v at %d (failed %v), memberAnyForm %q %v at %d (failed %v)",
							b, k, fk, fok, fast.i, fast.failed, sk, sok, slow.i, slow.failed)
					}
				}
			}
		}
	}
}

// TestStrMatchesStrFrom: str's fast paths read every string, at every
// distance from the text's end, as strFrom (the byte-at-a-time loop) does.
func TestStrMatchesStrFrom(t *testing.T) {
	contents := []string{"", "a", "abcdefg", "abcdefgh", "abcdefghijklmnopq", `a\"b`, `abcdefgh\n`, "caf\u00e9",
		"a\x01b", `\u00e9t\u00e9`, "abcdefghijklmno\x7f", `bad\x`, "\xff\xfe"}
	for _, c := range contents {
		for _, end := range []string{`"`, `"}`, ``, `\`} {
			for pad := range 20 {
				b := []byte(`"` + c + end + strings.Repeat("}", pad))
				fast, slow := scanner{b: b}, scanner{b: b}
				fs, fe, fp := fast.str()
				ss, se, sp := slow.strFrom(1, 1)
				if fs != ss || fe != se || fp != sp || fast.i != slow.i || fast.failed != slow.failed {
					t.Fatalf("%q: str gives %d %d %v at %d (failed %v), strFrom %d %d %v at %d (failed %v)",
						b, fs, fe, fp, fast.i, fast.failed, ss, se, sp, slow.i, slow.failed)
				}
			}
		}
	}
}

// TestNumberMatchesParseInt: number's fast paths read a number, at every
// distance from the text's end, as skipNumber and strconv.ParseInt do.
func TestNumberMatchesParseInt(t *testing.T) {
	numbers := []string{"0", "7", "12", "05", "00", "123", "1.5", "1e3", "1E3", "-3", "-0", "10.0",
		"123456789012345678", "1234567890123456789", "9223372036854775807", "9223372036854775808",
		"-9223372036854775808", "-9223372036854775809", "12345678901234567890", "-", "1.", "1e", "x"}
	for _, n := range numbers {
		for _, end := range []string{"", ",", "}", "]", " ", ".", "e", "E", "5", "x"} {
			for pad := range 4 {
				b := []byte(n + end + strings.Repeat("}", pad))
				s := scanner{b: b}
				v, isInt := s.number()
				ref := scanner{b: b}
				integer := ref.skipNumber()
				want, err := strconv.ParseInt(string(b[:ref.i]), 10, 64)
				wantInt := !ref.failed && integer && err == nil
				if !wantInt {
					want = 0
				}
				if v != want || isInt != wantInt || s.failed != ref.failed || (!s.failed && s.i != ref.i) {
					t.Fatalf("%q: number gives %d %v at %d (failed %v), want %d %v at %d (failed %v)",
						b, v, isInt, s.i, s.failed, want, wantInt, ref.i, ref.failed)
				}
			}
		}
	}
}

// TestKindWords: the word constants spell the names, and eventKind reads
// a type alike whether it scans it by words (followed by 24 bytes or more)
// or with str (at the text's end).
func TestKindWords(t *testing.T) {
	for w, name := range map[uint64]string{
		wordMessage_: "message_", wordStart: "start", wordDelta: "delta", wordResponse: "response",
		wordFailed: ".failed", wordComplet: ".complet", wordEd: "ed", wordIncompl: ".incompl", wordEte: "ete",
	} {
		var b [8]byte
		copy(b[:], name)
		if got := binary.LittleEndian.Uint64(b[:]); got != w {
			t.Errorf("word of %q = %#x, want %#x", name, got, w)
		}
	}
	for _, c := range []struct {
		name string
		want eventKind
	}{
		{"message_start", kindMessageStart},
		{"message_delta", kindMessageDelta},
		{"response.completed", kindResponseFinal},
		{"response.incomplete", kindResponseFinal},
		{"response.failed", kindResponseFinal},
		{`message_\u0073tart`, kindMessageStart},
		{"message_stop", kindOther},
		{"message_starts", kindOther},
		{"Message_start", kindOther},
		{"message-delta", kindOther},
		{"message_deltA", kindOther},
		{"response.complete", kindOther},
		{"response.completeD", kindOther},
		{"response.incompletE", kindOther},
		{"response.xncomplete", kindOther},
		{"response.failes", kindOther},
		{"responsE.failed", kindOther},
		{"response.created", kindOther},
		{"content_block_delta", kindOther},
		{"content_block_stop", kindOther},
		{"ping", kindOther},
		{"", kindOther},
		{"response.output_text.delta", kindOther},
		{"réponse", kindOther},
		{"response.reasoning_summary_text.delta", kindOther},
		{`response.reasoning_summary_\u0074ext.delta`, kindOther},
	} {
		for _, pad := range []string{"", "}", `,"index":0,"delta":{"type":"text"}}`} {
			s := scanner{b: []byte(`"` + c.name + `"` + pad)}
			got, ok := s.eventKind()
			if !ok || s.failed || got != c.want || s.i != len(c.name)+2 {
				t.Errorf("eventKind(%q + %q) = %d, %v at %d; want %d, true at %d", c.name, pad, got, ok, s.i, c.want, len(c.name)+2)
			}
		}
	}
}
