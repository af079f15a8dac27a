// Package ratelimit enforces a rate limit that holds across a fleet of
// instances without a store round trip on the request path.
//
// Each key of a zone has two caps. The local cap is a GCRA (burst plus a steady
// rate), exact on this instance. The window cap admits at most Events in any
// interval of the window's length: the window is cut into slots (Limit's
// precision), and a key's count is the sum of the slots that overlap the
// window, the oldest counted whole, so it never under-counts.
//
// Each instance keeps, per key, a ring of slot counts: the fleet's counts as
// of the last read, merged with its own admits. A background reconciler runs
// one store step per active key and pass (add the claimed admits to their
// slots, drop old slots, re-arm the expiry, return the window), all keys of a
// pass in one pipelined round trip. Near the limit it syncs a key early, and
// an instance admits only its share of a small headroom. Keys far below their
// limit need no store at all: each instance may admit a floor share of them
// on its own count (floor shares hold across restarts and joins: see
// Engine.see), and a key busy on one instance is announced hot so that the
// others stop using theirs. A limit too small to share out is admitted on
// reservations the store counts ahead (reserve.go). When the store is
// unreachable the ring still holds this instance's own admits, so the limit
// degrades to exactly Events per window per instance instead of failing
// requests.
//
// docs/architecture.md states these invariants with the functions that keep
// them, and the Redis keys (hash tags, TTLs) that sync.lua and heartbeat.lua
// write.
package ratelimit
