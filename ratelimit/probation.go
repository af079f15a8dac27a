package ratelimit

import (
	"cmp"
	"slices"
)

// Probation shares: what an instance that may not take its floor share yet
// (it joined less than a window ago, see fleetView.eligible) admits of a
// key on its own count, so that a fleet that grows does not send its new
// instances' keys to the store.

// probationFraction is the part of a key's limit the instances on
// probation share: each admits probationFraction × events / probation
// claims of a key in any window, where the claims are the instances on
// probation and, for a window, those gone on probation (probationTerm). A
// fleet whose instances keep restarting has so many claims that the shares
// come to none, and its new instances sync what they see. It comes out of
// what the floor shares leave.
const probationFraction = 0.05

// probationShare is one probation share of events among claims, or 0 when
// there is none (see share).
func probationShare(events, claims int64) int64 {
	return cut(probationFraction, events, claims)
}

// probationTerm is when an instance holds a probation claim, as every
// instance works it out from the membership's records (Unix ms): from half
// a heartbeat lifetime after it joined, when every other instance has
// counted it, until a window after it stopped holding the share (it ended,
// or it may take its floor share). An instance on probation cuts its share
// by the claims its records show at its heartbeat, so its share was never
// larger than one cut by the fewest claims at any time of its term
// (fewestClaims): that is what the others leave aside for it.
type probationTerm struct {
	from, to int64
	// held is until when it may have admitted on its share: its end, or
	// when it may take its floor share.
	held int64
}

// probationTermOf is r's term, if r is of an instance that may hold a
// probation share (not a founder of the fleet).
func probationTermOf(r MemberRecord, founder bool, eligibleAt, windowMs, staleMs int64) (probationTerm, bool) {
	t := probationTerm{from: r.Joined + staleMs/2, held: min(eligibleAt, r.Until)}
	t.to = t.held + windowMs // what it admitted stays in the window
	if founder || t.from >= t.held {
		return probationTerm{}, false // (an empty term counts no claim)
	}
	return t, true
}

// claimsTimeline is the count of probation claims over time: at each
// instant a term starts or ends (Unix ms, ascending), the count from then on.
type claimsTimeline struct {
	at     []int64
	claims []int64
}

// timelineOf sweeps the terms' starts and ends once, so that the fewest
// claims of every term costs a scan, not a count per instant.
func timelineOf(terms []probationTerm) claimsTimeline {
	type edge struct{ at, delta int64 }
	edges := make([]edge, 0, 2*len(terms))
	for _, t := range terms {
		if t.from < t.to {
			edges = append(edges, edge{t.from, 1}, edge{t.to, -1})
		}
	}
	slices.SortFunc(edges, func(x, y edge) int { return cmp.Compare(x.at, y.at) })
	var tl claimsTimeline
	var n int64
	for i, e := range edges {
		n += e.delta
		if i+1 < len(edges) && edges[i+1].at == e.at {
			continue // the count after every edge at this instant
		}
		tl.at = append(tl.at, e.at)
		tl.claims = append(tl.claims, n)
	}
	return tl
}

// claimsAt is the count of claims at atMs.
func (tl claimsTimeline) claimsAt(atMs int64) int64 {
	i, found := slices.BinarySearch(tl.at, atMs)
	if !found {
		i--
	}
	if i < 0 {
		return 0
	}
	return tl.claims[i]
}

// fewestClaims is the fewest claims at any time from t's start until it
// stopped holding or nowMs (at least 1: its own).
func (tl claimsTimeline) fewestClaims(t probationTerm, nowMs int64) int64 {
	end := min(t.held, nowMs)
	least := tl.claimsAt(t.from)
	for i, at := range tl.at {
		if at > t.from && at <= end {
			least = min(least, tl.claims[i])
		}
	}
	return max(least, 1)
}

// probationAside is what a key leaves aside for the live instances on
// probation that may admit it unseen: for each, a probation share cut by
// the fewest claims of its term (probationFewest).
func probationAside(z *Zone, events int64) int64 {
	live := z.fleet.probationFewest.Load()
	if live == nil {
		return 0
	}
	var aside int64
	for _, fewest := range *live {
		aside += probationShare(events, fewest)
	}
	return aside
}
