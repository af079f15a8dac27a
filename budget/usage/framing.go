package usage

import (
	"bytes"
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
// OpenAI stream sends when asked for usage: "choices" empty, "usage" set
// (keys by exact case, the last of a repeated key counting). The data lines
// are joined as they are, without a separator.
func IsUsageOnlyChunk(ev []byte) bool {
	if !bytes.Contains(ev, []byte(`"usage"`)) {
		return false
	}
	data, lines := []byte(nil), 0
	var joined []byte
	for rest := ev; len(rest) > 0; {
		line := rest
		if i := lineEnd(rest); i >= 0 {
			line, rest = rest[:i], rest[i+1:]
		} else {
			rest = nil
		}
		v, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		v = bytes.TrimPrefix(v, []byte(" "))
		switch lines++; lines {
		case 1:
			data = v
		case 2:
			joined = append(append(joined, data...), v...)
		default:
			joined = append(joined, v...)
		}
	}
	if lines > 1 {
		data = joined
	}
	return usageOnly(data)
}

// usageOnly reads a chat chunk: true when its choices are an empty array and
// its usage is not null.
func usageOnly(data []byte) bool {
	s := scanner{b: data}
	s.space()
	if s.peek() != '{' {
		return false
	}
	s.i++
	choices, usage := -1, false // choices: -1 when absent or null
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			break
		}
		switch string(key) {
		case "choices":
			isArray, ok := s.array(1)
			if !ok {
				return false
			}
			choices = -1
			if isArray {
				choices = 0
				for s.element(choices) {
					s.skip(2)
					choices++
				}
			}
		case "usage":
			usage = s.peek() != 'n'
			s.skip(1)
		default:
			s.skip(1)
		}
	}
	if s.failed {
		return false
	}
	s.space()
	return s.i == len(s.b) && choices == 0 && usage
}
