package ratelimit

import (
	"context"
	"sync"
	"time"
)

// Increment adds By to the counter Key and (re)arms its expiry to TTL.
type Increment struct {
	Key string
	By  int64
	TTL time.Duration
}

// CounterStore holds the fleet's shared epoch counters.
type CounterStore interface {
	// Add applies every increment, all or none.
	Add(ctx context.Context, incs []Increment) error
	// Get returns the value of each key in order; a missing key reads 0.
	Get(ctx context.Context, keys []string) ([]int64, error)
}

// MemoryStore is the embedded CounterStore of a single instance.
type MemoryStore struct {
	mu       sync.Mutex
	counters map[string]memoryCounter
	now      func() time.Time
}

type memoryCounter struct {
	value   int64
	expires time.Time
}

var _ CounterStore = (*MemoryStore)(nil)

// NewMemoryStore returns an empty in-process counter store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{counters: make(map[string]memoryCounter), now: time.Now}
}

// Add implements CounterStore.
func (m *MemoryStore) Add(_ context.Context, incs []Increment) error {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, inc := range incs {
		c := m.counters[inc.Key]
		if !c.expires.IsZero() && !now.Before(c.expires) {
			c = memoryCounter{}
		}
		c.value += inc.By
		c.expires = now.Add(inc.TTL)
		m.counters[inc.Key] = c
	}
	return nil
}

// Get implements CounterStore.
func (m *MemoryStore) Get(_ context.Context, keys []string) ([]int64, error) {
	now := m.now()
	out := make([]int64, len(keys))
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, k := range keys {
		if c, ok := m.counters[k]; ok && now.Before(c.expires) {
			out[i] = c.value
		}
	}
	return out, nil
}

// Sweep drops expired counters; the reconciler calls it once per pass.
func (m *MemoryStore) Sweep() {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	for k, c := range m.counters {
		if !now.Before(c.expires) {
			delete(m.counters, k)
		}
	}
}
