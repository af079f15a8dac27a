package ratelimit

import "sync"

// offHeap is the memory a zone's arena holds outside the Go heap, taken a
// chunk at a time. The chunks hold no pointers, so the collector need not
// see them; on its heap they would also count toward its goal, which lets
// the heap grow to twice the live bytes before a collection: a tracked key
// would cost its bytes twice in the process's memory. The zone gives the
// memory back when it is collected (see newZone): every request and pass
// reaches the arena through the zone, so none can hold it then.
type offHeap struct {
	mu      sync.Mutex
	regions [][]byte
}

// alloc returns n zeroed bytes, aligned for any field.
func (o *offHeap) alloc(n int) []byte {
	b := mapMemory(n)
	o.mu.Lock()
	o.regions = append(o.regions, b)
	o.mu.Unlock()
	return b
}

// free gives back one region alloc returned.
func (o *offHeap) free(b []byte) {
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

// release gives every region back.
func (o *offHeap) release() {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, b := range o.regions {
		unmapMemory(b)
	}
	o.regions = nil
}

// size is the bytes taken (the kernel backs a page once it is touched).
func (o *offHeap) size() int64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	var n int64
	for _, b := range o.regions {
		n += int64(len(b))
	}
	return n
}
