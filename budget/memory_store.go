package budget

import (
	"context"
	"sync"
	"time"
)

// MemoryStore is the embedded Store of a single instance. One lock covers a
// whole reservation, which is what makes it all or nothing.
type MemoryStore struct {
	mu       sync.Mutex
	counters map[string]memoryValue
	records  map[string]memoryRecord
	now      func() time.Time
	lastGC   time.Time
}

type memoryValue struct {
	value   int64
	expires time.Time
}

// memoryRecord is a reservation's record: 'r' reserved, 'x' released before
// its reserve ran. A settle deletes the record it applies to.
type memoryRecord struct {
	state   byte
	expires time.Time
}

var _ Store = (*MemoryStore)(nil)

// NewMemoryStore returns an empty store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{
		counters: make(map[string]memoryValue),
		records:  make(map[string]memoryRecord),
		now:      time.Now,
	}
}

// get reads a live counter; callers hold m.mu.
func (m *MemoryStore) get(key string, now time.Time) int64 {
	if v, ok := m.counters[key]; ok && now.Before(v.expires) {
		return v.value
	}
	return 0
}

// Reserve implements Store.
func (m *MemoryStore) Reserve(_ context.Context, record string, recordTTL time.Duration, charges []Charge) (ReserveResult, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.collect(now)
	if rec, ok := m.records[record]; ok && now.Before(rec.expires) {
		return ReserveResult{Cancelled: true, Denied: -1}, nil
	}
	res := ReserveResult{Denied: -1, Used: make([]int64, len(charges))}
	for i, c := range charges {
		res.Used[i] = m.get(c.Key, now)
		if res.Denied < 0 && res.Used[i]+c.Amount > c.Limit {
			res.Denied = i
		}
	}
	if res.Denied >= 0 {
		return res, nil
	}
	for i, c := range charges {
		if c.Amount != 0 {
			res.Used[i] += c.Amount
			m.counters[c.Key] = memoryValue{value: res.Used[i], expires: now.Add(c.TTL)}
		}
	}
	m.records[record] = memoryRecord{state: 'r', expires: now.Add(recordTTL)}
	res.Admitted = true
	return res, nil
}

// Settle implements Store.
func (m *MemoryStore) Settle(_ context.Context, record string, ttl time.Duration, adjs []Adjustment) (bool, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	rec, ok := m.records[record]
	if !ok || !now.Before(rec.expires) {
		m.records[record] = memoryRecord{state: 'x', expires: now.Add(ttl)}
		return false, nil
	}
	if rec.state != 'r' {
		return false, nil
	}
	delete(m.records, record)
	for _, a := range adjs {
		if v := m.get(a.Key, now) + a.Delta; v > 0 {
			m.counters[a.Key] = memoryValue{value: v, expires: now.Add(a.TTL)}
		} else {
			delete(m.counters, a.Key)
		}
	}
	return true, nil
}

// Ping implements Store.
func (m *MemoryStore) Ping(context.Context) error { return nil }

// Get implements Store.
func (m *MemoryStore) Get(_ context.Context, keys []string) ([]int64, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]int64, len(keys))
	for i, k := range keys {
		out[i] = m.get(k, now)
	}
	return out, nil
}

// Reset implements Store.
func (m *MemoryStore) Reset(_ context.Context, keys []string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, k := range keys {
		delete(m.counters, k)
	}
	return nil
}

// collect drops expired counters and markers, at most once a second, so the
// maps stay bounded by what is live. Callers hold m.mu.
func (m *MemoryStore) collect(now time.Time) {
	if now.Sub(m.lastGC) < time.Second {
		return
	}
	m.lastGC = now
	for k, v := range m.counters {
		if !now.Before(v.expires) {
			delete(m.counters, k)
		}
	}
	for k, rec := range m.records {
		if !now.Before(rec.expires) {
			delete(m.records, k)
		}
	}
}
