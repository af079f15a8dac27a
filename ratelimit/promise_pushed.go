package ratelimit

import (
	"encoding/binary"
	"math/bits"
	"slices"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// Pushed keys. A key that starts syncing pushes what this instance admitted
// of it on its floor share (see floorPush), but the promise's sketch goes on
// bounding it: its cells keep their largest for a window, and other keys
// share them. So a promise also names the keys that pushed theirs lately;
// for a named key the others leave aside only the headroom, not its bound
// on top of what the store counts (bench/churn, kill: both killed founders
// had pushed the key at 90% of its limit, and the others left their bounds
// of it, 4 and 5, aside as well, and denied it).
//
// A key is named for pushedFor after its push, longer than the sketch keeps
// a raise. A named key must admit nothing unseen: it does not go back on its
// floor share (see mayGoOnFloor, and Zone.lock for a key tracked again)
// until a heartbeat lifetime after it is last named, as its instance may be
// dead by then while its last promise still names it.

// promisePushedMost is the most keys a promise names, eight bytes each; the
// others stay bounded by the sketch, which only leaves more aside.
const promisePushedMost = 1024

// pushedFor is how long a key of z is named after its floor push, in ns:
// two windows, past the promise generations' window and one of them.
func pushedFor(z *Zone) int64 { return 2 * z.slots.N * z.slots.Len }

// pushedMark is when a key's floor push landed, and until when it stays off
// its floor share (Unix ns).
type pushedMark struct {
	at, offFloorUntil int64
}

// pushedID names h of z in a promise.
func (z *Zone) pushedID(h keyhash.Hash) uint64 {
	return h.Lo ^ bits.RotateLeft64(h.Hi, 29) ^ z.promiseSeed
}

// notePushed records that h's floor push landed at now, with a heartbeat
// lifetime of ttl. The caller holds s's lock.
func (s *shard) notePushed(z *Zone, h keyhash.Hash, now, ttl int64) {
	if s.pushed == nil {
		s.pushed = make(map[keyhash.Hash]pushedMark)
	}
	s.pushed[h] = pushedMark{at: now, offFloorUntil: now + pushedFor(z) + ttl}
}

// offFloor reports whether h must stay off its floor share at now: a
// promise may still name it. The caller holds s's lock.
func (s *shard) offFloor(h keyhash.Hash, now int64) bool {
	if len(s.pushed) == 0 {
		return false
	}
	m, ok := s.pushed[h]
	return ok && now < m.offFloorUntil
}

// pushedKeys are the ids of the keys a promise at now names, sorted: those
// whose floor push landed within pushedFor and that are not on a floor
// share. Marks past their hold are dropped.
func (e *Engine) pushedKeys(now int64) []uint64 {
	var ids []uint64
	for _, z := range *e.zones.Load() {
		z.eachShard(func(s *shard) {
			for h, m := range s.pushed {
				switch en, _ := z.lookup(s, h); {
				case now >= m.offFloorUntil:
					delete(s.pushed, h)
				case now < m.at+pushedFor(z) && en != nil && en.flags&flagFloor == 0 && len(ids) < promisePushedMost:
					ids = append(ids, z.pushedID(h))
				}
			}
		})
	}
	slices.Sort(ids)
	return ids
}

// appendPushed is b with ids after it, eight bytes each, little endian.
func appendPushed(b []byte, ids []uint64) []byte {
	for _, id := range ids {
		b = binary.LittleEndian.AppendUint64(b, id)
	}
	return b
}

// names reports whether s names h of z as pushed.
func (s sentPromise) names(z *Zone, h keyhash.Hash) bool {
	ids := s[promiseSketchBytes:]
	id := z.pushedID(h)
	lo, hi := 0, len(ids)/8
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		switch v := binary.LittleEndian.Uint64(ids[8*mid:]); {
		case v == id:
			return true
		case v < id:
			lo = mid + 1
		default:
			hi = mid
		}
	}
	return false
}
