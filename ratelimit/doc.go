// Package ratelimit enforces a rate limit that holds across a fleet of
// instances without a store round trip on the request path.
//
// Each key of a zone has two caps. The local cap is a GCRA (burst plus a steady
// rate) that is exact on this instance. The fleet cap is a sliding-window limit
// whose view of the other instances is a cached estimate: a background
// reconciler claims this instance's admits, pushes them to a shared counter
// store (INCRBY in MULTI/EXEC), reads the current and previous epoch counters
// back and refreshes the estimate. When the store is unreachable the estimate
// goes stale and is ignored, so the fleet cap degrades to a per-instance cap
// instead of failing requests. The worst-case fleet overshoot is about
// (N-1) x rate x sync interval.
package ratelimit
