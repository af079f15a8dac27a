package ratelimit

import (
	"bytes"
	"context"
	"slices"
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
	// Floor holds the admits an instance made under its floor share, one
	// count per slot, pushed when it starts syncing the key. FloorID names
	// the push: a store applies it once, however often it is sent (a push
	// whose reply was lost is sent again, and may have been applied).
	Floor   []SlotCount
	FloorID string
	// Moved takes reserved admits out of their slot (a negative count), as
	// they were made in later slots (see claimMoved); Count 0: none.
	Moved SlotCount
	// Member, when not 0, is the instance taking part: it is registered as
	// syncing the key until Now+MemberTTL (Unix ms), or deregistered when
	// MemberTTL is 0.
	Member    int64
	Now       int64
	MemberTTL time.Duration
	// Reserve, when above 0, asks the store to count up to Reserve admits in
	// slot Adds[0].Slot ahead of time, as far as the window's count stays
	// within Limit: the instance may then make them without telling anyone
	// (see Reply.Reserved).
	Reserve, Limit int64
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
	// Reserved is how many admits the step reserved (see Step.Reserve); they
	// are in Slots.
	Reserved int64
	// Err is set when the step failed; it may or may not have applied.
	Err error
}

// Heartbeat is one instance's heartbeat: it tells the fleet the instance is
// live and which keys it syncs because they are busy here, and asks what the
// fleet looks like.
type Heartbeat struct {
	// Member is the instance's number, Now the time (Unix ms).
	Member, Now int64
	// TTL is how long the instance counts as live without another
	// heartbeat; 0 says it leaves now.
	TTL time.Duration
	// Joined is when this instance first heartbeated (Unix ms): the start of
	// its life, whatever became of the store since.
	Joined int64
	// Seen is when this instance last learned the fleet (Unix ms): Now for a
	// heartbeat, its last heartbeat for a leave. What it did on a floor
	// share, it did knowing the fleet as of then.
	Seen int64
	// Keep is how long a record outlives its instance: the longest window
	// of its zones, during which what it admitted still counts. The store
	// keeps every record for the longest Keep any member asked for.
	Keep time.Duration
	// Hot are the keys this instance syncs because they are busy here.
	Hot []HotKey
	// Promise bounds what this instance may have admitted of each key on
	// its floor share without pushing it (see promise.go); nil keeps the
	// one it sent last.
	Promise []byte
	// Known are the gone members' promises this instance holds, each as of
	// its record's Until: the store does not send one again while the
	// record is unchanged (see MemberRecord.PromiseKnown), so a fleet with
	// many gone members does not read them all at every heartbeat.
	Known []KnownPromise
}

// KnownPromise names a gone member's promise a heartbeat's sender holds: the
// one of Member's record that ended at Until (Unix ms).
type KnownPromise struct{ Member, Until int64 }

// HotKey is a key that an instance syncs because it is busy there: while it
// is hot, no instance admits it on a floor share.
type HotKey struct {
	Key   string
	Until int64 // hot until (Unix ms), unless announced again
	Room  int64 // what the announcing instance saw left in the window
	At    int64 // when it became hot (Unix ms); set by the store
}

// MemberRecord is one instance's record in the membership.
type MemberRecord struct {
	Member int64
	Joined int64 // when its life started (Unix ms)
	Until  int64 // live until (Unix ms): its last heartbeat's end, or when it left
	Seen   int64 // when it last learned the fleet (Unix ms)
	// Promise is the last floor promise of a member that is gone (nil for
	// a live one, or one that sent none).
	Promise []byte
	// PromiseKnown says Promise was not sent: it is the one the heartbeat
	// named in Known for this Member and Until.
	PromiseKnown bool
}

// Fleet is what a heartbeat learns.
type Fleet struct {
	// Founded is when the membership was created (Unix ms): the instances
	// that joined around it started together.
	Founded int64
	// Fresh is true when the membership was empty before this heartbeat (a
	// new fleet, or a store that restarted empty).
	Fresh bool
	// Members are the records of the live instances and of those that left
	// or died within the longest Keep, the caller's included.
	Members []MemberRecord
	// Hot are the keys hot now.
	Hot []HotKey
}

// SlotStore holds the fleet's slot counts, one entry per zone and key, and
// its membership.
type SlotStore interface {
	// Sync runs every step and fills replies (one per step). Steps are
	// independent: one that fails does not stop the others. It returns the
	// first step's error, if any. A store never re-sends a step by itself.
	Sync(ctx context.Context, steps []Step, replies []Reply) error
	// Heartbeat records hb in the fleet's membership (key) and hot keys
	// (hotKey), and returns the fleet as it stands.
	Heartbeat(ctx context.Context, key, hotKey string, hb Heartbeat) (Fleet, error)
}

