package ratelimit

// leaseState is what a key keeps of its leases: only a key that went to
// leases has one, in its shard, so the many keys that never leave their
// floor do not carry it. It is kept while the key is back on its floor (its
// rate, room and holders size its next grant, as they did when they were
// the entry's) and freed when the key is evicted.
//
// On leases, block admits are left of the grant, usable until blockUntil
// (Unix ns), which held ahead admits past the requests waiting for it; at
// the last call, room is what the fleet could admit past every grant, pushed
// the window's pushed admits, and holders how many instances held a grant.
// With no room, the next call waits until askAt (Unix ns), when the room may
// have grown.
type leaseState struct {
	blockUntil, askAt, block, room int64
	pushed, ahead                  uint32
	rate                           float32 // requests per sync interval, averaged over calls
	holders                        uint16
}

// lease returns the lease state of en, which has one (a key on leases
// does). The caller holds s's lock; the pointer holds until the shard makes
// another state (leaseOf).
func (s *shard) lease(en *entry) *leaseState { return &s.leases[en.lease-1] }

// leaseOf returns the lease state of en, made now if it has none. The
// caller holds s's lock.
func (s *shard) leaseOf(en *entry) *leaseState {
	if en.lease == 0 {
		if n := len(s.freeLeases); n > 0 {
			en.lease = s.freeLeases[n-1] + 1
			s.freeLeases = s.freeLeases[:n-1]
			s.leases[en.lease-1] = leaseState{}
		} else {
			s.leases = append(s.leases, leaseState{})
			en.lease = int32(len(s.leases))
		}
	}
	return s.lease(en)
}

// dropLease frees en's lease state, if it has one, as the key is evicted.
// The caller holds s's lock.
func (s *shard) dropLease(en *entry) {
	if en.lease != 0 {
		s.freeLeases = append(s.freeLeases, en.lease-1)
		en.lease = 0
	}
}
