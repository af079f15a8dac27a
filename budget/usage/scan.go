package usage

import (
	"encoding/binary"
	"math/bits"
	"unicode/utf8"
)

// The usage readers scan JSON bytes in place instead of decoding them with
// encoding/json: a stream event is read in one pass that validates it the way
// encoding/json would (the same syntax, nesting limit and string rules) and
// looks only at the few fields that carry usage or output text, comparing
// keys by exact case as upstreams and SDKs do. Nothing is allocated (but to
// skip a value nested more than 64 levels deep).

// maxNestingDepth is encoding/json's limit on nested arrays and objects; a
// deeper value is invalid for it, so it is for the scanner too.
const maxNestingDepth = 10000

// scanner walks one JSON text. After an error (bad syntax, or a field of the
// wrong type where the caller treats that as fatal) failed is set, the
// position is at the end, and every method returns at once.
type scanner struct {
	b      []byte
	i      int
	failed bool
	// tmpl, when not nil, records the values that may differ in the next
	// event (see eventTemplate).
	tmpl *eventTemplate
	// tc, when not nil, counts the tokens of the output values read.
	tc *textCount
	// key holds a key decoded from escapes, for comparison.
	key [32]byte
}

// fail stops the scan: the text is not read.
func (s *scanner) fail() {
	s.failed = true
	s.i = len(s.b)
}

// peek returns the byte at the position, or 0 at the end.
func (s *scanner) peek() byte {
	if s.i < len(s.b) {
		return s.b[s.i]
	}
	return 0
}

// space skips JSON whitespace.
func (s *scanner) space() {
	b, i := s.b, s.i
	if i < len(b) && b[i] > ' ' {
		return
	}
	for i < len(b) && (b[i] == ' ' || b[i] == '\n' || b[i] == '\r' || b[i] == '\t') {
		i++
	}
	s.i = i
}

// member steps to the k-th member of the object being read (k counts from
// 0; the '{' is already consumed) and returns its key, decoded, with the
// position at the value. ok is false at the object's end (its '}' consumed)
// or on an error.
func (s *scanner) member(k int) (key []byte, ok bool) {
	// Most members are `,"key":value` (or `"key":value` first, or
	// `"key": value`) with a key of word bytes (see notKey8), not within
	// 14 bytes of the text's end; any other form takes memberAnyForm. A
	// call per member makes the fixed cost count: one bounds check covers
	// a key's first 8 bytes and what follows a shorter key.
	b, i := s.b, s.i
	if uint(i) >= uint(len(b)) {
		return s.memberAnyForm(k)
	}
	c := b[i]
	if c == '}' {
		s.i = i + 1
		return nil, false
	}
	if len(b)-i < 14 {
		return s.memberNearEnd(k)
	}
	w := b[i : i+14 : i+14] // a comma, the quote, 8 bytes of key, `":` and a value
	o := 0                  // the quote's index in w
	if k > 0 {
		if c != ',' {
			return s.memberAnyForm(k)
		}
		o = 1
	}
	if w[o] != '"' {
		return s.memberAnyForm(k)
	}
	hit := notKey8(binary.LittleEndian.Uint64(w[o+1 : o+9]))
	if hit == 0 {
		// Many keys are 9 to 16 bytes long (output_tokens, created_at):
		// their second word is read here, without longMember's call. (A
		// tail of its own: one shared with shorter keys would bounds-check
		// a window of either length.)
		if len(b)-i < 22 {
			return s.longMember(k, i+o)
		}
		w := b[i : i+22 : i+22] // as above, with 16 bytes of key
		if hit = notKey8(binary.LittleEndian.Uint64(w[o+9 : o+17])); hit == 0 {
			return s.longMember(k, i+o)
		}
		n := o + bits.TrailingZeros64(hit)>>3 + 9
		v, fast := valueAfterKey(w, n)
		if !fast {
			return s.memberAnyForm(k)
		}
		s.i = i + v
		return w[o+1 : n], true
	}
	n := o + bits.TrailingZeros64(hit)>>3 + 1 // the end of the key in w
	v, fast := valueAfterKey(w, n)
	if !fast {
		return s.memberAnyForm(k)
	}
	s.i = i + v
	return w[o+1 : n], true
}

// valueAfterKey is where the value starts in w, a member's bytes, when the
// key ends at w[n] with `":` and at most one space before a value byte (the
// fast form); w holds at least n+4 bytes. (Inlined: each caller's window
// length bounds its checks.)
func valueAfterKey(w []byte, n int) (v int, fast bool) {
	if binary.LittleEndian.Uint16(w[n:n+2]) != '"'|':'<<8 {
		return 0, false
	}
	v = n + 2
	c := w[v]
	if c == ' ' {
		v++
		c = w[v]
	}
	return v, c > ' '
}

