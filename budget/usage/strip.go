package usage

import (
	"bytes"
	"encoding/json"
)

// EventEnd returns the length of the first complete SSE event in b (up to and
// including its blank line, after LF, CRLF or CR line ends), or -1 when b
// holds no complete event. The scan starts at from (a caller that appends to
// b passes how far the last scan got, so a large event arriving in small
// writes is not scanned again and again).
func EventEnd(b []byte, from int) int {
	for i := max(from-2, 0); i < len(b); i++ {
		if b[i] != '\n' && b[i] != '\r' {
			continue
		}
		// A line ends at i; the event ends if the next line is empty.
		j := i + 1
		if b[i] == '\r' && j < len(b) && b[j] == '\n' {
			j++
		}
		switch {
		case j < len(b) && b[j] == '\n':
			return j + 1
		case j+1 < len(b) && b[j] == '\r' && b[j+1] == '\n':
			return j + 2
		case j < len(b) && b[j] == '\r' && j+1 == len(b):
			return -1 // a CR that may be the start of a CRLF: wait
		case j < len(b) && b[j] == '\r':
			return j + 1
		}
	}
	return -1
}

// IsUsageOnlyChunk reports whether the SSE event ev is the final chunk an
// OpenAI stream sends when asked for usage: "choices" empty, "usage" set.
func IsUsageOnlyChunk(ev []byte) bool {
	if !bytes.Contains(ev, []byte(`"usage"`)) {
		return false
	}
	var data []byte
	for _, line := range bytes.FieldsFunc(ev, func(r rune) bool { return r == '\n' || r == '\r' }) {
		if v, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			data = append(data, bytes.TrimPrefix(v, []byte(" "))...)
		}
	}
	var chunk struct {
		Choices *[]json.RawMessage `json:"choices"`
		Usage   json.RawMessage    `json:"usage"`
	}
	if json.Unmarshal(data, &chunk) != nil {
		return false
	}
	return chunk.Choices != nil && len(*chunk.Choices) == 0 && len(chunk.Usage) > 0 && string(chunk.Usage) != "null"
}
