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
//   - Slot. Every instance holds one of MaxInstances numbered slots (the
//     store keeps the fleet's number), taken and renewed by its heartbeat
//     (slots.lua). Its tenure of the slot is a life, named by when it began,
//     with its floor usable at once. A slot released gracefully is free a
//     settle later; a dead holder's a window after its record's end, while
//     its floor admits may count.
//   - Floor. A life may admit F = FloorFraction × events / MaxInstances of
//     a key in any window on its own ring, with no store call. F does not
//     depend on who else is live.
//   - Lease. From three quarters of F on, a key moves to leases: one call
//     (lease.lua) pushes the life's floor admits of the key, marks the life
//     for the key, and grants a block: the requests waiting, and demand
//     ahead as far as risk allows. The room is events minus the window's
//     pushed admits and the grants, minus F for every slot whose floor may
//     hold admits the store has not seen.
//   - Hot key. A key on leases is hot: each call is announced at the
//     caller's next heartbeat, every life hears the hot keys (a new one
//     before it admits anything), pushes and marks those on its floor, and
//     keeps them off its floor until a window after they cool. So once a
//     key's hot period has settled, only the lives older than it that did
//     not mark hold F back; free slots and dead lives that marked hold none.
//   - Window. In any window a key's admits are at most the pushed admits,
//     the grants and F per life that may hold floor admits unseen; the
//     script never lets that sum pass events. Joins, restarts, kills and
//     skew need no rule of their own.
//   - Degrade. When the store is unreachable, an instance admits up to
//     Events per window on its own ring, and the fleet view comes back by
//     itself with the store.
//
// docs/architecture.md names the functions that keep each rule, and the
// Redis keys (hash tags, TTLs) the scripts write.
package ratelimit