// MemoryStore is the embedded SlotStore of a single instance (and, shared by
// several engines, a fleet in tests).
type MemoryStore struct {
	mu     sync.Mutex
	keys   map[string]*memoryKey
	fleets map[string]*memoryFleet      // membership key -> membership
	hot    map[string]map[string]HotKey // hot key set -> key -> mark
	now    func() time.Time
}

type memoryFleet struct {
	founded int64
	keep    int64 // ms
	members map[int64]MemberRecord
}

type memoryKey struct {
	slots   map[int64]int64
	demand  int64
	syncing map[int64]int64 // member -> registered until (Unix ms)
	expires time.Time
	// floorPushes are the floor pushes applied (see Step.FloorID).
	floorPushes map[string]bool
}

var _ SlotStore = (*MemoryStore)(nil)

// NewMemoryStore returns an empty in-process slot store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{keys: make(map[string]*memoryKey), fleets: make(map[string]*memoryFleet), hot: make(map[string]map[string]HotKey), now: time.Now}
}

// Heartbeat implements SlotStore.
func (m *MemoryStore) Heartbeat(_ context.Context, key, hotKey string, hb Heartbeat) (Fleet, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f := m.fleets[key]
	out := Fleet{Fresh: f == nil}
	if f == nil {
		f = &memoryFleet{founded: hb.Now, members: make(map[int64]MemberRecord)}
		m.fleets[key] = f
	}
	f.keep = max(f.keep, hb.Keep.Milliseconds())
	promise := bytes.Clone(hb.Promise)
	if promise == nil {
		promise = f.members[hb.Member].Promise
	}
	f.members[hb.Member] = MemberRecord{Member: hb.Member, Joined: hb.Joined, Until: hb.Now + hb.TTL.Milliseconds(), Seen: hb.Seen, Promise: promise}
	out.Founded = f.founded
	for id, r := range f.members {
		if r.Until+f.keep <= hb.Now {
			delete(f.members, id)
			continue
		}
		switch {
		case r.Until > hb.Now:
			r.Promise = nil // a live member's promise is no one else's business
		case slices.Contains(hb.Known, KnownPromise{id, r.Until}):
			r.Promise, r.PromiseKnown = nil, true
		}
		out.Members = append(out.Members, r)
	}
	hot := m.hot[hotKey]
	if hot == nil {
		hot = make(map[string]HotKey)
		m.hot[hotKey] = hot
	}
	for _, h := range hb.Hot {
		h.At = hb.Now
		if cur, ok := hot[h.Key]; ok && cur.Until > hb.Now {
			h.At = cur.At
		}
		hot[h.Key] = h
	}
	for k, h := range hot {
		if h.Until <= hb.Now {
			delete(hot, k)
			continue
		}
		out.Hot = append(out.Hot, h)
	}
	return out, nil
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
	if k == nil && !st.writes() {
		return Reply{}
	}
	if k == nil {
		k = &memoryKey{slots: make(map[int64]int64), syncing: make(map[int64]int64)}
		m.keys[st.Key] = k
	}
	for _, adds := range [][]SlotCount{st.Adds[:], {st.Moved}, k.floorOnce(st)} {
		for _, a := range adds {
			if a.Count != 0 && a.Slot >= st.Oldest {
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
	var used int64
	for s, c := range k.slots {
		if s < st.Oldest {
			delete(k.slots, s)
			continue
		}
		used += c
	}
	if r.Reserved = min(st.Reserve, st.Limit-used); r.Reserved > 0 {
		k.slots[st.Adds[0].Slot] += r.Reserved
	} else {
		r.Reserved = 0
	}
	for s, c := range k.slots {
		r.Slots = append(r.Slots, SlotCount{Slot: s, Count: c})
	}
	k.expires = now.Add(st.TTL)
	return r
}

// writes reports whether a step writes anything to a key that does not
// exist: a step that only reads creates none.
func (st *Step) writes() bool {
	writes := st.Demand > 0 || (st.Member != 0 && st.MemberTTL > 0) || st.Reserve > 0
	for _, a := range st.Adds {
		writes = writes || (a.Count > 0 && a.Slot >= st.Oldest)
	}
	for _, adds := range [][]SlotCount{{st.Moved}, st.Floor} {
		for _, a := range adds {
			writes = writes || (a.Count != 0 && a.Slot >= st.Oldest)
		}
	}
	return writes
}

// floorOnce is the step's floor push, unless the key took that push
// before (a push sent again after a lost reply).
func (k *memoryKey) floorOnce(st *Step) []SlotCount {
	if st.FloorID == "" {
		return st.Floor
	}
	if k.floorPushes == nil {
		k.floorPushes = make(map[string]bool)
	}
	if k.floorPushes[st.FloorID] {
		return nil
	}
	k.floorPushes[st.FloorID] = true
	return st.Floor
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