// longMember is member past a key's first 8 bytes, all word bytes; the
// key's quote is at b[q].
func (s *scanner) longMember(k, q int) (key []byte, ok bool) {
	b := s.b
	j := q + 9
	for {
		if len(b)-j < 8 {
			// The last word of b (it starts past the quote) holds what is
			// left in its high bytes; the zeros shifted in are not word
			// bytes.
			x := binary.LittleEndian.Uint64(b[len(b)-8:]) >> (8 * (8 - (len(b) - j)))
			j += bits.TrailingZeros64(notKey8(x)) >> 3
			break
		}
		if hit := notKey8(binary.LittleEndian.Uint64(b[j : j+8])); hit != 0 {
			j += bits.TrailingZeros64(hit) >> 3
			break
		}
		j += 8
	}
	// The key ends at b[j] if it is a quote.
	if len(b)-j < 4 {
		return s.memberAnyForm(k)
	}
	v, fast := valueAfterKey(b[j:j+4:j+4], 0)
	if !fast {
		return s.memberAnyForm(k)
	}
	s.i = j + v
	return b[q+1 : j], true
}

// memberNearEnd is member's fast path byte by byte, for a member that
// starts within 14 bytes of the text's end (b[s.i] is not '}'): the last
// member of an event often does.
func (s *scanner) memberNearEnd(k int) (key []byte, ok bool) {
	b, i := s.b, s.i
	if k > 0 {
		if b[i] != ',' {
			return s.memberAnyForm(k)
		}
		i++
	}
	if i >= len(b) || b[i] != '"' {
		return s.memberAnyForm(k)
	}
	j := i + 1
	for j < len(b) && b[j] >= 0x23 && b[j] < utf8.RuneSelf && b[j] != '\\' {
		j++
	}
	if len(b)-j < 3 || b[j] != '"' || b[j+1] != ':' {
		return s.memberAnyForm(k)
	}
	v := j + 2
	c := b[v]
	if c == ' ' {
		if v++; v >= len(b) {
			return s.memberAnyForm(k)
		}
		c = b[v]
	}
	if c <= ' ' {
		return s.memberAnyForm(k)
	}
	s.i = v
	return b[i+1 : j], true
}

// notKey8 flags the bytes of x, little-endian, that may not be word bytes
// of a key: plain bytes (see str) but for ' ' and '!', which keys do not
// hold (a key that does takes memberAnyForm). A byte's high bit is set in
// x-0x23… when it is below 0x23 or at least 0xa3, in x itself when at
// least 0x80, and in (x^'\\')-1… when it is '\\' (or at least 0x80); as in
// notPlain8, the lowest flag is exact. Two terms fewer than notPlain8:
// a call per key.
func notKey8(x uint64) uint64 {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	return ((x - ones*0x23) | x | ((x ^ (ones * '\\')) - ones)) & highs
}

// memberAnyForm is member for any member: with whitespace, escapes, or at
// the object's end.
func (s *scanner) memberAnyForm(k int) (key []byte, ok bool) {
	s.space()
	c := s.peek()
	if c == '}' {
		s.i++
		return nil, false
	}
	if k > 0 {
		if c != ',' {
			s.fail()
			return nil, false
		}
		s.i++
		s.space()
	}
	if s.peek() != '"' {
		s.fail()
		return nil, false
	}
	start, end, plain := s.str()
	if s.failed {
		return nil, false
	}
	key = s.b[start:end]
	if !plain {
		key = s.asciiKey(key)
	}
	s.space()
	if s.peek() != ':' {
		s.fail()
		return nil, false
	}
	s.i++
	s.space()
	if s.i >= len(s.b) {
		s.fail()
		return nil, false
	}
	return key, true
}

// element steps to the k-th element of the array being read ('[' already
// consumed); ok is false at its end (']' consumed) or on an error.
func (s *scanner) element(k int) bool {
	s.space()
	c := s.peek()
	if c == ']' {
		s.i++
		return false
	}
	if k > 0 {
		if c != ',' {
			s.fail()
			return false
		}
		s.i++
		s.space()
	}
	if s.i >= len(s.b) {
		s.fail()
		return false
	}
	return true
}

// asciiKey decodes the escapes of a key into s.key when the result is ASCII
// and short enough to be one of the names the readers look for; otherwise it
// returns a key that matches no name.
func (s *scanner) asciiKey(raw []byte) []byte {
	n, ok := decodeASCII(s.key[:], raw)
	if !ok {
		return nil
	}
	return s.key[:n]
}

