package ratelimit

import "github.com/fleetguard/fleetguard/internal/keyhash"

// A key that arrives while its zone tracks max_keys keys already is not
// tracked: it has no slot ring and is not synced with the fleet. It is still
// limited, by the local cap alone (the zone's GCRA: Burst at once, Events per
// Window at a steady rate, on this instance), with a GCRA state of its own
// kept in a small table of fixed size. A state of its own, rather than a
// bucket shared with other untracked keys, is what keeps a flood of unique
// keys from refusing a new key: whatever the other keys do, a key's first
// request finds either its own state or a fresh one.
//
// The table is set-associative: a key's hash picks one set of untrackedWays
// states in its shard (guarded by the shard's lock, which the request holds
// anyway), and a key missing from its set takes the place of the state that
// forgives least when dropped (see find). Dropping a state can only make its
// key's next request more lenient, never refuse anyone.
const (
	untrackedWays         = 8 // states per set: a lookup compares at most this many hashes
	untrackedSetsPerShard = 32

	// UntrackedKeys is how many untracked keys a zone holds a local cap for
	// at once: 16384 states of untrackedStateBytes, 384 KiB per zone, taken
	// a shard (6 KiB) at a time the first time the zone is full.
	UntrackedKeys = shardCount * untrackedSetsPerShard * untrackedWays

	untrackedStateBytes = 24
)

// untrackedState is the local cap of one untracked key. An unused state (a
// zero hash and tat) is the same as a fresh one, so it needs no flag: a key
// whose hash is zero would find it and be judged as new, which it is.
type untrackedState struct {
	hash keyhash.Hash
	tat  int64 // the GCRA's theoretical arrival time, Unix ns
}

type untrackedTable [untrackedSetsPerShard][untrackedWays]untrackedState

// find returns h's state, making room for it in its set when it has none.
// The state it replaces is the one with the earliest theoretical arrival
// time: one whose time has passed holds nothing a fresh state does not, and
// among the others the earliest is the closest to fresh, so dropping it
// forgives its key the fewest requests. A key that spends its burst holds the
// latest time in its set and is dropped last, while a flood of keys that send
// a request or two each replaces its own states first. The shard's
// lock is held.
func (t *untrackedTable) find(h keyhash.Hash) *untrackedState {
	set := &t[h.Hi&(untrackedSetsPerShard-1)] // the shard took h.Lo's low bits
	victim := &set[0]
	for i := range set {
		st := &set[i]
		if st.hash == h {
			return st
		}
		if st.tat < victim.tat {
			victim = st
		}
	}
	*victim = untrackedState{hash: h}
	return victim
}

// take removes h's state and returns its theoretical arrival time (0 when h
// has none), for a key that the zone starts to track. The shard's lock is
// held.
func (t *untrackedTable) take(h keyhash.Hash) int64 {
	set := &t[h.Hi&(untrackedSetsPerShard-1)]
	for i := range set {
		if st := &set[i]; st.hash == h {
			tat := st.tat
			*st = untrackedState{}
			return tat
		}
	}
	return 0
}
