package usage

import (
	"strings"
	"testing"
)

func TestEventEnd(t *testing.T) {
	tests := []struct {
		in   string
		want int
	}{
		{"data: x\n\n", 9},
		{"data: x\n\ndata: y\n\n", 9},
		{"data: x\r\n\r\n", 11},
		{"data: x\r\r", -1}, // the last CR may start a CRLF
		{"data: x\r\rdata", 9},
		{"data: x\n", -1},
		{"data: x", -1},
		{"", -1},
	}
	for _, tt := range tests {
		if got := EventEnd([]byte(tt.in), 0); got != tt.want {
			t.Errorf("EventEnd(%q) = %d, want %d", tt.in, got, tt.want)
		}
	}
}

func TestIsUsageOnlyChunk(t *testing.T) {
	tests := []struct {
		ev   string
		want bool
	}{
		{`data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}` + "\n\n", true},
		{`data: {"id":"c","choices":[{"delta":{"content":"usage"}}],"usage":null}` + "\n\n", false},
		{`data: {"id":"c","choices":[],"usage":null}` + "\n\n", false},
		{"data: [DONE]\n\n", false},
		{`data: {"choices":[{"delta":{"content":"\"usage\""}}]}` + "\n\n", false},
	}
	for _, tt := range tests {
		if got := IsUsageOnlyChunk([]byte(tt.ev)); got != tt.want {
			t.Errorf("IsUsageOnlyChunk(%q) = %v, want %v", strings.TrimSpace(tt.ev), got, tt.want)
		}
	}
}
