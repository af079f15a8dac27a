package ratelimit

import (
	"unsafe"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/offheap"
)

// keyIndex finds a shard's keys in the zone's arena, where each entry holds
// its key's hash (a map[keyhash.Hash]int32 cost about 40 B of heap a key,
// twice that in RSS). It is open addressing with linear probing over a power-of-two
// table of 4 B slots, at most three quarters full, outside the heap once it
// takes a page: 1 + the arena index in a slot's low indexBits (0: empty),
// and a tag of the hash above them, so that a probe reads an entry only when
// the tag matches. A removal shifts the keys after it back, so a table has
// no tombstones.
type keyIndex struct {
	slots []uint32
	keys  int
}

const (
	indexBits  = 23 // 1 + an arena index, up to MaxKeys
	indexMask  = 1<<indexBits - 1
	tagShift   = 64 - (32 - indexBits) // the hash's top bits make the tag
	minSlots   = 16
	pageBytes  = 4096
	slotsBytes = int(unsafe.Sizeof(uint32(0)))
)

// An arena index and 1 fit the slot's low bits.
const _ = uint(indexMask - (MaxKeys + 1))

func tagOf(h keyhash.Hash) uint32 { return uint32(h.Hi>>tagShift) << indexBits }

// find returns where h is in the table and its arena index, if the shard
// tracks it.
func (x *keyIndex) find(a *arena, h keyhash.Hash) (pos int, i int32, ok bool) {
	if len(x.slots) == 0 {
		return 0, 0, false
	}
	mask := uint64(len(x.slots) - 1)
	tag := tagOf(h)
	for p := h.Hi & mask; ; p = (p + 1) & mask {
		v := x.slots[p]
		if v == 0 {
			return 0, 0, false
		}
		if v&^indexMask == tag {
			if i := int32(v&indexMask) - 1; a.entry(i).hash == h {
				return int(p), i, true
			}
		}
	}
}

// insert adds h, which the table does not hold, at arena index i.
func (x *keyIndex) insert(a *arena, h keyhash.Hash, i int32) {
	if (x.keys+1)*4 > len(x.slots)*3 {
		x.grow(a)
	}
	x.place(h, uint32(i+1)|tagOf(h))
	x.keys++
}

// place puts slot value v of h at the first free slot from h's home.
func (x *keyIndex) place(h keyhash.Hash, v uint32) {
	mask := uint64(len(x.slots) - 1)
	p := h.Hi & mask
	for x.slots[p] != 0 {
		p = (p + 1) & mask
	}
	x.slots[p] = v
}

// grow doubles the table, moving every key to its place in the new one.
func (x *keyIndex) grow(a *arena) {
	old := x.slots
	x.slots = newSlots(a.mem, max(2*len(old), minSlots))
	for _, v := range old {
		if v != 0 {
			x.place(a.entry(int32(v&indexMask)-1).hash, v)
		}
	}
	freeSlots(a.mem, old)
}

// removeAt empties slot pos and shifts back the keys after it that may
// take its place: those whose home is not between it and where they are.
func (x *keyIndex) removeAt(a *arena, pos int) {
	mask := uint64(len(x.slots) - 1)
	hole := uint64(pos)
	for p := (hole + 1) & mask; x.slots[p] != 0; p = (p + 1) & mask {
		home := a.entry(int32(x.slots[p]&indexMask)-1).hash.Hi & mask
		if (p-home)&mask >= (p-hole)&mask {
			x.slots[hole] = x.slots[p]
			hole = p
		}
	}
	x.slots[hole] = 0
	x.keys--
}

// each calls fn with every key's arena index.
func (x *keyIndex) each(fn func(i int32)) {
	for _, v := range x.slots {
		if v != 0 {
			fn(int32(v&indexMask) - 1)
		}
	}
}

// sweep removes the keys drop returns true for. A key the shift moves from
// the table's start to its end is offered twice, so drop must answer the
// same again; none is skipped.
func (x *keyIndex) sweep(a *arena, drop func(i int32) bool) {
	for pos := 0; pos < len(x.slots); {
		if v := x.slots[pos]; v != 0 && drop(int32(v&indexMask)-1) {
			x.removeAt(a, pos) // a key after it may move into pos
			continue
		}
		pos++
	}
}

// newSlots returns an empty table of n slots: on the heap while it is
// smaller than a page, else outside it.
func newSlots(mem *offheap.Memory, n int) []uint32 {
	if n*slotsBytes < pageBytes {
		return make([]uint32, n)
	}
	b := mem.Alloc(n * slotsBytes)
	return unsafe.Slice((*uint32)(unsafe.Pointer(&b[0])), n)
}

func freeSlots(mem *offheap.Memory, s []uint32) {
	if len(s)*slotsBytes >= pageBytes {
		mem.Free(unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*slotsBytes))
	}
}
