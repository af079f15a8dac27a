package ratelimit

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

const shardCount = 64 // a power of two; keys spread by the low bits of their hash

// DefaultMaxKeys is the number of keys a zone tracks fleet-wide when the
// config does not say.
const DefaultMaxKeys = 100_000

// Zone is the key space of one named limit. Zones live in the Engine, not in a
// config, so their counters survive a config reload. Two handlers naming the
// same zone share its counters.
type Zone struct {
	name string
	id   int // creation order; requests lock zones in this order

	maxKeys atomic.Int64
	keys    atomic.Int64 // fleet-tracked entries
	shards  [shardCount]shard
}

type shard struct {
	mu      sync.RWMutex
	entries map[keyhash.Hash]*entry
}

func newZone(name string, id int) *Zone {
	z := &Zone{name: name, id: id}
	z.maxKeys.Store(DefaultMaxKeys)
	for i := range z.shards {
		z.shards[i].entries = make(map[keyhash.Hash]*entry)
	}
	return z
}

// Name is the zone's name as configured.
func (z *Zone) Name() string { return z.name }

// ID orders zones: a request that checks several zones must list them by
// ascending ID so that concurrent requests lock entries in one order.
func (z *Zone) ID() int { return z.id }

// SetMaxKeys caps how many keys the zone tracks fleet-wide. A new key past the
// cap gets the local cap only until old keys are evicted.
func (z *Zone) SetMaxKeys(n int64) {
	if n <= 0 {
		n = DefaultMaxKeys
	}
	z.maxKeys.Store(n)
}

// Keys is the number of fleet-tracked keys.
func (z *Zone) Keys() int64 { return z.keys.Load() }

// lookup returns the entry of h, creating it at now for window w if needed.
func (z *Zone) lookup(h keyhash.Hash, now int64, w time.Duration) *entry {
	s := &z.shards[h.Lo&(shardCount-1)]
	s.mu.RLock()
	e := s.entries[h]
	s.mu.RUnlock()
	if e != nil {
		return e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if e = s.entries[h]; e != nil {
		return e
	}
	fleet := z.keys.Load() < z.maxKeys.Load()
	if fleet {
		z.keys.Add(1)
	}
	e = newEntry(h, fleet, now, w)
	s.entries[h] = e
	return e
}

// snapshot appends every entry of the zone to dst.
func (z *Zone) snapshot(dst []*entry) []*entry {
	for i := range z.shards {
		s := &z.shards[i]
		s.mu.RLock()
		for _, e := range s.entries {
			dst = append(dst, e)
		}
		s.mu.RUnlock()
	}
	return dst
}

// evict drops entries that hold nothing the fleet has not seen and have been
// idle long enough: fleet keys after max(idleTTL, 2 windows), local-only keys as
// soon as their GCRA state has fully recovered.
func (z *Zone) evict(now int64, idleTTL time.Duration) {
	for i := range z.shards {
		s := &z.shards[i]
		s.mu.Lock()
		for h, e := range s.entries {
			e.mu.Lock()
			if !e.pending() && e.idle(now, idleTTL) {
				e.dead = true
				delete(s.entries, h)
				if e.fleet {
					z.keys.Add(-1)
				}
			}
			e.mu.Unlock()
		}
		s.mu.Unlock()
	}
}

func (e *entry) idle(now int64, idleTTL time.Duration) bool {
	if !e.fleet {
		return e.tat <= now
	}
	ttl := max(idleTTL, 2*e.window)
	return now-e.lastSeen >= int64(ttl) && e.tat <= now
}
