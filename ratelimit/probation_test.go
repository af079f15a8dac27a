package ratelimit

import (
	"math/rand/v2"
	"testing"
)

// The timeline counts the claims at every instant as the terms say, and
// the fewest claims of a term is the least count over it.
func TestClaimsTimelineCountsTheTerms(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 200 {
		terms := make([]probationTerm, rng.IntN(8))
		for i := range terms {
			from := rng.Int64N(100)
			to := from + rng.Int64N(50)
			terms[i] = probationTerm{from: from, to: to, held: from + rng.Int64N(60)}
		}
		count := func(at int64) int64 {
			var n int64
			for _, u := range terms {
				if u.from <= at && at < u.to {
					n++
				}
			}
			return n
		}
		tl := timelineOf(terms)
		for at := int64(-1); at < 160; at++ {
			if got, want := tl.claimsAt(at), count(at); got != want {
				t.Fatalf("round %d: %d claims at %d, want %d (terms %v)", round, got, at, want, terms)
			}
		}
		const now = 120
		for _, u := range terms {
			want := count(u.from)
			for at := u.from; at <= min(u.held, now); at++ {
				want = min(want, count(at))
			}
			if got := tl.fewestClaims(u, now); got != max(want, 1) {
				t.Fatalf("round %d: fewest claims of %v: %d, want %d", round, u, got, max(want, 1))
			}
		}
	}
}
