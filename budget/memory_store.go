package budget

import (
	"cmp"
	"context"
	"maps"
	"slices"
	"sync"
	"time"
)

// MemoryStore is the embedded Store of a single instance. One lock covers a
// whole reservation, which is what makes it all or nothing. Like Redis, it
// keeps counters and reservation records in one keyspace of expiring values.
type MemoryStore struct {
	mu     sync.Mutex
	keys   map[string]memoryValue
	now    func() time.Time
	lastGC time.Time
	// overrides are the override tables: table -> field -> limit.
	overrides map[string]map[string]int64
	// tops are the top sets, by key.
	tops map[string]*memoryTop
	// learned is what models' answers showed, by key.
	learned map[string]learnedValue
	// owners are the owners' sets, by key (memory_lapse.go).
	owners map[string]map[string]*memoryOwner
}

// memoryTop is a top set: members' counters, kept while it is written.
type memoryTop struct {
	used    map[string]int64
	expires time.Time
}

// memoryValue is a counter, or a reservation's record, whose value is its
// state: recordReserved, or recordReleased (released before its reserve
// ran). A settle deletes the record it applies to.
type memoryValue struct {
	value   int64
	expires time.Time
	// held is what a reserved record holds of each counter, in the
	// reserve's order; extended, the last extension applied.
	held     []int64
	extended int
	// For the sweep (memory_lapse.go): the counters' keys and TTLs, the
	// last grant's number and what a lapse returns of each counter.
	counters []Charge
	grantSeq int64
	returns  []int64
}

const (
	recordReserved = 'r'
	recordReleased = 'x'
)

var _ Store = (*MemoryStore)(nil)

// NewMemoryStore returns an empty store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{keys: make(map[string]memoryValue), now: time.Now, overrides: make(map[string]map[string]int64), tops: make(map[string]*memoryTop),
		owners: make(map[string]map[string]*memoryOwner)}
}

// get reads a live value; callers hold m.mu.
func (m *MemoryStore) get(key string, now time.Time) (int64, bool) {
	if v, ok := m.keys[key]; ok && now.Before(v.expires) {
		return v.value, true
	}
	return 0, false
}

// Reserve implements Store.
func (m *MemoryStore) Reserve(_ context.Context, rec Record, recordTTL time.Duration, charges []Charge) (ReserveResult, error) {
	record := rec.Key
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.collect(now)
	if _, exists := m.get(record, now); exists {
		return ReserveResult{Cancelled: true, Denied: -1}, nil
	}
	res := ReserveResult{Denied: -1, Limits: m.limits(charges)}
	if res.Used, res.Denied = m.fitWithin(charges, res.Limits, now); res.Denied >= 0 {
		return res, nil
	}
	held := make([]int64, len(charges))
	m.charge(charges, res.Used, held, now)
	m.keys[record] = memoryValue{value: recordReserved, expires: now.Add(recordTTL), held: held, counters: slices.Clone(charges)}
	m.owner(rec.Owners, rec.Owner, now).open[record] = struct{}{}
	res.Admitted = true
	return res, nil
}

// Extend implements Store.
func (m *MemoryStore) Extend(_ context.Context, record string, seq int, charges []Charge) (ExtendResult, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	rec, ok := m.keys[record]
	if !ok || !now.Before(rec.expires) || rec.value != recordReserved || len(rec.held) != len(charges) || rec.extended < seq-1 {
		return ExtendResult{Gone: true, Denied: -1}, nil
	}
	res := ExtendResult{Denied: -1}
	res.Used, res.Denied = m.fit(charges, now)
	if rec.extended >= seq {
		res.Admitted, res.Denied = true, -1 // a repeat: it applied before
		return res, nil
	}
	if res.Denied >= 0 {
		return res, nil
	}
	m.charge(charges, res.Used, rec.held, now)
	rec.extended = seq
	m.keys[record] = rec
	res.Admitted = true
	return res, nil
}

// limits is the limit in force of each charge: its override, else its
// Limit. Callers hold m.mu.
func (m *MemoryStore) limits(charges []Charge) []int64 {
	out := make([]int64, len(charges))
	for i, c := range charges {
		out[i] = c.Limit
		if n := m.overrides[c.Overrides][c.Override]; c.Override != "" && n > 0 {
			out[i] = n
		}
	}
	return out
}

// fit reads the counters of charges and finds the first that does not fit
// its Limit (-1: all do); callers hold m.mu.
func (m *MemoryStore) fit(charges []Charge, now time.Time) (used []int64, denied int) {
	return m.fitWithin(charges, nil, now)
}

// fitWithin is fit against limits[i] instead of each charge's Limit (when
// limits is not nil); callers hold m.mu.
func (m *MemoryStore) fitWithin(charges []Charge, limits []int64, now time.Time) (used []int64, denied int) {
	used, denied = make([]int64, len(charges)), -1
	for i, c := range charges {
		limit := c.Limit
		if limits != nil {
			limit = limits[i]
		}
		used[i], _ = m.get(c.Key, now)
		if denied < 0 && used[i]+c.Amount > limit {
			denied = i
		}
	}
	return used, denied
}

// charge adds every charge to its counter (used, as fit read them, becomes
// the counters after) and to what the record holds; a charge of 0 writes
// no counter. Callers hold m.mu.
func (m *MemoryStore) charge(charges []Charge, used, held []int64, now time.Time) {
	for i, c := range charges {
		held[i] += c.Amount
		if c.Amount != 0 {
			used[i] += c.Amount
			m.keys[c.Key] = memoryValue{value: used[i], expires: now.Add(c.TTL)}
		}
	}
}

