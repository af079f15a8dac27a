package ringbuf

import (
	"errors"
	"fmt"
	"sync"
	"time"
)

// ErrClosed is returned by Push and Pop after Close has been called.
var ErrClosed = errors.New("ringbuf: closed")

// Ring is a fixed-size, thread-safe ring buffer of timestamped samples.
type Ring struct {
	mu     sync.Mutex
	cond   *sync.Cond
	buf    []Sample
	head   int
	size   int
	closed bool
}

// Sample is one measurement with the time it was taken.
type Sample struct {
	At    time.Time
	Value float64
	Tags  map[string]string
}

// New returns a ring that holds at most capacity samples.
func New(capacity int) (*Ring, error) {
	if capacity <= 0 {
		return nil, fmt.Errorf("ringbuf: capacity must be positive, got %d", capacity)
	}
	r := &Ring{buf: make([]Sample, capacity)}
	r.cond = sync.NewCond(&r.mu)
	return r, nil
}

// Push appends s, overwriting the oldest sample when the ring is full.
// It reports whether a sample was dropped.
func (r *Ring) Push(s Sample) (dropped bool, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false, ErrClosed
	}
	idx := (r.head + r.size) % len(r.buf)
	r.buf[idx] = s
	if r.size == len(r.buf) {
		r.head = (r.head + 1) % len(r.buf)
		dropped = true
	} else {
		r.size++
	}
	r.cond.Signal()
	return dropped, nil
}

// Pop removes and returns the oldest sample, blocking until one is
// available or the ring is closed.
func (r *Ring) Pop() (Sample, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for r.size == 0 && !r.closed {
		r.cond.Wait()
	}
	if r.size == 0 {
		return Sample{}, ErrClosed
	}
	s := r.buf[r.head]
	r.buf[r.head] = Sample{}
	r.head = (r.head + 1) % len(r.buf)
	r.size--
	return s, nil
}

// Snapshot copies the current contents, oldest first.
func (r *Ring) Snapshot() []Sample {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Sample, 0, r.size)
	for i := 0; i < r.size; i++ {
		out = append(out, r.buf[(r.head+i)%len(r.buf)])
	}
	return out
}

// Mean returns the average value of the samples newer than since.
func (r *Ring) Mean(since time.Time) (float64, int) {
	var sum float64
	n := 0
	for _, s := range r.Snapshot() {
		if s.At.Before(since) {
			continue
		}
		sum += s.Value
		n++
	}
	if n == 0 {
		return 0, 0
	}
	return sum / float64(n), n
}

// Close wakes every waiter; later calls to Push and Pop fail.
func (r *Ring) Close() {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	r.cond.Broadcast()
}

func ExampleRing() {
	r, _ := New(3)
	now := time.Unix(1700000000, 0)
	for i := 0; i < 5; i++ {
		r.Push(Sample{At: now.Add(time.Duration(i) * time.Second), Value: float64(i * i)})
	}
	m, n := r.Mean(now)
	fmt.Printf("mean=%.2f over %d samples\n", m, n)
	// Output: mean=9.67 over 3 samples
}
