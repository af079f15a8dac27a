package usage

import "testing"

func TestOutputTokenBound(t *testing.T) {
	cases := []struct {
		name              string
		text, high, bound int64
	}{
		{"nothing", 0, 0, 0},
		{"ascii, two bytes a token, rounded up", 5, 0, 3},
		{"high bytes, one and a half a token", 6, 6, 4},
		{"a 4-byte emoji", 4, 4, 3},
		{"mixed", 10, 3, 4 + 2},
		{"high bytes beyond the text are text", 2, 9, 2},
	}
	for _, c := range cases {
		if got := OutputTokenBound(c.text, c.high); got != c.bound {
			t.Errorf("%s: OutputTokenBound(%d, %d) = %d, want %d", c.name, c.text, c.high, got, c.bound)
		}
	}
	for _, s := range []string{"", "a€😀b", "plain ascii, longer than eight bytes", "ünïcödé everywhere: 日本語のテキスト 🎉🎉", "\xff\xff\xff\xff\xff\xff\xff\xff\xff"} {
		want := 0
		for i := 0; i < len(s); i++ {
			if s[i] >= 0x80 {
				want++
			}
		}
		if got := HighBytes([]byte(s)); got != int64(want) {
			t.Errorf("HighBytes(%q) = %d, want %d", s, got, want)
		}
	}
}
