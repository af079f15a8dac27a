package budget

import (
	"context"
	"time"
)

// Charge is one budget's part of a reservation.
type Charge struct {
	Key    string
	Amount int64
	// Limit is the limit of the counter unless the override table holds
	// one for Override.
	Limit int64
	TTL   time.Duration
	// Overrides and Override name the limit set at run time for this
	// counter's scope value: the field Override of the table Overrides (see
	// SetOverride). Reserve reads it in its atomic step, so an override
	// costs no call of its own. Empty: Limit holds. The charges of one
	// Reserve name one table. Extend does not read them: an extension's
	// charges carry the limit the reserve found.
	Overrides, Override string
}

// ReserveResult is the answer of Store.Reserve.
type ReserveResult struct {
	Admitted bool
	// Cancelled is true when the reservation's record already existed: it was
	// released (or settled) before this reserve ran, so nothing is charged.
	Cancelled bool
	// Denied is the index of the first charge that did not fit; -1 when admitted.
	Denied int
	// Used is each counter after the reservation, or as it stands when denied.
	Used []int64
	// Limits is each counter's limit in force: its override, else its
	// charge's Limit.
	Limits []int64
}

// ExtendResult is the answer of Store.Extend.
type ExtendResult struct {
	Admitted bool
	// Gone is true when the reservation is not held any more (settled,
	// expired, lost with the store's data): nothing is charged.
	Gone bool
	// Denied is the index of the first charge that did not fit; -1 when admitted.
	Denied int
	// Used is each counter after the extension, or as it stands when denied.
	Used []int64
}

// Adjustment settles one counter of a reservation: the counter moves from
// what the reservation holds of it (its reserve and every extension) to
// Amount, and re-arms its TTL; a counter that falls to 0 or below is deleted
// (it reads 0). Amount KeepHeld keeps what is held.
type Adjustment struct {
	Key    string
	Amount int64
	TTL    time.Duration
	// Top and Member, when Member is set, keep the counter's value after
	// the settle as Member's score in the sorted set Top (see Store.Top):
	// the spenders of a budget's window. Top takes the counter's TTL.
	Top, Member string
	// Alerts are counter values, ascending, at which the counter's scope
	// value is told once per window, fleet-wide: the first settle to leave
	// the counter at or past one marks it in the hash Alerted (which takes
	// the counter's TTL) and reports it in Crossed.
	Alerts  []Alert
	Alerted string
	// Crossed and After are written by Settle, when it applies: the
	// indexes of the Alerts this settle was the first to reach, and the
	// counter's value after it.
	Crossed []int
	After   int64
}

// Alert is one threshold of an Adjustment: a counter value, and the field
// that marks it reached in the alerted hash.
type Alert struct {
	At    int64
	Field string
}

// TopSize bounds a Top set: past it, a settle drops the lowest members. A
// dropped member comes back with its whole counter at its next settle.
const TopSize = 1000

// TopEntry is one member of a Top set and its counter.
type TopEntry struct {
	Member string
	Used   int64
}

// Record names a reservation's record and its owner, the instance that made
// it, whose open reservations the fleet settles should it fall silent.
type Record struct {
	Key string
	// Owners is the key of the owners' sorted set (by the store's clock of
	// each owner's last word); Owner names this reservation's. Both carry
	// the record's hash tag.
	Owners, Owner string
}

// open is the key of the set of the owner's open reservations.
func (r Record) open() string { return openKey(r.Owners, r.Owner) }

func openKey(owners, owner string) string { return owners + ":" + owner }

// Grant is what a lapse of a reservation returns of each of its counters
// (in the reserve's order): the part of its hold its instance had not yet
// been granted to use. Grants of a record are numbered from 1; a lower
// number than the last written is stale and changes nothing.
type Grant struct {
	Record  string
	Seq     int64
	Returns []int64
}

// KeepHeld is the Adjustment amount that charges what a reservation holds.
const KeepHeld = -1

