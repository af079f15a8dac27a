package ratelimit

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// MemoryStore is the embedded SlotStore (and, shared by several engines, a
// fleet in tests). Each operation takes the steps of its Lua script, on a
// hash of string fields as Redis holds it; TestStoreTwinsAgree runs both on
// the same random calls.
type MemoryStore struct {
	mu   sync.Mutex
	keys map[string]*memoryHash
	now  func() time.Time
}

type memoryHash struct {
	fields  map[string]string
	expires int64 // Unix ms; 0: none
}

var _ SlotStore = (*MemoryStore)(nil)

// NewMemoryStore returns an empty in-process store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{keys: make(map[string]*memoryHash), now: time.Now}
}

// hash returns key's hash, made if absent (and dropped if expired).
func (m *MemoryStore) hash(key string) *memoryHash {
	now := m.now().UnixMilli()
	h := m.keys[key]
	if h != nil && h.expires != 0 && h.expires <= now {
		h = nil
	}
	if h == nil {
		h = &memoryHash{fields: make(map[string]string)}
		m.keys[key] = h
	}
	return h
}

func (h *memoryHash) expire(after int64, now int64) { h.expires = now + after }

func atoi(s string) int64 { n, _ := strconv.ParseInt(s, 10, 64); return n }

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// Lease implements SlotStore, step for step as lease.lua.
func (m *MemoryStore) Lease(_ context.Context, calls []Lease, replies []LeaseReply) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := range calls {
		replies[i] = m.lease(&calls[i])
	}
	return nil
}

func (m *MemoryStore) lease(c *Lease) LeaseReply {
	h := m.hash(c.Key)
	had := len(h.fields) > 0
	me := "g" + itoa(c.Member)
	k := h.readKey(c, me)
	if k.since < 0 || c.Now-k.last > c.Gap.Milliseconds() {
		// A new hot period: the marks were of the last one.
		k.since = c.Now
		h.dropMarks(k.marks, c.Hot, func(int64) bool { return false })
	}
	settled := k.since + c.Settle.Milliseconds()
	if c.Hot {
		h.fields["h"] = itoa(k.since) + " " + itoa(c.Now)
		if c.Life > 0 && c.Life < settled {
			k.marks[c.Life] = true
			h.fields["m"+itoa(c.Life)] = "1"
		}
		if c.View {
			h.dropMarks(k.marks, true, func(x int64) bool { return x == c.Life || slices.Contains(c.Lives, x) })
		}
	}
	for _, p := range c.Push {
		if f := itoa(p.Slot); p.Slot >= c.Oldest {
			h.fields[f] = itoa(atoi(h.fields[f]) + p.Count)
		}
	}
	r := LeaseReply{Holders: k.holders, Lapses: k.lapses}
	for f, v := range h.fields {
		if n := atoi(v); f[0] >= '0' && f[0] <= '9' && n > 0 {
			r.Pushed += n
			if s := atoi(f); r.Oldest == 0 || s < r.Oldest {
				r.Oldest = s
			}
		}
	}
	room := c.Events - r.Pushed - c.Held - k.grants - reservedFloors(c, settled, k.marks)
	r.Granted = max(min(c.Want, room), -c.Held) // past the room, Held is cut back
	if r.Granted+c.Held > 0 {
		h.fields[me] = itoa(r.Granted+c.Held) + " " + itoa(c.Until)
	} else {
		r.Holders--
	}
	r.Room = room - r.Granted
	if had || len(h.fields) > 0 {
		h.expire(c.TTL.Milliseconds(), m.now().UnixMilli())
	}
	return r
}

// dropMarks forgets the marks not kept, and deletes them from h if del.
func (h *memoryHash) dropMarks(marks map[int64]bool, del bool, keep func(int64) bool) {
	for x := range marks {
		if !keep(x) {
			delete(marks, x)
			if del {
				delete(h.fields, "m"+itoa(x))
			}
		}
	}
}

// keyState is what a lease reads of a key's hash: the other members'
// grants and how many hold one (the caller counted), the marks, and the hot
// period (since -1: none).
type keyState struct {
	grants, holders int64
	lapses          int64 // when the first of them lapses (0: none)
	marks           map[int64]bool
	since, last     int64
}

// readKey reads h for c, dropping what lapsed or left the window and the
// caller's grant (me), which the lease sets again.
func (h *memoryHash) readKey(c *Lease, me string) keyState {
	k := keyState{holders: 1, marks: map[int64]bool{}, since: -1}
	for f, v := range h.fields {
		switch {
		case f == me:
			delete(h.fields, f)
		case f[0] == 'g':
			n, u, _ := strings.Cut(v, " ")
			if u := atoi(u); u <= c.Now {
				delete(h.fields, f)
			} else {
				k.grants, k.holders = k.grants+atoi(n), k.holders+1
				if k.lapses == 0 || u < k.lapses {
					k.lapses = u
				}
			}
		case f[0] == 'm':
			k.marks[atoi(f[1:])] = true
		case f == "h":
			s, l, _ := strings.Cut(v, " ")
			k.since, k.last = atoi(s), atoi(l)
		case f[0] < '0' || f[0] > '9' || atoi(f) < c.Oldest:
			delete(h.fields, f)
		}
	}
	return k
}

