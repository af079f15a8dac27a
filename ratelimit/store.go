package ratelimit

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"time"
)

// SlotCount is the count of one time slot of a key's window.
type SlotCount struct {
	Slot  int64
	Count int64
}

// Lease is one store call for one key, run atomically: give back the
// member's outstanding grant but Held, push admits into their time slots,
// mark (or unmark) the instance slot as having pushed its floor admits of
// the key, and grant up to Want admits more, as far as the room allows. The
// room is Events minus the window's pushed admits, the outstanding grants
// (Held included) and F for every slot of Holding not marked pushed.
type Lease struct {
	Key    string
	Now    int64 // Unix ms
	Oldest int64 // the oldest time slot that counts
	TTL    time.Duration
	Member int64
	Slot   int // the member's instance slot, -1 if none
	// Mark marks Slot pushed until MarkUntil (Unix ms); a mark is never
	// shortened, as grants rely on it.
	Mark      bool
	MarkUntil int64
	Floor     int64  // F
	Events    int64  // the limit
	Holding   uint64 // bit j: instance slot j may hold floor admits
	Held      int64  // admits of its grant the member keeps
	Want      int64
	Until     int64 // the grant (and Held) counts until then (Unix ms)
	Push      []SlotCount
}

// LeaseReply is what a Lease left in the store.
type LeaseReply struct {
	// Granted is the grant, or, negative, what the room took back of Held.
	Granted int64
	// Room is what the fleet may still admit of the key past every grant
	// and every floor held back: can be negative.
	Room int64
	// MarksUntil is when the first mark of another holding slot the room
	// relied on lapses (Unix ms; 0: none): the grant ends then.
	MarksUntil int64
	// Slots are the window's pushed admits, in no particular order.
	Slots []SlotCount
	// Err is set when the call failed; it may or may not have applied.
	Err error
}

// Beat is one instance's heartbeat on the slot table: it renews (or takes,
// Slot -1) an instance slot, or releases it (TTL 0), names the keys that
// went to leases here (Hot), and learns the table.
type Beat struct {
	Member int64
	Slot   int
	Now    int64 // Unix ms
	TTL    time.Duration
	// Flushed says a release pushed every floor admit: the slot is free at
	// once. A slot not released that way holds its floor for Keep after
	// its last heartbeat.
	Flushed bool
	Keep    time.Duration
	// View is how long an instance acts on a beat's Holding: a slot taken
	// that an answered beat left out of Holding has its floor usable only
	// View and Keep after that beat (the grants made without it are used
	// until View after it, and their admits count for a window).
	View         time.Duration
	MaxInstances int
	HotFor       time.Duration
	// Leasing says the instance makes lease calls with the Holding it is
	// answered: the slots out of it are recorded (see View). An instance
	// that makes none holds every slot's floor back in its next call.
	Leasing bool
	// Handed, on a flushed release, are the keys whose slot marks may still
	// count (keys on leases), until HandedUntil (Unix ms): the slot's next
	// holder is answered them, and keeps them off its floor until then.
	Handed      []string
	HandedUntil int64
	Hot         []string
}

// SlotTable is what a Beat learns.
type SlotTable struct {
	Slot    int   // the instance slot held (-1: none)
	FloorAt int64 // Unix ms: when its floor may be used
	// Holding has bit j set for each slot that may hold floor admits: a
	// live one, a dead one within Keep, and the spare (the free slot a
	// newcomer takes at once).
	Holding uint64
	Live    int
	Hot     []string
	// Handed are the keys the slot's last holder handed over (see
	// Beat.Handed): off the floor until HandedUntil (Unix ms).
	Handed      []string
	HandedUntil int64
}

// SlotStore holds the fleet's counts and its slot table.
type SlotStore interface {
	// Lease runs every call and fills replies (one per call); the calls are
	// independent. It returns the first error. A store never re-sends a
	// call by itself.
	Lease(ctx context.Context, calls []Lease, replies []LeaseReply) error
	// Beat runs b on the slot table (key) and hot keys (hotKey).
	Beat(ctx context.Context, key, hotKey string, b Beat) (SlotTable, error)
}

// MemoryStore is the embedded SlotStore (and, shared by several engines, a
// fleet in tests). Each operation takes the steps of its Lua twin, on a
// hash of string fields as Redis holds it.
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

func (h *memoryHash) incr(f string, by int64) {
	n, _ := strconv.ParseInt(h.fields[f], 10, 64)
	h.fields[f] = strconv.FormatInt(n+by, 10)
}

