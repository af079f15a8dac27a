package ratelimit

import (
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/offheap"
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
	storeID string // <prefix>:rl3:{<name>:  — the key's hash and storeSuffix follow
	// storeSuffix is }:<slot length ms>x<slots>.
	storeSuffix string
	maxKeys     atomic.Int64
	keys        atomic.Int64 // tracked keys
	events      atomic.Int64 // the zone's limit, for the reconciler
	heard       atomic.Bool  // a heartbeat told it the fleet's hot keys: its floors may be used
	shards      [shardCount]shard
	arena       arena
}

type shard struct {
	mu    sync.Mutex
	index keyIndex // the keys' entries in the zone's arena
	// active are the entries on leases, which a full pass visits (keys on
	// their floor need no store).
	active map[keyhash.Hash]int32
	// untracked holds the local caps of the shard's keys that arrived while
	// the zone was full; nil until the first such key.
	untracked *untrackedTable
	// hot are the shard's keys some instance called hot (until when, Unix
	// ns), kept while they stay off the floor; nil while there are none.
	hot map[keyhash.Hash]int64
	// leases are the lease states of the shard's keys that went to leases
	// (see leaseState); freeLeases the indexes of those freed.
	leases     []leaseState
	freeLeases []int32
}

// eachShard calls fn with each shard of z locked. The unlock is deferred, so
// that a panic fn recovers from (see safely) never leaves a shard locked for
// the request path.
func (z *Zone) eachShard(fn func(s *shard)) {
	for i := range z.shards {
		z.shards[i].locked(fn)
	}
}

func (s *shard) locked(fn func(s *shard)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fn(s)
}

func newZone(prefix, name string, id int, slots window.Slots) *Zone {
	z := &Zone{name: name, id: id, slots: slots, storeID: prefix + ":rl3:{" + name + ":",
		storeSuffix: "}:" + strconv.FormatInt(slots.Len/1e6, 10) + "x" + strconv.FormatInt(slots.N, 10)}
	z.maxKeys.Store(DefaultMaxKeys)
	z.arena.ringLen = int(slots.N) + 1
	z.arena.mem = new(offheap.Memory)
	// The arena's memory goes back once nothing reaches the zone.
	runtime.AddCleanup(z, (*offheap.Memory).Release, z.arena.mem)
	for i := range z.shards {
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

// storeKey names a key's hash of slot counts: <prefix>:rl3:{<zone>:<hash>}:<slot
// length ms>x<slots>. The braces are a Redis Cluster hash tag, so every
// command of a key touches one slot; the suffix keeps counts of another
// window length apart.
func (z *Zone) storeKey(h keyhash.Hash) string {
	return z.storeID + h.String() + z.storeSuffix
}

// keyOf is the key hash in a store key of the zone's (see storeKey), if it is
// one.
func (z *Zone) keyOf(storeKey string) (keyhash.Hash, bool) {
	rest, ok := strings.CutPrefix(storeKey, z.storeID)
	if !ok {
		return keyhash.Hash{}, false
	}
	hex, ok := strings.CutSuffix(rest, z.storeSuffix)
	if !ok {
		return keyhash.Hash{}, false
	}
	return keyhash.Parse(hex)
}

func (z *Zone) shardOf(h keyhash.Hash) *shard { return &z.shards[h.Lo&(shardCount-1)] }

// lock locks the shard of h and returns it with h's state: its entry, made
// now if the zone has room, or else its untracked local cap. The caller
// unlocks the shard.
func (z *Zone) lock(h keyhash.Hash, now int64) (*shard, *entry, []uint32, *untrackedState) {
	s := z.shardOf(h)
	s.mu.Lock()
	if _, i, ok := s.index.find(&z.arena, h); ok {
		e, ring := z.arena.at(i)
		return s, e, ring, nil
	}
	if e, ring := z.track(s, h, now); e != nil {
		return s, e, ring, nil
	}
	if s.untracked == nil {
		s.untracked = new(untrackedTable)
	}
	return s, nil, nil, s.untracked.find(h)
}

// track returns the state of h in a locked shard s, made now if the zone
// has room for it (nil if not).
func (z *Zone) track(s *shard, h keyhash.Hash, now int64) (*entry, []uint32) {
	if _, i, ok := s.index.find(&z.arena, h); ok {
		return z.arena.at(i)
	}
	if !z.reserveKey() {
		return nil, nil
	}
	e, ring := z.insert(s, h, now)
	if s.untracked != nil {
		// A key tracked from now on keeps what it spent of its burst.
		e.tat = s.untracked.take(h)
	}
	return e, ring
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

func (z *Zone) insert(s *shard, h keyhash.Hash, now int64) (*entry, []uint32) {
	i := z.arena.alloc()
	e, ring := z.arena.at(i)
	e.init(h, now, z.slots)
	s.index.insert(&z.arena, h, i)
	clear(ring)
	return e, ring
}

// toLease puts the key h of the locked shard s on leases: its floor
// admits are being pushed.
func (z *Zone) toLease(s *shard, h keyhash.Hash, e *entry) {
	e.flags |= flagLease
	_, s.active[h], _ = s.index.find(&z.arena, h)
	s.leaseOf(e)
}

// toFloor puts the key h of the locked shard s back on its floor.
func (z *Zone) toFloor(s *shard, h keyhash.Hash, e *entry) {
	e.flags &^= flagLease
	ls := s.lease(e)
	ls.block, ls.blockUntil = 0, 0
	delete(s.active, h)
}

// lookup returns the state of h in a locked shard s, or nil.
func (z *Zone) lookup(s *shard, h keyhash.Hash) (*entry, []uint32) {
	_, i, ok := s.index.find(&z.arena, h)
	if !ok {
		return nil, nil
	}
	return z.arena.at(i)
}

// evict drops entries that hold nothing the store has not seen and have been
// idle for max(idleTTL, 2 windows).
func (z *Zone) evict(now, idleTTL int64) {
	ttl := max(idleTTL, 2*z.slots.N*z.slots.Len)
	z.eachShard(func(s *shard) {
		s.index.sweep(&z.arena, func(idx int32) bool {
			e := z.arena.entry(idx)
			if e.flags&flagQueued != 0 || now-e.lastSeen() < ttl || e.tat > now {
				return false
			}
			delete(s.active, e.hash)
			s.dropLease(e)
			z.keys.Add(-1)
			z.arena.free(idx)
			return true
		})
	})
}
