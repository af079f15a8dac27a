// Package ratelimit enforces a rate limit that holds across a fleet of
// instances without a store round trip on the request path.
//
// Each key of a zone has two caps. The local cap is a GCRA (burst plus a
// steady rate), exact on this instance. The window cap admits at most Events
// in any interval of the window's length: the window is cut into time slots
// (Limit's precision), and a count is the sum of the slots that overlap the
// window, the oldest counted whole, so it never under-counts. Each instance
// keeps, per key, a ring of its own admits per time slot.
//
// An admit, in the model's words:
//
//   - Slot. Every instance holds one of MaxInstances numbered instance
//     slots, taken and renewed by its heartbeat (slots.lua).
//   - Floor. A slot may admit F = FloorFraction × events / MaxInstances of a
//     key in any window on its own ring, with no store call. F does not
//     depend on who else is live. A fresh slot's floor is usable once no
//     grant made without it can still count (at once for the spare, the free
//     slot every grant holds a floor back for); a dead holder's a window
//     after its last heartbeat.
//   - Lease. From three quarters of F on, a key moves to leases: one call
//     (lease.lua) pushes the slot's floor admits of the key, marks the slot
//     pushed for it, and grants a block sized by this instance's demand and
//     the room: events minus the window's pushed admits and outstanding
//     grants, minus F for every slot that may still hold floor admits and is
//     not marked. Admits on a grant are pushed, per time slot, at the next
//     call; what is left is held on. A grant ends with the marks it relied
//     on, and a mark outlives the grants that relied on it by a window.
//   - Hot key. The heartbeat names the keys on leases; an instance holding
//     one on its floor pushes and marks it at its next pass, so its F goes
//     to the busy instance.
//   - Window. So in any window a key's admits are at most the pushed admits,
//     F per slot not marked, and the grants; the script never lets that sum
//     pass events. Joins, restarts, kills and skew need no rule of their own.
//   - Degrade. When the store is unreachable, an instance admits up to
//     Events per window on its own ring, and the fleet view comes back by
//     itself with the store.
//
// docs/architecture.md names the functions that keep each rule, and the
// Redis keys (hash tags, TTLs) the scripts write.
package ratelimit
