package fleetguard

import (
	"testing"

	"github.com/fleetguard/fleetguard/budget"
)

func TestFormatAmountInTheBudgetsUnit(t *testing.T) {
	for _, tt := range []struct {
		unit budget.Unit
		n    int64
		want string
	}{
		{budget.Tokens, 39880, "39880 tokens"},
		{budget.USD, 25_000_000, "$25.00"},
		{budget.USD, 25_204_725, "$25.204725"},
		{budget.USD, 10_013, "$0.010013"},
		{budget.USD, 500_000, "$0.50"},
		{budget.USD, 1, "$0.000001"},
		{budget.USD, 0, "$0.00"},
		{budget.USD, -1_500_000, "-$1.50"},
	} {
		if got := formatAmount(tt.unit, tt.n); got != tt.want {
			t.Errorf("formatAmount(%v, %d) = %q, want %q", tt.unit, tt.n, got, tt.want)
		}
	}
}
