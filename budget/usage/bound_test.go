package usage

import "testing"

func TestOutputTokenBound(t *testing.T) {
	cases := []struct {
		name                      string
		text, high, deltas, bound int64
	}{
		{"nothing", 0, 0, 0, 0},
		{"ascii, two bytes a token, rounded up", 5, 0, 1, 3},
		{"high bytes, one and a half a token", 6, 6, 1, 4},
		{"a 4-byte emoji", 4, 4, 1, 3},
		{"mixed", 10, 3, 2, 4 + 2},
		{"one token a delta at least", 4, 0, 7, 7},
		{"high bytes beyond the text are text", 2, 9, 0, 2},
	}
	for _, c := range cases {
		if got := OutputTokenBound(c.text, c.high, c.deltas); got != c.bound {
			t.Errorf("%s: OutputTokenBound(%d, %d, %d) = %d, want %d", c.name, c.text, c.high, c.deltas, got, c.bound)
		}
	}
	if got := HighBytes([]byte("a€😀b")); got != 3+4 {
		t.Errorf("HighBytes = %d, want 7", got)
	}
}