// Store keeps budget counters and one record per reservation. The record
// makes a reservation exact under lost replies: Reserve charges nothing if
// the record exists, and writes it, with what it holds of each counter, when
// it charges; Extend adds to a reserved record once; Settle applies only to a
// reserved record, once, and leaves a tombstone where there was none, so a
// reserve that runs after its release (a stalled server, a lost reply)
// charges nothing. A Store never re-sends a command by itself.
type Store interface {
	// Reserve adds every charge if each counter stays within its limit, and
	// adds none otherwise, in one atomic step; when it adds, it writes the
	// record (kept for recordTTL). A charge of 0 writes no counter.
	// The reservation joins its owner's open reservations, and the owner's
	// last word is now (see Sweep).
	Reserve(ctx context.Context, rec Record, recordTTL time.Duration, charges []Charge) (ReserveResult, error)
	// Extend adds every charge to a reserved record's counters if each
	// stays within its limit, and none otherwise, in one atomic step, and
	// adds them to what the record holds. Extensions are numbered from 1 and
	// apply in order, once: a repeat of one that applied (its reply was
	// lost) is admitted without charging again. The charges name the
	// reserve's counters in the reserve's order.
	Extend(ctx context.Context, record string, seq int, charges []Charge) (ExtendResult, error)
	// Settle applies every adjustment in one atomic step if the record is
	// reserved (adjs name the reserve's counters in the reserve's order),
	// deletes the record and every counter that falls to 0 or below; applied is false when there was no reserved record (settled
	// already, expired, lost with the store's data, or never reserved: then
	// a tombstone is kept for ttl, which cancels a reserve arriving late).
	// An applied settle takes the reservation out of its owner's open ones.
	Settle(ctx context.Context, rec Record, ttl time.Duration, adjs []Adjustment) (applied bool, err error)
	// Grant writes, for each grant whose number is above the last its
	// record took, what a lapse of the reservation returns of each counter
	// (see Sweep), and makes now the owner's last word, in one step. Gone
	// reports, by grant, a record not reserved any more (settled, swept,
	// expired): nothing is written to it. With no grants it is the owner's
	// word alone.
	Grant(ctx context.Context, owners, owner string, grants []Grant) (gone []bool, err error)
	// Sweep settles, in one step, at most n open reservations of the owners
	// whose last word is lapse or more ago by the store's clock, except's
	// apart: each counter moves from what the reservation holds to that
	// less what its last grant returns (nothing without a grant), and the
	// record becomes a tombstone, so the owner's own settle, should it come
	// after all, applies nothing. An owner with no open reservation left
	// leaves the owners' set. It reports how many it settled.
	Sweep(ctx context.Context, owners, except string, lapse time.Duration, n int) (int, error)
	// Get reads counters; a missing one reads 0.
	Get(ctx context.Context, keys []string) ([]int64, error)
	// Reset zeroes counters (a missing one stays 0), in one step. The records
	// of reservations are left as they are.
	Reset(ctx context.Context, keys []string) error
	// Ping checks that the store answers.
	Ping(ctx context.Context) error
	// SetOverride sets the limit of field in the override table (kept until
	// changed, without a TTL); a limit of 0 or less deletes the field, so
	// the charge's own Limit holds again.
	SetOverride(ctx context.Context, table, field string, limit int64) error
	// Override reads field of the override table; 0 when there is none.
	Override(ctx context.Context, table, field string) (int64, error)
	// Top reads the n members of the sorted set top with the largest
	// counters, largest first (ties: the greater member first).
	Top(ctx context.Context, top string, n int) ([]TopEntry, error)
	// MarkOnce marks field in the hash marks (which is kept for ttl from
	// its first mark) and reports whether this call was the first to: of
	// all the fleet's calls, one is.
	MarkOnce(ctx context.Context, marks, field string, ttl time.Duration) (bool, error)
	// MergeLearned merges l into the Learned kept under key (by Merge, kept
	// for ttl from the last merge) and returns the union.
	MergeLearned(ctx context.Context, key string, l Learned, ttl time.Duration) (Learned, error)
}