// reservedFloors is what a lease holds back for the floors of the slots that
// may hold admits the store has not seen, as lease.lua counts it.
func reservedFloors(c *Lease, settled int64, marks map[int64]bool) int64 {
	if !c.View {
		return c.Floor * int64(c.MaxInstances)
	}
	young := c.Now < settled
	var n int64
	if young {
		n = c.Floor * int64(c.MaxInstances-len(c.Lives))
	}
	for _, x := range c.Lives {
		if !marks[x] && (young || x < settled) {
			n += c.Floor
		}
	}
	return n
}

// slotRecord is one instance slot's record in the slot table (see
// slots.lua).
type slotRecord struct {
	member      string
	life, until int64
	flushed     bool
}

// counts reports whether r's floor admits may count at now: while it lives,
// and keep after a death.
func (r *slotRecord) counts(now, keep int64) bool {
	return r.until > now || !r.flushed && r.until+keep > now
}

// free reports whether r's slot is free at now: once its floor admits do not
// count, and once released a settle after (see slots.lua).
func (r *slotRecord) free(now, keep, settle int64) bool {
	return !r.counts(now, keep) && (!r.flushed || r.until+settle <= now)
}

func (r *slotRecord) String() string {
	return r.member + " " + itoa(r.life) + " " + itoa(r.until) + " " + strconv.FormatBool(r.flushed)
}

// Beat implements SlotStore, step for step as slots.lua.
func (m *MemoryStore) Beat(_ context.Context, key, hotKey string, b Beat) (SlotTable, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	tbl := m.hash(key)
	member, keep, ttl := itoa(b.Member), b.Keep.Milliseconds(), b.TTL.Milliseconds()
	n := m.fleetSlots(tbl, b, keep)
	recs := make([]*slotRecord, n)
	for f, v := range tbl.fields {
		p := strings.Fields(v)
		if j := atoi(f[1:]); f[0] == 's' && j < int64(n) && len(p) == 4 {
			recs[j] = &slotRecord{member: p[0], life: atoi(p[1]), until: atoi(p[2]), flushed: p[3] == "true"}
		}
	}
	slot := b.Slot
	if n != b.MaxInstances || slot >= len(recs) || slot >= 0 && (recs[slot] == nil || recs[slot].member != member) {
		slot = -1 // lost: its record lapsed and another took it (or n differs)
	}
	switch {
	case slot >= 0:
		recs[slot].until, recs[slot].flushed = b.Now+ttl, b.Flushed
		tbl.fields["s"+strconv.Itoa(slot)] = recs[slot].String()
	case ttl > 0 && n == b.MaxInstances:
		for j, r := range recs {
			if r == nil || r.free(b.Now, keep, b.Settle.Milliseconds()) {
				slot, recs[j] = j, &slotRecord{member: member, life: max(b.Now, atoi(tbl.fields["l"])+1), until: b.Now + ttl}
				tbl.fields["s"+strconv.Itoa(j)], tbl.fields["l"] = recs[j].String(), itoa(recs[j].life)
				break
			}
		}
	}
	tbl.expire(keep+60_000, m.now().UnixMilli())
	t := SlotTable{Slot: -1, Slots: n}
	if slot >= 0 && ttl > 0 {
		t.Slot, t.Life = slot, recs[slot].life
	}
	for _, r := range recs {
		if r != nil && r.until > b.Now {
			t.Live++
		}
		if r != nil && r.counts(b.Now, keep) {
			t.Lives = append(t.Lives, r.life)
		}
	}
	t.Hot = m.hot(hotKey, b)
	return t, nil
}

// fleetSlots is the fleet's max instances, as slots.lua keeps it: the
// table's while a record of any slot counts, else b's (and kept).
func (m *MemoryStore) fleetSlots(tbl *memoryHash, b Beat, keep int64) int {
	n, stored := b.MaxInstances, int(atoi(tbl.fields["n"]))
	for f, v := range tbl.fields {
		if p := strings.Fields(v); f[0] == 's' && len(p) == 4 && stored > 0 {
			r := slotRecord{until: atoi(p[2]), flushed: p[3] == "true"}
			if r.counts(b.Now, keep) {
				n = stored
				break
			}
		}
	}
	tbl.fields["n"] = strconv.Itoa(n)
	return n
}

// hot records the keys b called hot and answers every hot key not past its
// keep, as slots.lua does.
func (m *MemoryStore) hot(hotKey string, b Beat) []HotKey {
	h := m.hash(hotKey)
	for _, k := range b.Hot {
		if k.Until > atoi(h.fields[k.Key]) {
			h.fields[k.Key] = itoa(k.Until)
		}
	}
	var out []HotKey
	var latest int64
	for k, v := range h.fields {
		if u := atoi(v); u+b.HotKeep.Milliseconds() <= b.Now {
			delete(h.fields, k)
		} else {
			out = append(out, HotKey{Key: k, Until: u})
			latest = max(latest, u)
		}
	}
	if latest > 0 {
		h.expire(latest+b.HotKeep.Milliseconds()-b.Now, m.now().UnixMilli())
	}
	return out
}

// Sweep drops expired keys; the reconciler calls it with its evictions.
func (m *MemoryStore) Sweep() {
	now := m.now().UnixMilli()
	m.mu.Lock()
	defer m.mu.Unlock()
	for name, h := range m.keys {
		if h.expires != 0 && h.expires <= now || len(h.fields) == 0 {
			delete(m.keys, name)
		}
	}
}
