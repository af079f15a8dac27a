// Package offheap hands out memory outside the Go heap, for data that
// holds no pointers (the rate limiter's per-key arena and index).
package offheap

import "sync"

// Memory is what one owner holds outside the Go heap, taken a region at a
// time. The chunks hold no pointers, so the collector need not
// see them; on its heap they would also count toward its goal, which lets
// the heap grow to twice the live bytes before a collection: a tracked key
// would cost its bytes twice in the process's memory. The owner gives it
// back (Release) when nothing can reach it any more.
type Memory struct {
	mu      sync.Mutex
	regions [][]byte
}

// Alloc returns n zeroed bytes, aligned for any field.
func (o *Memory) Alloc(n int) []byte {
	b := mapMemory(n)
	o.mu.Lock()
	o.regions = append(o.regions, b)
	o.mu.Unlock()
	return b
}

// Free gives back one region alloc returned.
func (o *Memory) Free(b []byte) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for i, r := range o.regions {
		if &r[0] == &b[0] {
			o.regions[i] = o.regions[len(o.regions)-1]
			o.regions = o.regions[:len(o.regions)-1]
			unmapMemory(r)
			return
		}
	}
}

// Release gives every region back.
func (o *Memory) Release() {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, b := range o.regions {
		unmapMemory(b)
	}
	o.regions = nil
}

// Size is the bytes taken (the kernel backs a page once it is touched).
func (o *Memory) Size() int64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	var n int64
	for _, b := range o.regions {
		n += int64(len(b))
	}
	return n
}
