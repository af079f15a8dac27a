// Package budget enforces hard token and dollar budgets in front of an LLM API
// with a reserve → settle model, atomically across a fleet.
//
// Before a request is forwarded, Reserve charges an estimate (prompt tokens
// plus the output cap) to every budget that applies, in one atomic step: all
// budgets admit and are charged, or none is. After the response, Settle
// applies actual − reserved to each of them, idempotently, so the counters end
// at the real usage; Release settles to zero. Budgets use fixed windows aligned
// to the Unix epoch whose index is part of the store key, so a window resets
// without a sweeper.
//
// docs/architecture.md states the invariants (reserve and settle atomic
// across budgets; a lost reply never charges twice) and the Redis keys the
// scripts in redis_store.go write, with their TTLs.
package budget