// decodeASCII decodes the JSON string contents raw (already validated) into
// dst. ok is false when the decoded string does not fit dst or holds a
// non-ASCII character: it then equals none of the ASCII names compared to.
func decodeASCII(dst, raw []byte) (n int, ok bool) {
	for i := 0; i < len(raw); {
		c := raw[i]
		if c >= utf8.RuneSelf || n == len(dst) {
			return 0, false
		}
		if c != '\\' {
			dst[n] = c
			n, i = n+1, i+1
			continue
		}
		switch e := raw[i+1]; e {
		case 'u':
			r := hex4(raw[i+2 : i+6])
			if r >= utf8.RuneSelf {
				return 0, false // a non-ASCII rune, or a surrogate (U+FFFD)
			}
			dst[n] = byte(r)
			i += 6
		default:
			dst[n] = unescape(e)
			i += 2
		}
		n++
	}
	return n, true
}

// unescape is the byte a one-letter escape stands for.
func unescape(e byte) byte {
	switch e {
	case 'b':
		return '\b'
	case 'f':
		return '\f'
	case 'n':
		return '\n'
	case 'r':
		return '\r'
	case 't':
		return '\t'
	}
	return e // '"', '\\', '/'
}

// hex4 reads four hex digits (already validated).
func hex4(h []byte) rune {
	var r rune
	for _, c := range h[:4] {
		switch {
		case c <= '9':
			c -= '0'
		case c >= 'a':
			c -= 'a' - 10
		default:
			c -= 'A' - 10
		}
		r = r<<4 | rune(c)
	}
	return r
}

// str scans the string token at the position ('"'). It returns its
// contents' bounds and whether they are plain (no escape, ASCII only: the
// bytes are the decoded string). A plain byte is printable ASCII but for '"'
// and '\\' (0x20 to 0x7f): a string is mostly plain bytes, passed 8 at a
// time.
func (s *scanner) str() (start, end int, plain bool) {
	// Most strings are plain up to a quote not within 8 bytes of the
	// text's end: they take this loop alone, and cost no frame spills.
	b := s.b
	start = s.i + 1
	i := start
	for ; i <= len(b)-8; i += 8 {
		if hit := notPlain8(binary.LittleEndian.Uint64(b[i:])); hit != 0 {
			if i += bits.TrailingZeros64(hit) >> 3; b[i] == '"' {
				s.i = i + 1
				return start, i, true
			}
			return s.strFrom(start, i)
		}
	}
	if len(b) >= 8 && i < len(b) {
		// The last word of b holds what is left in its high bytes; the
		// zeros shifted in are not plain.
		x := binary.LittleEndian.Uint64(b[len(b)-8:]) >> (8 * (8 - (len(b) - i)))
		if i += bits.TrailingZeros64(notPlain8(x)) >> 3; i < len(b) && b[i] == '"' {
			s.i = i + 1
			return start, i, true
		}
	}
	return s.strFrom(start, i)
}

// strFrom is str for any string from b[i] on, the bytes from start to i
// plain.
func (s *scanner) strFrom(start, i int) (_, end int, plain bool) {
	b := s.b
	plain = true
	for {
		for { // past the plain bytes, 8 at a time
			if i+8 > len(b) {
				i = plainTail(b, i)
				break
			}
			n := plainPrefix8(binary.LittleEndian.Uint64(b[i : i+8 : i+8]))
			i += n
			if n < 8 {
				break
			}
		}
		if i >= len(b) {
			s.fail()
			return 0, 0, false
		}
		switch c := b[i]; {
		case c == '"':
			s.i = i + 1
			return start, i, plain
		case c == '\\':
			plain = false
			if i+1 >= len(b) {
				s.fail()
				return 0, 0, false
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+5 >= len(b) || !isHex(b[i+2]) || !isHex(b[i+3]) || !isHex(b[i+4]) || !isHex(b[i+5]) {
					s.fail()
					return 0, 0, false
				}
				i += 6
			default:
				s.fail()
				return 0, 0, false
			}
		case c < 0x20:
			s.fail()
			return 0, 0, false
		default: // non-ASCII: encoding/json takes any byte, coercing bad UTF-8
			plain = false
			i++
		}
	}
}

// plainTail returns the index of the first byte at or after i that is not
// plain (see str), or len(b), for the last, fewer than 8, bytes of b.
func plainTail(b []byte, i int) int {
	var tail [8]byte // zero, which is not plain, past the end
	copy(tail[:], b[i:])
	return i + plainPrefix8(binary.LittleEndian.Uint64(tail[:]))
}

