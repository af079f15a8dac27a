package ratelimit

import (
	"sync"
	"sync/atomic"
)

// The arena stores a zone's entries and their slot rings in fixed chunks
// addressed by index, so a tracked key costs its entry, its ring and a map
// slot, with no per-key allocation or pointer for the collector to scan.
// MaxKeys is the largest max_keys a zone takes.
const MaxKeys = maxChunks * chunkSize

const (
	chunkBits = 10
	chunkSize = 1 << chunkBits
	maxChunks = 1 << 12 // 4M keys per zone
)

type chunk struct {
	entries [chunkSize]entry
	rings   []uint32 // chunkSize rings of ringLen counts
}

type arena struct {
	ringLen int
	chunks  [maxChunks]atomic.Pointer[chunk]

	mu    sync.Mutex // guards next and freed, taken only for a new key
	next  int32
	freed []int32
}

// at returns the entry and ring at index i. The caller holds the lock of the
// shard whose map holds i, which orders it after the alloc that made i.
func (a *arena) at(i int32) (*entry, []uint32) {
	c := a.chunks[i>>chunkBits].Load()
	off := int(i&(chunkSize-1)) * a.ringLen
	return &c.entries[i&(chunkSize-1)], c.rings[off : off+a.ringLen : off+a.ringLen]
}

func (a *arena) alloc() int32 {
	a.mu.Lock()
	defer a.mu.Unlock()
	if n := len(a.freed); n > 0 {
		i := a.freed[n-1]
		a.freed = a.freed[:n-1]
		return i
	}
	i := a.next
	if i>>chunkBits >= maxChunks {
		panic("ratelimit: more than 4M keys in one zone")
	}
	if i&(chunkSize-1) == 0 {
		a.chunks[i>>chunkBits].Store(&chunk{rings: make([]uint32, chunkSize*a.ringLen)})
	}
	a.next++
	return i
}

func (a *arena) free(i int32) {
	a.mu.Lock()
	a.freed = append(a.freed, i)
	a.mu.Unlock()
}