func atoi(s string) int64 { n, _ := strconv.ParseInt(s, 10, 64); return n }

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
	me := "g" + strconv.FormatInt(c.Member, 10)
	delete(h.fields, me)
	for _, p := range c.Push {
		if p.Slot >= c.Oldest {
			h.incr(strconv.FormatInt(p.Slot, 10), p.Count)
		}
	}
	if mark := "p" + strconv.Itoa(c.Slot); c.Mark && atoi(h.fields[mark]) < c.MarkUntil {
		h.fields[mark] = strconv.FormatInt(c.MarkUntil, 10)
	}
	used := c.Held
	var pushed [64]int64 // mark until, by slot
	var r LeaseReply
	for f, v := range h.fields {
		switch f[0] {
		case 'g':
			n, u, _ := strings.Cut(v, " ")
			if atoi(u) <= c.Now {
				delete(h.fields, f)
			} else {
				used += atoi(n)
			}
		case 'p':
			if atoi(v) <= c.Now {
				delete(h.fields, f)
			} else if j := atoi(f[1:]); j >= 0 && j < 64 {
				pushed[j] = atoi(v)
			}
		default:
			if s := atoi(f); s < c.Oldest {
				delete(h.fields, f)
			} else {
				used += atoi(v)
				r.Slots = append(r.Slots, SlotCount{Slot: s, Count: atoi(v)})
			}
		}
	}
	for j := range 64 {
		switch m := pushed[j]; {
		case c.Holding&(1<<j) == 0:
		case m == 0:
			used += c.Floor
		case c.Floor > 0 && j != c.Slot && (r.MarksUntil == 0 || m < r.MarksUntil):
			r.MarksUntil = m
		}
	}
	room := c.Events - used
	r.Granted = max(min(c.Want, room), -c.Held) // past the room, Held is cut back
	if r.Granted+c.Held > 0 {
		h.fields[me] = strconv.FormatInt(r.Granted+c.Held, 10) + " " + strconv.FormatInt(c.Until, 10)
	}
	r.Room = room - r.Granted
	if len(h.fields) > 0 {
		h.expires = m.now().UnixMilli() + c.TTL.Milliseconds()
	}
	return r
}

// Beat implements SlotStore, step for step as slots.lua.
func (m *MemoryStore) Beat(_ context.Context, key, hotKey string, b Beat) (SlotTable, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	tbl := m.hash(key)
	type rec struct {
		member        string
		until, at     int64
		flushed, some bool
	}
	recs := make([]rec, b.MaxInstances)
	for f, v := range tbl.fields {
		j := atoi(f[1:])
		if f[0] != 's' || j >= int64(b.MaxInstances) {
			continue
		}
		p := strings.Fields(v)
		recs[j] = rec{member: p[0], until: atoi(p[1]), flushed: p[2] == "1", at: atoi(p[3]), some: true}
	}
	member := strconv.FormatInt(b.Member, 10)
	keep, view, ttl := b.Keep.Milliseconds(), b.View.Milliseconds(), b.TTL.Milliseconds()
	slot := b.Slot
	if slot >= 0 && (slot >= len(recs) || !recs[slot].some || recs[slot].member != member) {
		slot = -1
	}
	var floorAt int64
	set := func(j int, r rec) {
		recs[j] = r
		fl := "0"
		if r.flushed {
			fl = "1"
		}
		tbl.fields["s"+strconv.Itoa(j)] = member + " " + strconv.FormatInt(r.until, 10) + " " + fl + " " + strconv.FormatInt(r.at, 10)
	}
	var handed []string
	switch {
	case ttl == 0:
		if slot >= 0 {
			set(slot, rec{member: member, until: b.Now, flushed: b.Flushed, at: recs[slot].at, some: true})
			m := "m" + strconv.Itoa(slot)
			delete(tbl.fields, m)
			if b.Flushed && len(b.Handed) > 0 {
				tbl.fields[m] = strconv.FormatInt(b.HandedUntil, 10) + " " + strings.Join(b.Handed, " ")
			}
		}
		slot = -1
	case slot >= 0:
		floorAt = recs[slot].at
		set(slot, rec{member: member, until: b.Now + ttl, at: floorAt, some: true})
	default:
		for j, r := range recs {
			if r.some && r.until > b.Now {
				continue
			}
			at := b.Now
			if o, ok := tbl.fields["o"+strconv.Itoa(j)]; ok {
				at = max(at, atoi(o)+view+keep)
			}
			if r.some && !r.flushed {
				at = max(at, r.until+keep)
			}
			if slot < 0 || at < floorAt {
				slot, floorAt = j, at
			}
		}
		if slot >= 0 {
			m := "m" + strconv.Itoa(slot)
			if v, ok := tbl.fields[m]; ok {
				delete(tbl.fields, m)
				if handed = strings.Fields(v); atoi(handed[0]) <= b.Now {
					handed = nil
				}
			}
			set(slot, rec{member: member, until: b.Now + ttl, at: floorAt, some: true})
		}
	}
	t := SlotTable{Slot: slot, FloorAt: floorAt}
	if len(handed) > 0 {
		t.HandedUntil, t.Handed = atoi(handed[0]), handed[1:]
	}
	spare := false
	for j, r := range recs {
		switch {
		case r.some && r.until > b.Now:
			t.Live++
		case r.some && !r.flushed && r.until+keep > b.Now:
		case !spare:
			spare = true
		default:
			if b.Leasing {
				tbl.fields["o"+strconv.Itoa(j)] = strconv.FormatInt(b.Now, 10)
			}
			continue
		}
		t.Holding |= 1 << j
	}
	tbl.expires = m.now().UnixMilli() + keep + view + 60_000
	hot := m.hash(hotKey)
	for _, k := range b.Hot {
		hot.fields[k] = strconv.FormatInt(b.Now+b.HotFor.Milliseconds(), 10)
	}
	n := len(hot.fields)
	for k, v := range hot.fields {
		if atoi(v) <= b.Now {
			delete(hot.fields, k)
		} else {
			t.Hot = append(t.Hot, k)
		}
	}
	if n > 0 {
		hot.expires = m.now().UnixMilli() + b.HotFor.Milliseconds() + 60_000
	}
	return t, nil
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
