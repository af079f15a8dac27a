package ratelimit

import (
	"strconv"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// floorPush is what a key that starts syncing pushes of the admits this
// instance made of it on its floor share: its window, slot by slot, under an
// id the store applies once. A push whose reply is lost (a stall past the
// client's timeout) may have been applied or not; it is sent again as it
// was, under its id, so that those admits count once either way. The admits
// made since it was claimed go as pending admits, as any synced key's.
type floorPush struct {
	id    string
	slots []SlotCount
}

// floorPushOf is the push of a key on its floor share: the one kept from a
// step that failed (again), or a new one of its window. The caller holds s's
// lock.
func (e *Engine) floorPushOf(s *shard, h keyhash.Hash, en *entry, ring []uint32) (p floorPush, again bool) {
	if p, ok := s.floorPushes[h]; ok {
		return p, true
	}
	id := strconv.FormatInt(e.member, 36) + "." + strconv.FormatUint(e.floorPushes.Add(1), 36)
	return floorPush{id: id, slots: en.window(ring)}, false
}

// pushFailed notes a step of h that failed: its reads merge by maximum for a
// window (the store may lack what it pushed), and its floor push p, if any,
// is kept to be sent again.
func (z *Zone) pushFailed(h keyhash.Hash, p floorPush) {
	s := z.shardOf(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	if en, ring := z.lookup(s, h); en != nil {
		en.mergeMaxUntil = en.head + int64(len(ring))
	}
	if p.id == "" {
		return
	}
	if s.floorPushes == nil {
		s.floorPushes = make(map[keyhash.Hash]floorPush)
	}
	s.floorPushes[h] = p
}
