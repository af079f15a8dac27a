package ratelimit

import (
	"strconv"
	"strings"
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
	storeID string // <prefix>:rl:{<name>:  — the key's hash and storeSuffix follow
	// storeSuffix is }:<slot length ms>x<slots>.
	storeSuffix string
	// promiseSeed spreads the zone's keys over a promise's cells.
	promiseSeed uint64

	maxKeys atomic.Int64
	keys    atomic.Int64 // tracked keys
	events  atomic.Int64 // the zone's limit, for the reconciler's floor shares
	fleet   fleetView
	shards  [shardCount]shard
	arena   arena
}

// fleetView is the fleet as this instance's last heartbeat saw it, for one
// zone's window (see Engine.see).
type fleetView struct {
	// claims counts the instances that hold or may come to hold a floor
	// share of the zone's keys: the live ones, and those that died or left
	// while their floor admits still count in the window. A floor share is
	// floorFraction × events / claims.
	claims atomic.Int64
	// others counts the live instances other than this one, and holders
	// those of them that hold a floor share or will by the next heartbeat;
	// probationFewest holds, for each of the others on probation, the
	// fewest probation claims of its term (see probationTerm; nil: none).
	others, holders atomic.Int64
	probationFewest atomic.Pointer[[]int64]
	// gone are the instances that left or died while their floor admits
	// may still be in the window (nil: none).
	gone atomic.Pointer[[]goneRecord]
	// othersSeen is the earliest of the other live instances' last
	// heartbeats (Unix ns; MaxInt64 when there are none): a key hot since
	// before it has been heard hot by every one of them.
	othersSeen atomic.Int64
	// eligible: this instance may admit on a floor share. A new instance
	// becomes eligible once the larger shares the others held before it
	// joined have left the window (see Engine.see); an instance stays
	// eligible for its life.
	eligible atomic.Bool
	// probation: this instance, not a founder of the fleet, is not eligible
	// yet and may admit on probation shares (see probationShare), cut by
	// probationClaims, the claims its term shows now (see probationTerm).
	probation       atomic.Bool
	probationClaims atomic.Int64
	// founding: this instance is one of the fleet's founders, not eligible
	// yet: it takes its floor share with the others, and the others count
	// it as a holder already, so it registers the busy keys it syncs.
	founding atomic.Bool
	// Until graceUntil (Unix ns), this instance's own share is cut as if
	// there were graceClaims claims: the larger share before a join, which
	// it may go on spending until the one who joined takes a share.
	graceClaims, graceUntil atomic.Int64
	// known counts the claims every instance has surely heard of: those of
	// instances that joined a heartbeat lifetime ago or more. No instance
	// holds a share larger than one cut by known.
	known atomic.Int64
}

// goneRecord is what the fleet knows of a gone instance's floor admits.
type goneRecord struct {
	// seen is its last heartbeat (Unix ns): one that heard a key was hot
	// had pushed what it admitted of it on its floor share.
	seen int64
	// flushed is when it left having pushed every floor admit it had made
	// (Unix ns; 0: it died, or its last push failed): a read after it
	// counts them.
	flushed int64
	// fewest, for one gone on probation, is the fewest probation claims of
	// its term: its share was never larger than one cut by that many (0:
	// it was not on probation).
	fewest int64
	// promise is its last floor promise (see promise.go).
	promise sentPromise
}

// widest is the claims the largest floor share any instance may hold is cut
// by: what it leaves aside for others' floor admits is cut by it.
func (v *fleetView) widest() int64 {
	c := v.claims.Load()
	if k := v.known.Load(); k > 0 {
		c = min(c, k)
	}
	return c
}

// claimsAt is the claims a floor share is cut by at now: during the grace
// after a join, the fewer claims before it.
func (v *fleetView) claimsAt(now int64) int64 {
	c := v.claims.Load()
	if now < v.graceUntil.Load() {
		c = min(c, v.graceClaims.Load())
	}
	return c
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
	// hot are the shard's keys some instance syncs because they are busy
	// there, as of the last heartbeat: none of them is admitted on a floor
	// share here. Nil while there are none.
	hot map[keyhash.Hash]hotMark
	// reservations are what this instance holds of the reserved admits of
	// the shard's keys admitted on reservations (see reserve.go). Nil while
	// there are none.
	reservations map[keyhash.Hash]reservation
	// floorPushes are the floor pushes of keys whose step failed, to be
	// sent again (see floorPush). Nil while there are none.
	floorPushes map[keyhash.Hash]floorPush
	// pushed are the keys whose floor push landed lately (see
	// promise_pushed.go). Nil while there are none.
	pushed map[keyhash.Hash]pushedMark
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

// hotMark is what the fleet said of a hot key.
type hotMark struct {
	at, until int64 // when it became hot, and hot until (Unix ns)
	room      int64 // what its announcer saw left in the window
}

// hotMark returns the mark of h if it is hot at now. The caller holds the
// shard's lock.
func (s *shard) hotAt(h keyhash.Hash, now int64) (hotMark, bool) {
	if len(s.hot) == 0 {
		return hotMark{}, false
	}
	m, ok := s.hot[h]
	return m, ok && m.until > now
}

func newZone(prefix, name string, id int, slots window.Slots) *Zone {
	z := &Zone{name: name, id: id, slots: slots, storeID: prefix + ":rl:{" + name + ":",
		storeSuffix: "}:" + strconv.FormatInt(slots.Len/1e6, 10) + "x" + strconv.FormatInt(slots.N, 10)}
	z.promiseSeed = promiseSeedOf(z.storeID, z.storeSuffix)
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
// now if the zone has room (on its floor share when onFloor and the key is
// not hot), or else its
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
		if _, hot := s.hotAt(h, now); onFloor && !hot && !s.offFloor(h, now) {
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
	z.eachShard(func(s *shard) {
		for h, idx := range s.entries {
			e, _ := z.arena.at(idx)
			if !e.pending() && now-e.lastSeen >= ttl && e.tat <= now {
				delete(s.entries, h)
				delete(s.active, h)
				delete(s.floorPushes, h)
				z.keys.Add(-1)
				z.arena.free(idx)
			}
		}
	})
}