// Settle implements Store.
func (m *MemoryStore) Settle(_ context.Context, rec Record, ttl time.Duration, adjs []Adjustment) (bool, error) {
	record := rec.Key
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	state, exists := m.get(record, now)
	if !exists {
		m.keys[record] = memoryValue{value: recordReleased, expires: now.Add(ttl)}
		return false, nil
	}
	if state != recordReserved {
		return false, nil
	}
	held := m.keys[record].held
	delete(m.keys, record)
	if o := m.owners[rec.Owners][rec.Owner]; o != nil {
		if delete(o.open, record); len(o.open) == 0 {
			delete(m.owners[rec.Owners], rec.Owner)
		}
	}
	for i, a := range adjs {
		v, _ := m.get(a.Key, now)
		if a.Amount != KeepHeld {
			var h int64
			if i < len(held) {
				h = held[i]
			}
			if v += a.Amount - h; v > 0 {
				m.keys[a.Key] = memoryValue{value: v, expires: now.Add(a.TTL)}
			} else {
				delete(m.keys, a.Key)
			}
		}
		if a.Member != "" {
			m.keepTop(a, v, now)
		}
		adjs[i].Crossed, adjs[i].After = m.cross(a, v, now), v
	}
	return true, nil
}

// cross marks each of a's alerts that v reaches and none marked before,
// and returns their indexes. A mark is a value of the keyspace named by
// the alerted hash and the field. Callers hold m.mu.
func (m *MemoryStore) cross(a Adjustment, v int64, now time.Time) []int {
	var crossed []int
	for j, al := range a.Alerts {
		mark := a.Alerted + "\x00" + al.Field
		if _, marked := m.get(mark, now); v >= al.At && !marked {
			m.keys[mark] = memoryValue{value: v, expires: now.Add(a.TTL)}
			crossed = append(crossed, j)
		}
	}
	return crossed
}

// keepTop makes v, a's counter after its settle, a.Member's in a's top set,
// which keeps the TopSize largest. Callers hold m.mu.
func (m *MemoryStore) keepTop(a Adjustment, v int64, now time.Time) {
	t := m.tops[a.Top]
	if t == nil || !now.Before(t.expires) {
		t = &memoryTop{used: make(map[string]int64)}
		m.tops[a.Top] = t
	}
	if v <= 0 {
		delete(t.used, a.Member)
		return
	}
	t.used[a.Member], t.expires = v, now.Add(a.TTL)
	if len(t.used) > TopSize {
		least := slices.MinFunc(slices.Collect(maps.Keys(t.used)), func(x, y string) int { return compareTop(t.used, y, x) })
		delete(t.used, least)
	}
}

// compareTop orders members of a top set as Redis's ZREVRANGE does: the
// larger counter first, then the greater member.
func compareTop(used map[string]int64, x, y string) int {
	return cmp.Or(cmp.Compare(used[y], used[x]), cmp.Compare(y, x))
}

// Top implements Store.
func (m *MemoryStore) Top(_ context.Context, top string, n int) ([]TopEntry, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	t := m.tops[top]
	if t == nil || !now.Before(t.expires) {
		return []TopEntry{}, nil
	}
	members := slices.SortedFunc(maps.Keys(t.used), func(x, y string) int { return compareTop(t.used, x, y) })
	out := make([]TopEntry, 0, min(n, len(members)))
	for _, mb := range members[:min(n, len(members))] {
		out = append(out, TopEntry{Member: mb, Used: t.used[mb]})
	}
	return out, nil
}

// Ping implements Store.
func (m *MemoryStore) Ping(context.Context) error { return nil }

// SetOverride implements Store.
func (m *MemoryStore) SetOverride(_ context.Context, table, field string, limit int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if limit <= 0 {
		delete(m.overrides[table], field)
		return nil
	}
	if m.overrides[table] == nil {
		m.overrides[table] = make(map[string]int64)
	}
	m.overrides[table][field] = limit
	return nil
}

// Override implements Store.
func (m *MemoryStore) Override(_ context.Context, table, field string) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.overrides[table][field], nil
}

// Get implements Store.
func (m *MemoryStore) Get(_ context.Context, keys []string) ([]int64, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]int64, len(keys))
	for i, k := range keys {
		out[i], _ = m.get(k, now)
	}
	return out, nil
}

// Reset implements Store.
func (m *MemoryStore) Reset(_ context.Context, keys []string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, k := range keys {
		delete(m.keys, k)
	}
	return nil
}

// collect drops expired values, at most once a second, so the map stays
// bounded by what is live. Callers hold m.mu.
func (m *MemoryStore) collect(now time.Time) {
	if now.Sub(m.lastGC) < time.Second {
		return
	}
	m.lastGC = now
	for k, v := range m.keys {
		if !now.Before(v.expires) {
			delete(m.keys, k)
		}
	}
	for k, t := range m.tops {
		if !now.Before(t.expires) {
			delete(m.tops, k)
		}
	}
}

// MarkOnce implements Store. A mark is a value of the keyspace named by the
// hash and the field, kept for ttl.
func (m *MemoryStore) MarkOnce(_ context.Context, marks, field string, ttl time.Duration) (bool, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	mark := marks + "\x00" + field
	if _, marked := m.get(mark, now); marked {
		return false, nil
	}
	m.keys[mark] = memoryValue{value: 1, expires: now.Add(ttl)}
	return true, nil
}
