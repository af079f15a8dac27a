package ratelimit

import (
	"context"
	"sync"
	"time"
)

// SlotCount is the count of one slot of a key's window.
type SlotCount struct {
	Slot  int64
	Count int64
}

// Step is one reconcile pass's work on one key, run atomically by the store:
// add the claimed admits to their slots and the demand to the key's demand
// counter, drop the slots older than Oldest, re-arm the key's expiry to TTL,
// and return what is left.
type Step struct {
	Key    string
	Adds   [2]SlotCount // Count 0: nothing to add
	Demand int64
	Oldest int64
	TTL    time.Duration
	// Window holds more admits to add, one per slot: those an instance made
	// under its floor share, pushed when it starts syncing the key.
	Window []SlotCount
	// Member, when not 0, is the instance taking part: it is registered as
	// syncing the key until Now+MemberTTL (Unix ms), or deregistered when
	// MemberTTL is 0.
	Member    int64
	Now       int64
	MemberTTL time.Duration
}

// Reply is what a Step left in the store.
type Reply struct {
	// Slots are the key's slots from Oldest on, in no particular order.
	Slots []SlotCount
	// Demand is the key's demand counter: every request any instance has seen
	// for the key while it was stored.
	Demand int64
	// Syncing is how many other instances are registered as syncing the key
	// (their admits are in Slots); every other live instance may hold up to
	// its floor share unreported.
	Syncing int64
	// Err is set when the step failed; it may or may not have applied.
	Err error
}

// Membership is what a heartbeat learns of the fleet.
type Membership struct {
	// Live is how many members are live, the caller included: the fleet's
	// size.
	Live int64
	// Fresh is true when the membership was empty before this heartbeat (a
	// new fleet, or a store that restarted empty): the other live members
	// may not have heartbeated yet.
	Fresh bool
}

// SlotStore holds the fleet's slot counts, one entry per zone and key.
type SlotStore interface {
	// Sync runs every step and fills replies (one per step). Steps are
	// independent: one that fails does not stop the others. It returns the
	// first step's error, if any. A store never re-sends a step by itself.
	Sync(ctx context.Context, steps []Step, replies []Reply) error
	// Heartbeat registers member as live in the membership key until
	// now+ttl (Unix ms) and returns the fleet as it stands.
	Heartbeat(ctx context.Context, key string, member, now int64, ttl time.Duration) (Membership, error)
}

// MemoryStore is the embedded SlotStore of a single instance (and, shared by
// several engines, a fleet in tests).
type MemoryStore struct {
	mu      sync.Mutex
	keys    map[string]*memoryKey
	members map[string]map[int64]int64 // membership key -> member -> live until (Unix ms)
	now     func() time.Time
}

type memoryKey struct {
	slots   map[int64]int64
	demand  int64
	syncing map[int64]int64 // member -> registered until (Unix ms)
	expires time.Time
}

var _ SlotStore = (*MemoryStore)(nil)

// NewMemoryStore returns an empty in-process slot store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{keys: make(map[string]*memoryKey), members: make(map[string]map[int64]int64), now: time.Now}
}

// Heartbeat implements SlotStore.
func (m *MemoryStore) Heartbeat(_ context.Context, key string, member, now int64, ttl time.Duration) (Membership, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	set := m.members[key]
	fresh := len(set) == 0
	if set == nil {
		set = make(map[int64]int64)
		m.members[key] = set
	}
	set[member] = now + ttl.Milliseconds()
	return Membership{Live: liveMembers(set, now, 0), Fresh: fresh}, nil
}

// liveMembers counts the members of set live at now (Unix ms), but except,
// and forgets the others.
func liveMembers(set map[int64]int64, now, except int64) int64 {
	var n int64
	for member, until := range set {
		switch {
		case until <= now:
			delete(set, member)
		case member != except:
			n++
		}
	}
	return n
}

// Sync implements SlotStore.
func (m *MemoryStore) Sync(_ context.Context, steps []Step, replies []Reply) error {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := range steps {
		replies[i] = m.step(&steps[i], now)
	}
	return nil
}

func (m *MemoryStore) step(st *Step, now time.Time) Reply {
	k := m.keys[st.Key]
	if k != nil && !now.Before(k.expires) {
		delete(m.keys, st.Key)
		k = nil
	}
	writes := st.Demand > 0 || (st.Member != 0 && st.MemberTTL > 0)
	for _, a := range st.Adds {
		writes = writes || (a.Count > 0 && a.Slot >= st.Oldest)
	}
	for _, a := range st.Window {
		writes = writes || (a.Count > 0 && a.Slot >= st.Oldest)
	}
	if k == nil && !writes {
		return Reply{}
	}
	if k == nil {
		k = &memoryKey{slots: make(map[int64]int64), syncing: make(map[int64]int64)}
		m.keys[st.Key] = k
	}
	for _, adds := range [][]SlotCount{st.Adds[:], st.Window} {
		for _, a := range adds {
			if a.Count > 0 && a.Slot >= st.Oldest {
				k.slots[a.Slot] += a.Count
			}
		}
	}
	k.demand += st.Demand
	switch {
	case st.Member != 0 && st.MemberTTL > 0:
		k.syncing[st.Member] = st.Now + st.MemberTTL.Milliseconds()
	case st.Member != 0:
		delete(k.syncing, st.Member)
	}
	r := Reply{Demand: k.demand, Syncing: liveMembers(k.syncing, st.Now, st.Member), Slots: make([]SlotCount, 0, len(k.slots))}
	for s, c := range k.slots {
		if s < st.Oldest {
			delete(k.slots, s)
			continue
		}
		r.Slots = append(r.Slots, SlotCount{Slot: s, Count: c})
	}
	k.expires = now.Add(st.TTL)
	return r
}

// Sweep drops expired keys; the reconciler calls it with its evictions.
func (m *MemoryStore) Sweep() {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	for name, k := range m.keys {
		if !now.Before(k.expires) {
			delete(m.keys, name)
		}
	}
}
