package usage

import "unicode/utf8"

// TokenCounter counts the tokens of a text as a model's tokenizer encodes
// it (bpe.Counter). Count must not keep text, and should not allocate: it
// runs on every output value of a stream.
type TokenCounter interface {
	Count(text []byte) int64
}

// maxCountedEscaped bounds an output value with escapes that is decoded to
// be counted; a longer one counts a token a byte.
const maxCountedEscaped = 2048

// textCount counts the tokens of a stream's output text, each output value
// (a text field of one event) alone, as the meter reads it. The sum over
// values is no count of the whole text: a token the stream's chunking cuts
// in two counts twice, which errs on the side of charging.
type textCount struct {
	counter TokenCounter
	// tokens counts the values read; bytes is their decoded length (the
	// meter's OutputTextBytes for the same values).
	tokens, bytes int64
	buf           [maxCountedEscaped]byte
}

// text counts the string value raw (its contents, escaped as written; plain:
// with no escape and valid UTF-8) of decoded length n.
func (c *textCount) text(raw []byte, plain bool, n int64) {
	c.bytes += n
	switch {
	case plain:
		c.tokens += c.counter.Count(raw)
	case n > maxCountedEscaped:
		c.tokens += n
	default:
		c.tokens += c.counter.Count(appendDecoded(c.buf[:0], raw))
	}
}

// strict counts a value of n bytes a token a byte: one counted as written
// (JSON arguments), or one that holds no text the model wrote.
func (c *textCount) strict(n int64) {
	c.bytes += n
	c.tokens += n
}

// appendDecoded appends the contents of a string token, raw, decoded as
// decodedLen counts them: escapes decoded, each byte of invalid UTF-8 and
// each unpaired surrogate replaced by U+FFFD.
func appendDecoded(dst, raw []byte) []byte {
	for i := 0; i < len(raw); {
		c := raw[i]
		switch {
		case c == '\\' && raw[i+1] == 'u':
			r := hex4(raw[i+2 : i+6])
			i += 6
			if isSurrogate(r) {
				if i+6 <= len(raw) && raw[i] == '\\' && raw[i+1] == 'u' {
					if r2 := hex4(raw[i+2 : i+6]); r < 0xdc00 && 0xdc00 <= r2 && r2 < 0xe000 {
						dst = utf8.AppendRune(dst, 0x10000+(r-0xd800)<<10+(r2-0xdc00))
						i += 6
						continue
					}
				}
				r = utf8.RuneError
			}
			dst = utf8.AppendRune(dst, r)
		case c == '\\':
			dst = append(dst, unescape(raw[i+1]))
			i += 2
		case c < utf8.RuneSelf:
			dst = append(dst, c)
			i++
		default:
			r, size := utf8.DecodeRune(raw[i:])
			i += size
			dst = utf8.AppendRune(dst, r)
		}
	}
	return dst
}
