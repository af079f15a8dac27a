package budget

import (
	"context"
	"time"
)

// memoryOwner is an owner of reservations: its last word and its open
// reservations' records.
type memoryOwner struct {
	word time.Time
	open map[string]struct{}
}

// owner returns the owner of the owners' set named, whose last word is now;
// callers hold m.mu.
func (m *MemoryStore) owner(owners, name string, now time.Time) *memoryOwner {
	set := m.owners[owners]
	if set == nil {
		set = make(map[string]*memoryOwner)
		m.owners[owners] = set
	}
	o := set[name]
	if o == nil {
		o = &memoryOwner{open: make(map[string]struct{})}
		set[name] = o
	}
	o.word = now
	return o
}

// Grant implements Store.
func (m *MemoryStore) Grant(_ context.Context, owners, owner string, grants []Grant) ([]bool, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.owner(owners, owner, now)
	gone := make([]bool, len(grants))
	for i, g := range grants {
		rec, ok := m.keys[g.Record]
		if !ok || !now.Before(rec.expires) || rec.value != recordReserved {
			gone[i] = true
			continue
		}
		if g.Seq > rec.grantSeq {
			rec.grantSeq, rec.returns = g.Seq, append([]int64(nil), g.Returns...)
			m.keys[g.Record] = rec
		}
	}
	return gone, nil
}

// Sweep implements Store.
func (m *MemoryStore) Sweep(_ context.Context, owners, except string, lapse time.Duration, n int) (int, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	settled := 0
	for name, o := range m.owners[owners] {
		if name == except || now.Sub(o.word) < lapse {
			continue
		}
		for record := range o.open {
			if settled >= n {
				return settled, nil
			}
			delete(o.open, record)
			if m.lapse(record, now) {
				settled++
			}
		}
		delete(m.owners[owners], name)
	}
	return settled, nil
}

// lapse settles a reserved record to what it holds less what its last
// grant returns, and leaves a tombstone; callers hold m.mu.
func (m *MemoryStore) lapse(record string, now time.Time) bool {
	rec, ok := m.keys[record]
	if !ok || !now.Before(rec.expires) || rec.value != recordReserved {
		return false
	}
	for i, c := range rec.counters {
		var back int64
		if i < len(rec.returns) {
			back = min(rec.returns[i], rec.held[i])
		}
		if back <= 0 {
			continue
		}
		if v, _ := m.get(c.Key, now); v-back > 0 {
			m.keys[c.Key] = memoryValue{value: v - back, expires: now.Add(c.TTL)}
		} else {
			delete(m.keys, c.Key)
		}
	}
	m.keys[record] = memoryValue{value: recordReleased, expires: now.Add(settledTTL)}
	return true
}
