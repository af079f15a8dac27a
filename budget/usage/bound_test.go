package usage

import "testing"

func TestOutputTokenBoundIsAByteATokenAndTheOverhead(t *testing.T) {
	for _, c := range []struct{ text, bound int64 }{
		{0, OutputOverheadTokens},
		{1, 1 + OutputOverheadTokens},
		{4096, 4096 + OutputOverheadTokens},
		{-3, OutputOverheadTokens}, // a broken count reads as none
	} {
		if got := OutputTokenBound(c.text); got != c.bound {
			t.Errorf("OutputTokenBound(%d) = %d, want %d", c.text, got, c.bound)
		}
	}
}
