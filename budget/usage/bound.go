package usage

import (
	"encoding/binary"
	"math/bits"
)

// The running output count of a stream whose API reports no running usage
// is bounded from its text: a byte-level tokenizer never makes a token of
// less than a byte, and measured ones (o200k, cl100k, Claude's public one;
// bench/tokenbound) make at least 2.1 bytes of a token of ordinary ASCII text
// (digits and dates are the densest) and at least 1.7 bytes of one of UTF-8
// above ASCII (emoji are the densest). So the bound over-counts every
// ordinary text measured, English prose about 2.3 times; only random strings
// (base64, hex, punctuation: 1.45 to 1.75 bytes a token) can be
// under-counted, at 0.72 of their tokens at worst.
const (
	asciiBytesPerToken = 2
	// highHalfBytesPerToken is 1.5 bytes a token, in half bytes.
	highHalfBytesPerToken = 3
)

// OutputTokenBound bounds the tokens of streamed output from its text:
// textBytes of it, highBytes of them above ASCII. (A caller also counts at
// least one token for each event with text.)
func OutputTokenBound(textBytes, highBytes int64) int64 {
	highBytes = min(max(highBytes, 0), textBytes)
	ascii := textBytes - highBytes
	return (ascii+asciiBytesPerToken-1)/asciiBytesPerToken + (2*highBytes+highHalfBytesPerToken-1)/highHalfBytesPerToken
}

// HighBytes counts the bytes of p above ASCII: the UTF-8 of characters a
// tokenizer splits finer than ASCII text. It reads 8 bytes at a time: it
// runs on every event of a leased stream.
func HighBytes(p []byte) int64 {
	var n int
	for len(p) >= 8 {
		n += bits.OnesCount64(binary.LittleEndian.Uint64(p) & 0x8080808080808080)
		p = p[8:]
	}
	for _, c := range p {
		n += int(c >> 7)
	}
	return int64(n)
}
