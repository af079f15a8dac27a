package ratelimit

import (
	"context"
	"time"
)

// SlotCount is the count of one time slot of a key's window.
type SlotCount struct {
	Slot  int64
	Count int64
}

// Lease is one store call for one key, run atomically: give back the
// member's grant but Held, push admits into their time slots, and, for a hot
// call, mark Life as having pushed its floor admits of the key and grant up
// to Want admits more, as far as the room allows. The room is Events minus
// the window's pushed admits, the grants (Held included) and F for each slot
// whose floor may hold admits the store has not seen (see lease.lua).
type Lease struct {
	Key    string
	Now    int64 // Unix ms
	Oldest int64 // the oldest time slot that counts
	TTL    time.Duration
	Member int64
	Life   int64 // the member's life in its instance slot (0: none)
	// Hot says the call is of a key on leases: it begins or goes on with the
	// key's hot period and marks Life. Without it the call only pushes and
	// gives the grant back.
	Hot          bool
	Floor        int64 // F
	Events       int64 // the limit
	MaxInstances int
	// Settle is how long after its hot period began every life that takes a
	// slot has heard the key is hot (and keeps it off its floor); Gap the
	// longest pause between hot calls of one period.
	Settle, Gap time.Duration
	Held        int64 // admits of its grant the member keeps
	Want        int64
	Until       int64 // the grant (and Held) counts until then (Unix ms)
	// View says Lives is known: the lives whose floor admits may count,
	// one per slot, its holder's (live, or dead within a window); a slot
	// with none holds no floor back. A life is an instance's tenure of a
	// slot, named by when it began (Unix ms, one apart at least across the
	// fleet).
	View  bool
	Lives []int64
	Push  []SlotCount
}

// LeaseReply is what a Lease left in the store.
type LeaseReply struct {
	// Granted is the grant, or, negative, what the room took back of Held.
	Granted int64
	// Room is what the fleet may still admit of the key past every grant
	// and every floor held back: can be negative.
	Room int64
	// Holders is how many members hold a grant of the key after the call,
	// the caller included.
	Holders int64
	// Pushed is the window's pushed admits; Oldest the oldest time slot
	// that holds some (0: none) and Lapses when the first other grant
	// lapses (Unix ms, 0: none): the room grows when either leaves, at the
	// latest.
	Pushed, Oldest, Lapses int64
	// Err is set when the call failed; it may or may not have applied.
	Err error
}

// HotKey is a key some instance called hot, and until when (Unix ms) it is.
type HotKey struct {
	Key   string
	Until int64
}

// Beat is one instance's heartbeat on the slot table: it renews (or takes,
// Slot -1) an instance slot, or releases it (TTL 0), names the keys it called
// hot since its last beat, and learns the table and the fleet's hot keys.
type Beat struct {
	Member int64
	Slot   int
	Now    int64 // Unix ms
	TTL    time.Duration
	// Flushed says a release pushed every floor admit: the slot is free
	// Settle after it (a hot period that began before has been heard of by
	// then). A holder that dies (or leaves without) keeps it for Keep after
	// its end, while its floor admits may count.
	Flushed      bool
	Keep, Settle time.Duration
	// MaxInstances is the number of slots this instance is configured with.
	// The table keeps the number its counting holders took their slots
	// under; while one counts, an instance configured otherwise takes none.
	MaxInstances int
	// HotKeep is how long a hot key is answered past its Until.
	HotKeep time.Duration
	Hot     []HotKey
}

// SlotTable is what a Beat learns.
type SlotTable struct {
	Slot int   // the instance slot held (-1: none)
	Life int64 // this holder's life in it
	Live int
	// Slots is the fleet's max instances: the number the slots held were
	// taken under (see Beat.MaxInstances); an instance configured otherwise
	// takes no slot while one of them counts.
	Slots int
	// Lives are the lives whose floor admits may count (see Lease.Lives).
	Lives []int64
	Hot   []HotKey
}

// SlotStore holds the fleet's counts and its slot table.
type SlotStore interface {
	// Lease runs every call and fills replies (one per call); the calls are
	// independent. It returns the first error. A store never re-sends a
	// call by itself.
	Lease(ctx context.Context, calls []Lease, replies []LeaseReply) error
	// Beat runs b on the slot table (key) and hot keys (hotKey).
	Beat(ctx context.Context, key, hotKey string, b Beat) (SlotTable, error)
}
