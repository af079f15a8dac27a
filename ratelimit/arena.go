package ratelimit

import (
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/fleetguard/fleetguard/internal/offheap"
)

// The arena stores a zone's entries and their slot rings in fixed chunks
// addressed by index, outside the Go heap (see internal/offheap), so a tracked key
// costs its entry, its ring and a map slot, with no per-key allocation or
// pointer for the collector to scan.
// MaxKeys is the largest max_keys a zone takes.
const MaxKeys = maxChunks * chunkSize

const (
	chunkBits = 10
	chunkSize = 1 << chunkBits
	maxChunks = 1 << 12 // 4M keys per zone
)

// chunk points into one region of off-heap memory: its entries, then its
// rings.
type chunk struct {
	entries *[chunkSize]entry
	rings   []uint32 // chunkSize rings of ringLen counts
}

type arena struct {
	ringLen int
	chunks  [maxChunks]atomic.Pointer[chunk]
	mem     *offheap.Memory

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

// entry returns the entry at index i, as at does.
func (a *arena) entry(i int32) *entry {
	return &a.chunks[i>>chunkBits].Load().entries[i&(chunkSize-1)]
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
		a.chunks[i>>chunkBits].Store(a.newChunk())
	}
	a.next++
	return i
}

const entryBytes = int(unsafe.Sizeof(entry{}))

func (a *arena) newChunk() *chunk {
	b := a.mem.Alloc(chunkSize * (entryBytes + 4*a.ringLen))
	return &chunk{
		entries: (*[chunkSize]entry)(unsafe.Pointer(&b[0])),
		rings:   unsafe.Slice((*uint32)(unsafe.Pointer(&b[chunkSize*entryBytes])), chunkSize*a.ringLen),
	}
}

func (a *arena) free(i int32) {
	a.mu.Lock()
	a.freed = append(a.freed, i)
	a.mu.Unlock()
}