// plainPrefix8 counts the plain bytes (see str) at the start of the 8
// bytes x, little-endian. A byte's high bit is set in x-0x20… when it is
// below 0x20 or at least 0xa0, in x itself when at least 0x80, and in
// (x^'"')-1… or (x^'\\')-1… when it is '"' or '\\' (or at least 0x80). A
// borrow only starts at a byte below 0x20, '"' or '\\', so the bytes it
// wrongly flags lie above a true one: the lowest flag is exact.
func plainPrefix8(x uint64) int {
	return bits.TrailingZeros64(notPlain8(x)) >> 3
}

// notPlain8 flags the bytes of x (see plainPrefix8) that may not be plain,
// by their high bits; its lowest flag is exact, and it is zero when all
// eight bytes are plain.
func notPlain8(x uint64) uint64 {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	return ((x - ones*0x20) | x | ((x ^ (ones * '"')) - ones) | ((x ^ (ones * '\\')) - ones)) & highs
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// decodedLen is the length encoding/json gives the string whose (valid)
// contents are raw: escapes decoded, each byte of invalid UTF-8 and each
// unpaired surrogate replaced by U+FFFD.
func decodedLen(raw []byte) int64 {
	var n int64
	for i := 0; i < len(raw); {
		c := raw[i]
		switch {
		case c == '\\' && raw[i+1] == 'u':
			r := hex4(raw[i+2 : i+6])
			i += 6
			if isSurrogate(r) {
				if i+6 <= len(raw) && raw[i] == '\\' && raw[i+1] == 'u' {
					if r2 := hex4(raw[i+2 : i+6]); r < 0xdc00 && 0xdc00 <= r2 && r2 < 0xe000 {
						n += 4
						i += 6
						continue
					}
				}
				r = utf8.RuneError
			}
			n += int64(utf8.RuneLen(r))
		case c == '\\':
			n++
			i += 2
		case c < utf8.RuneSelf:
			n++
			i++
		default:
			r, size := utf8.DecodeRune(raw[i:])
			i += size
			n += int64(utf8.RuneLen(r)) // RuneError (size 1) counts 3
		}
	}
	return n
}

func isSurrogate(r rune) bool { return 0xd800 <= r && r < 0xe000 }

// textLen returns the decoded length of a string's contents.
func textLen(raw []byte, plain bool) int64 {
	if plain {
		return int64(len(raw))
	}
	return decodedLen(raw)
}

// number scans the number token at the position. isInt is true when it is
// an integer that fits an int64 (what encoding/json stores in an int64
// field); v is then its value.
func (s *scanner) number() (v int64, isInt bool) {
	// Most are a few digits, not negative, read in one pass: up to 18
	// digits fit an int64 whatever they are.
	b, i := s.b, s.i
	if i+2 < len(b) { // one or two digits and a ',' or '}': a token count
		w := b[i : i+3 : i+3]
		if d := w[0] - '0'; d <= 9 {
			if w[1] == ',' || w[1] == '}' {
				s.i = i + 1
				return int64(d), true
			}
			if e := w[1] - '0'; e <= 9 && d > 0 && (w[2] == ',' || w[2] == '}') {
				s.i = i + 2
				return int64(d)*10 + int64(e), true
			}
		}
	}
	var u uint64
	j, end := i, min(len(b), i+18)
	for ; j < end; j++ {
		d := b[j] - '0'
		if d > 9 {
			break
		}
		u = u*10 + uint64(d)
	}
	if j > i && (j == i+1 || b[i] != '0') {
		// It ends at the text's end, or at a byte that is no digit
		// (j < end) and starts neither a fraction nor an exponent.
		if j == len(b) || j < end && b[j] != '.' && b[j]|0x20 != 'e' {
			s.i = j
			return int64(u), true
		}
	}
	start := s.i
	if isInt = s.skipNumber(); !isInt {
		return 0, false
	}
	digits := s.b[start:s.i]
	neg := digits[0] == '-'
	if neg {
		digits = digits[1:]
	}
	if len(digits) > 19 {
		return 0, false // past 9223372036854775807 (leading zeros are not JSON)
	}
	u = 0
	for _, c := range digits {
		u = u*10 + uint64(c-'0') // 19 digits fit a uint64
	}
	switch {
	case neg && u <= 1<<63:
		return int64(-u), true
	case !neg && u < 1<<63:
		return int64(u), true
	}
	return 0, false
}

// skipNumber scans the number token at the position; it reports whether it
// is written as an integer (no fraction, no exponent).
func (s *scanner) skipNumber() (integer bool) {
	b, i := s.b, s.i
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i >= len(b) || b[i] < '0' || b[i] > '9':
		s.fail()
		return false
	case b[i] == '0':
		i++
	default:
		i = digitsEnd(b, i)
	}
	integer = true
	if i < len(b) && b[i] == '.' {
		integer = false
		if i++; i >= len(b) || b[i] < '0' || b[i] > '9' {
			s.fail()
			return false
		}
		for i < len(b) && '0' <= b[i] && b[i] <= '9' {
			i++
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		integer = false
		if i++; i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || b[i] < '0' || b[i] > '9' {
			s.fail()
			return false
		}
		for i < len(b) && '0' <= b[i] && b[i] <= '9' {
			i++
		}
	}
	s.i = i
	return integer
}

// digitsEnd returns the index of the first byte at or after i that is not
// an ASCII digit, or len(b), 8 bytes at a time: a byte's high bit is set in
// x-'0'… when it is below '0' and in x+0x46… when it is above '9' (a borrow
// or carry only starts at such a byte, so the lowest flag is exact).
func digitsEnd(b []byte, i int) int {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	for ; i+8 <= len(b); i += 8 {
		x := binary.LittleEndian.Uint64(b[i : i+8 : i+8])
		if hit := ((x - ones*'0') | (x + ones*0x46)) & highs; hit != 0 {
			return i + bits.TrailingZeros64(hit)>>3
		}
	}
	for i < len(b) && '0' <= b[i] && b[i] <= '9' {
		i++
	}
	return i
}

// literal scans true, false or null.
func (s *scanner) literal(word string) {
	if len(s.b)-s.i < len(word) || string(s.b[s.i:s.i+len(word)]) != word {
		s.fail()
		return
	}
	s.i += len(word)
}

// skip scans the value at the position without reading it; depth is the
// number of arrays and objects it is nested in.
func (s *scanner) skip(depth int) {
	switch start := s.i; s.peek() {
	case '"':
		s.str()
		if s.tmpl != nil {
			s.tmpl.skipped(start, s.i, false)
		}
	case '{', '[':
		s.skipNested(depth)
	case 't':
		s.literal("true")
	case 'f':
		s.literal("false")
	case 'n':
		s.literal("null")
	default:
		// Most skipped numbers are one digit, an index or a sequence
		// number, followed by ',' or '}': they save skipNumber's call.
		if b := s.b; start+1 < len(b) && b[start]-'0' <= 9 && (b[start+1] == ',' || b[start+1] == '}') {
			s.i = start + 1
		} else {
			s.skipNumber()
		}
		if s.tmpl != nil {
			s.tmpl.skipped(start, s.i, true)
		}
	}
}

// skipNested scans the array or object at the position, iteratively (an
// adversary's nesting costs no stack): isArray records, per open level,
// whether it is an array; levels past the first 64 spill to a slice. Its
// length buys speed: one loop, with no call per byte or value.
func (s *scanner) skipNested(depth int) {
	var isArray uint64
	var spill []bool
	level := 0
	for {
		// At a value.
		c := s.peek()
		if c == '{' || c == '[' {
			level++
			if depth+level > maxNestingDepth {
				s.fail()
				return
			}
			if level <= 64 {
				isArray = isArray&^(1<<(level-1)) | uint64(btoi(c == '['))<<(level-1)
			} else {
				spill = append(spill[:level-65], c == '[')
			}
			s.i++
			if c == '{' { // keys take member's fast path
				if _, more := s.member(0); more {
					continue
				}
				if s.failed {
					return
				}
				level--
			} else if s.space(); s.peek() == ']' {
				s.i++
				level--
			} else {
				if s.i >= len(s.b) {
					s.fail()
					return
				}
				continue
			}
		} else {
			s.skip(depth + level)
		}
		// After a value: a separator, or the end of one or more levels.
		for {
			if s.failed || level == 0 {
				return
			}
			var array bool
			if level <= 64 {
				array = isArray&(1<<(level-1)) != 0
			} else {
				array = spill[level-65]
			}
			if !array {
				if _, more := s.member(1); more {
					break
				}
				if s.failed {
					return
				}
				level--
				continue
			}
			s.space()
			c := s.peek()
			if c == ',' {
				s.i++
				s.space()
				if s.i >= len(s.b) {
					s.fail()
					return
				}
				break
			}
			if c == ']' {
				s.i++
				level--
				continue
			}
			s.fail()
			return
		}
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
