package ratelimit

import (
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/window"
)

const shardCount = 64 // a power of two; keys spread by the low bits of their hash

// DefaultMaxKeys is the number of keys a zone tracks when the config does not
// say.
const DefaultMaxKeys = 100_000

// Zone is the key space of one named limit with one window and precision.
// Zones live in the Engine, not in a config, so their counters survive a
// config reload. Two handlers naming the same zone with the same window share
// its counters.
type Zone struct {
	name    string
	id      int // creation order; requests lock zones in this order
	slots   window.Slots
	storeID string // <prefix>:rl:{<name>:  — the key's hash and the window follow

	maxKeys atomic.Int64
	keys    atomic.Int64 // tracked keys
	events  atomic.Int64 // the zone's limit, for the reconciler's floor shares
	shards  [shardCount]shard
	arena   arena
}

type shard struct {
	mu      sync.Mutex
	entries map[keyhash.Hash]int32 // index into the zone's arena
	// active are the entries a full reconcile pass visits: all but those on
	// their floor share, which need no store (a pass costs nothing per key
	// on its floor share).
	active map[keyhash.Hash]int32
	// untracked holds the local caps of the shard's keys that arrived while
	// the zone was full; nil until the first such key.
	untracked *untrackedTable
}

func newZone(prefix, name string, id int, slots window.Slots) *Zone {
	z := &Zone{name: name, id: id, slots: slots, storeID: prefix + ":rl:{" + name + ":"}
	z.maxKeys.Store(DefaultMaxKeys)
	z.arena.ringLen = int(slots.N) + 1
	for i := range z.shards {
		z.shards[i].entries = make(map[keyhash.Hash]int32)
		z.shards[i].active = make(map[keyhash.Hash]int32)
	}
	return z
}

// Name is the zone's name as configured.
func (z *Zone) Name() string { return z.name }

// ID orders zones: a request that checks several zones must list them by
// ascending ID so that concurrent requests lock shards in one order.
func (z *Zone) ID() int { return z.id }

// SetMaxKeys caps how many keys the zone tracks; a new key past the cap is
// limited by the local cap alone (see UntrackedKeys) until tracked keys are
// evicted. 0 means DefaultMaxKeys.
func (z *Zone) SetMaxKeys(n int64) {
	if n <= 0 {
		n = DefaultMaxKeys
	}
	z.maxKeys.Store(n)
}

// MaxKeys is the zone's cap on tracked keys.
func (z *Zone) MaxKeys() int64 { return z.maxKeys.Load() }

// Keys is the number of tracked keys.
func (z *Zone) Keys() int64 { return z.keys.Load() }

// storeKey names a key's hash of slot counts: <prefix>:rl:{<zone>:<hash>}:<slot
// length ms>x<slots>. The braces are a Redis Cluster hash tag, so every
// command of a key touches one slot; the suffix keeps counts of another
// window length apart.
func (z *Zone) storeKey(h keyhash.Hash) string {
	b := make([]byte, 0, len(z.storeID)+64)
	b = append(b, z.storeID...)
	b = append(b, h.String()...)
	b = append(b, "}:"...)
	b = strconv.AppendInt(b, z.slots.Len/1e6, 10)
	b = append(b, 'x')
	b = strconv.AppendInt(b, z.slots.N, 10)
	return string(b)
}

func (z *Zone) shardOf(h keyhash.Hash) *shard { return &z.shards[h.Lo&(shardCount-1)] }

// lock locks the shard of h and returns it with h's state: its entry, made
// now if the zone has room (on its floor share when onFloor), or else its
// untracked local cap. The caller unlocks the shard.
func (z *Zone) lock(h keyhash.Hash, now int64, onFloor bool) (*shard, *entry, []uint32, *untrackedState) {
	s := z.shardOf(h)
	s.mu.Lock()
	if i, ok := s.entries[h]; ok {
		e, ring := z.arena.at(i)
		return s, e, ring, nil
	}
	if z.reserveKey() {
		var flags uint8
		if onFloor {
			flags = flagFloor
		}
		e, ring := z.insert(s, h, now, flags)
		if s.untracked != nil {
			// A key tracked from now on keeps what it spent of its burst.
			e.tat = s.untracked.take(h)
		}
		return s, e, ring, nil
	}
	if s.untracked == nil {
		s.untracked = new(untrackedTable)
	}
	return s, nil, nil, s.untracked.find(h)
}

// reserveKey counts one more tracked key if the zone has room for it. Shards
// insert concurrently, so the check and the count are one step: max_keys is
// exact, and the arena never holds more than MaxKeys entries.
func (z *Zone) reserveKey() bool {
	for {
		n := z.keys.Load()
		if n >= z.maxKeys.Load() {
			return false
		}
		if z.keys.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

func (z *Zone) insert(s *shard, h keyhash.Hash, now int64, flags uint8) (*entry, []uint32) {
	i := z.arena.alloc()
	s.entries[h] = i
	e, ring := z.arena.at(i)
	e.init(now, z.slots)
	e.flags = flags
	clear(ring)
	if flags&flagFloor == 0 {
		s.active[h] = i
	}
	return e, ring
}

// toFloor puts the key h of the locked shard s back on its floor share.
func (z *Zone) toFloor(s *shard, h keyhash.Hash, e *entry, ring []uint32) {
	e.toFloor(ring)
	delete(s.active, h)
}

// toSynced marks the key h of the locked shard s as synced by this instance.
func (z *Zone) toSynced(s *shard, h keyhash.Hash, e *entry) {
	e.flags = e.flags&^(flagFloor|flagLeaving) | flagSynced
	s.active[h] = s.entries[h]
}

// lookup returns the state of h in a locked shard s, or nil.
func (z *Zone) lookup(s *shard, h keyhash.Hash) (*entry, []uint32) {
	i, ok := s.entries[h]
	if !ok {
		return nil, nil
	}
	return z.arena.at(i)
}

// evict drops entries that hold nothing the store has not seen and have been
// idle for max(idleTTL, 2 windows).
func (z *Zone) evict(now, idleTTL int64) {
	ttl := max(idleTTL, 2*z.slots.N*z.slots.Len)
	for i := range z.shards {
		s := &z.shards[i]
		s.mu.Lock()
		for h, idx := range s.entries {
			e, _ := z.arena.at(idx)
			if !e.pending() && now-e.lastSeen >= ttl && e.tat <= now {
				delete(s.entries, h)
				delete(s.active, h)
				z.keys.Add(-1)
				z.arena.free(idx)
			}
		}
		s.mu.Unlock()
	}
}
