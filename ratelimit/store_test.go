package ratelimit

import (
	"context"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/redistest"
)

// storeCase sets up one kind of store; the setup's result builds a client of
// it per use, as each instance of a fleet has its own.
type storeCase struct {
	name  string
	setup func(t *testing.T) func(t testing.TB) SlotStore
}

func storeCases() []storeCase {
	return []storeCase{
		{"memory", func(*testing.T) func(testing.TB) SlotStore {
			m := NewMemoryStore() // one store shared by every "instance"
			return func(testing.TB) SlotStore { return m }
		}},
		{"redis", func(t *testing.T) func(testing.TB) SlotStore {
			srv := redistest.Start(t)
			return func(t testing.TB) SlotStore { return NewRedisStore(srv.Client(t)) }
		}},
		{"redis-cluster", func(t *testing.T) func(testing.TB) SlotStore {
			c := redistest.StartCluster(t)
			return func(t testing.TB) SlotStore { return NewRedisStore(c.Client(t)) }
		}},
		{"redis-sentinel", func(t *testing.T) func(testing.TB) SlotStore {
			s := redistest.StartSentinel(t, 1)
			return func(t testing.TB) SlotStore { return NewRedisStore(s.Client(t)) }
		}},
	}
}

func leaseAll(t testing.TB, s SlotStore, calls []Lease) []LeaseReply {
	t.Helper()
	replies := make([]LeaseReply, len(calls))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Lease(ctx, calls, replies); err != nil {
		t.Fatalf("lease: %v", err)
	}
	return replies
}

func slotMap(r LeaseReply) map[int64]int64 {
	m := make(map[int64]int64, len(r.Slots))
	for _, s := range r.Slots {
		m[s.Slot] = s.Count
	}
	return m
}

// t0 is a time (Unix ms) the store cases start from.
const t0 = int64(1_800_000_000_000)

// TestSlotStoreConformance runs the same cases against every SlotStore, each
// with many keys per call so that a Cluster spreads them over its nodes.
func TestSlotStoreConformance(t *testing.T) {
	const keys = 30
	cases := []struct {
		name string
		run  func(t *testing.T, s SlotStore, prefix string)
	}{
		{"pushes land in their slots; old slots leave the window", func(t *testing.T, s SlotStore, prefix string) {
			var calls []Lease
			for k := range keys {
				calls = append(calls, Lease{Key: prefix + strconv.Itoa(k), Now: t0, Oldest: 80, TTL: time.Minute, Member: 1, Slot: -1, Events: 1000,
					Push: []SlotCount{{Slot: 100, Count: int64(k + 1)}, {Slot: 99, Count: 2}, {Slot: 79, Count: 50}}})
			}
			leaseAll(t, s, calls)
			replies := leaseAll(t, s, calls) // the same pushes again: the counts double
			for k, r := range replies {
				if m := slotMap(r); len(m) != 2 || m[100] != 2*int64(k+1) || m[99] != 4 || r.Room != 1000-2*int64(k+1)-4 || r.Granted != 0 {
					t.Fatalf("key %d: %+v", k, r)
				}
			}
			for k := range calls {
				calls[k].Oldest, calls[k].Push = 100, nil
			}
			if m := slotMap(leaseAll(t, s, calls)[0]); len(m) != 1 {
				t.Fatalf("slot 99 left the window: %v", m)
			}
			if d := expiresIn(t, s, prefix+"0"); d <= 50*time.Second || d > time.Minute {
				t.Fatalf("expires in %s, want the call's TTL", d)
			}
		}},
		{"a grant is bounded by the room, held back for the floors of the slots not pushed", func(t *testing.T, s SlotStore, prefix string) {
			// Slots 0, 1 and 3 may hold floors of 10; slot 1 pushed its own.
			base := Lease{Now: t0, Oldest: 0, TTL: time.Minute, Floor: 10, Events: 100, Holding: 0b1011, Until: t0 + 5000}
			var calls []Lease
			for k := range keys {
				c := base
				c.Key, c.Member, c.Slot, c.Mark, c.MarkUntil, c.Want = prefix+strconv.Itoa(k), 2, 1, true, t0+2000, 1000
				c.Push = []SlotCount{{Slot: 5, Count: 40}}
				calls = append(calls, c)
			}
			for k, r := range leaseAll(t, s, calls) {
				// 100 - 40 pushed - 2 floors: 40 granted.
				if r.Granted != 40 || r.Room != 0 {
					t.Fatalf("key %d: %+v, want 40 granted and no room left", k, r)
				}
			}
			// Another member sees the grant counted; it would keep 3 of its
			// own and asks for 5: there is no room, and the 3 are taken back.
			c := base
			c.Key, c.Member, c.Slot, c.Held, c.Want = prefix+"0", 3, 0, 3, 5
			if r := leaseAll(t, s, []Lease{c})[0]; r.Granted != -3 || r.Room != 0 {
				t.Fatalf("the other member: %+v, want its 3 taken back", r)
			}
			// The first member comes back having used 10: its grant is
			// given back, the 10 pushed, and it is granted again.
			c = calls[0]
			c.Push, c.Want = []SlotCount{{Slot: 6, Count: 10}}, 100
			if r := leaseAll(t, s, []Lease{c})[0]; r.Granted != 30 {
				t.Fatalf("the first member again: %+v, want 100-50 pushed-20 floors = 30", r)
			}
			// The mark lapses: its floor is held back again; grants lapse
			// at their Until.
			c = base
			c.Key, c.Member, c.Slot, c.Now, c.Want = prefix+"0", 4, -1, t0+2000, 1000
			if r := leaseAll(t, s, []Lease{c})[0]; r.Granted != 0 || r.Room != 100-50-30-30 {
				t.Fatalf("past the mark: %+v", r)
			}
			c.Now = t0 + 5000
			c.Want = 0
			if r := leaseAll(t, s, []Lease{c})[0]; r.Room != 100-50-30 {
				t.Fatalf("past the grants: %+v, want room 20", r)
			}
		}},
		{"a mark is never shortened; a grant ends with the first mark it relied on", func(t *testing.T, s SlotStore, prefix string) {
			c := Lease{Key: prefix + "m", Now: t0, TTL: time.Minute, Member: 9, Slot: 2, Mark: true, MarkUntil: t0 + 10_000, Floor: 7, Events: 50, Holding: 0b1100}
			if r := leaseAll(t, s, []Lease{c})[0]; r.Room != 43 || r.MarksUntil != 0 {
				t.Fatalf("marked: %+v, want slot 3's floor held back, and no other's mark relied on", r)
			}
			c.MarkUntil = t0 + 5000
			leaseAll(t, s, []Lease{c})
			o := Lease{Key: prefix + "m", Now: t0, TTL: time.Minute, Member: 8, Slot: 3, Mark: true, MarkUntil: t0 + 20_000, Floor: 7, Events: 50, Holding: 0b1100, Want: 10, Until: t0 + 60_000}
			if r := leaseAll(t, s, []Lease{o})[0]; r.Granted != 10 || r.Room != 40 || r.MarksUntil != t0+10_000 {
				t.Fatalf("the other slot: %+v, want 10 granted until slot 2's mark lapses at t0+10s", r)
			}
			o.Now, o.Want = t0+10_000, 0
			if r := leaseAll(t, s, []Lease{o})[0]; r.Room != 43 || r.MarksUntil != 0 {
				t.Fatalf("past slot 2's mark: %+v, want its floor held back again", r)
			}
		}},
	}
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			newStore := sc.setup(t)
			for i, c := range cases {
				t.Run(c.name, func(t *testing.T) {
					c.run(t, newStore(t), "conf"+strconv.Itoa(i)+":{k")
				})
			}
		})
	}
}

// TestSlotTableConformance: every store hands out instance slots alike. The
// first instances take the lowest free slots, usable at once while every
// answered beat held them (the spare); a slot left out of an answered beat
// is usable a view and a keep later; a slot released flushed is free at
// once (but for its marks); one
// whose holder died is held back, and given out last, its floor a keep
// after the holder's end; hot keys last HotFor.
func TestSlotTableConformance(t *testing.T) {
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			s := sc.setup(t)(t)
			const tbl, hot = "st:slots:{fleet}", "st:hot:{fleet}"
			beat := func(b Beat) SlotTable {
				t.Helper()
				b.Keep, b.View, b.MaxInstances, b.HotFor, b.Leasing = 10*time.Second, time.Second, 4, 1500*time.Millisecond, true
				st, err := s.Beat(context.Background(), tbl, hot, b)
				if err != nil {
					t.Fatal(err)
				}
				return st
			}
			a := beat(Beat{Member: 11, Slot: -1, Now: t0, TTL: 2 * time.Second, Hot: []string{"k1"}})
			if a.Slot != 0 || a.FloorAt != t0 || a.Holding != 0b11 || a.Live != 1 || !slices.Equal(a.Hot, []string{"k1"}) {
				t.Fatalf("first: %+v", a)
			}
			b := beat(Beat{Member: 12, Slot: -1, Now: t0 + 100, TTL: 2 * time.Second})
			if b.Slot != 1 || b.FloorAt != t0+100 || b.Holding != 0b111 || b.Live != 2 {
				t.Fatalf("second (the spare): %+v", b)
			}
			c := beat(Beat{Member: 13, Slot: -1, Now: t0 + 200, TTL: 2 * time.Second})
			if c.Slot != 2 || c.FloorAt != t0+11_000 || c.Holding != 0b1111 {
				t.Fatalf("third (out of the first answer, at t0: a view and a keep later): %+v", c)
			}
			// a is released flushed, b dies (its heartbeat lapses at t0+2100).
			beat(Beat{Member: 11, Slot: 0, Now: t0 + 300, Flushed: true, Handed: []string{"p:rl:{z:k}:500x20"}, HandedUntil: t0 + 20_000})
			st := beat(Beat{Member: 13, Slot: 2, Now: t0 + 3000, TTL: 2 * time.Second})
			if st.Slot != 2 || st.FloorAt != t0+11_000 || st.Holding != 0b0111 || st.Live != 1 || len(st.Hot) != 0 {
				t.Fatalf("after a release and a death: %+v, want slots 1 (dead), 2 (live) and the spare 0", st)
			}
			d := beat(Beat{Member: 14, Slot: -1, Now: t0 + 3100, TTL: 2 * time.Second})
			if d.Slot != 0 || d.FloorAt != t0+3100 || !slices.Equal(d.Handed, []string{"p:rl:{z:k}:500x20"}) || d.HandedUntil != t0+20_000 {
				t.Fatalf("a newcomer: %+v, want the released slot 0 at once, with the key handed over", d)
			}
			e := beat(Beat{Member: 15, Slot: -1, Now: t0 + 3200, TTL: 2 * time.Second})
			if e.Slot != 1 || e.FloorAt != t0+2100+10_000 {
				t.Fatalf("another: %+v, want the dead slot 1, a keep after its end (slot 3 comes later)", e)
			}
			f := beat(Beat{Member: 16, Slot: -1, Now: t0 + 3300, TTL: 2 * time.Second})
			if f.Slot != 3 || f.FloorAt != t0+3000+1000+10_000 {
				t.Fatalf("the last: %+v, want slot 3, a view and a keep after the beat that left it out", f)
			}
			if g := beat(Beat{Member: 17, Slot: -1, Now: t0 + 3400, TTL: 2 * time.Second}); g.Slot != -1 || g.Live != 4 {
				t.Fatalf("past max instances: %+v, want no slot", g)
			}
			// A holder whose slot another took has lost it.
			if st := beat(Beat{Member: 12, Slot: 1, Now: t0 + 3500, TTL: 2 * time.Second}); st.Slot != -1 {
				t.Fatalf("the dead holder back: %+v, want its slot lost", st)
			}
		})
	}
}

// Keys of a pass on a Cluster live on different nodes; one pass serves all.
func TestRedisStoreSpreadsOverClusterNodes(t *testing.T) {
	c := redistest.StartCluster(t)
	cc := c.Client(t)
	s := NewRedisStore(cc)
	z := newZone("spread", "z", 0, mustLimit(t, 10, time.Minute, 0).slots)
	var calls []Lease
	for k := 0; k < 50; k++ {
		calls = append(calls, Lease{Key: z.storeKey(hashOf(strconv.Itoa(k))), TTL: time.Minute, Events: 10, Slot: -1,
			Push: []SlotCount{{Slot: 1, Count: 1}}})
	}
	leaseAll(t, s, calls)
	total, withKeys := 0, 0
	for _, n := range c.Nodes {
		nc := redis.NewClient(&redis.Options{Addr: n.Addr()})
		keys, err := nc.Keys(context.Background(), "spread:*").Result()
		_ = nc.Close()
		if err != nil {
			t.Fatal(err)
		}
		total += len(keys)
		if len(keys) > 0 {
			withKeys++
		}
	}
	if total != 50 || withKeys < 2 {
		t.Fatalf("%d keys stored on %d nodes, want 50 spread over several", total, withKeys)
	}
}

// expiresIn is how long until the store drops key (0 or less: gone).
func expiresIn(t testing.TB, s SlotStore, key string) time.Duration {
	t.Helper()
	switch s := s.(type) {
	case *MemoryStore:
		s.mu.Lock()
		defer s.mu.Unlock()
		k, ok := s.keys[key]
		if !ok {
			return -2 // as Redis answers for a key that does not exist
		}
		return time.Duration(k.expires-s.now().UnixMilli()) * time.Millisecond
	case *RedisStore:
		d, err := s.client.PTTL(context.Background(), key).Result()
		if err != nil {
			t.Fatal(err)
		}
		return d // -2 ns when the key does not exist
	}
	t.Fatalf("expiresIn: a store of type %T", s)
	return 0
}

// TestStoreTwinsAgree runs the same random calls on the memory store and on
// Redis and wants the same answers: the Lua scripts and their Go twins are
// one semantics.
func TestStoreTwinsAgree(t *testing.T) {
	mem, red := NewMemoryStore(), NewRedisStore(redistest.Start(t).Client(t))
	rng := rand.New(rand.NewPCG(40, 3))
	ctx := context.Background()
	now := t0
	for i := range 3000 {
		now += rng.Int64N(400)
		if rng.IntN(10) == 0 {
			b := Beat{Member: 1 + rng.Int64N(6), Slot: rng.IntN(6) - 2, Now: now, TTL: time.Duration(rng.IntN(3)) * time.Second,
				Flushed: rng.IntN(2) == 0, Keep: time.Duration(rng.IntN(5000)) * time.Millisecond, View: time.Duration(rng.IntN(2000)) * time.Millisecond,
				MaxInstances: 5, HotFor: time.Duration(rng.IntN(3000)) * time.Millisecond, Leasing: rng.IntN(2) == 0}
			if b.TTL == 0 && b.Flushed && rng.IntN(2) == 0 {
				b.Handed, b.HandedUntil = []string{"h1", "h2"}, now+rng.Int64N(3000)
			}
			for range rng.IntN(3) {
				b.Hot = append(b.Hot, "h"+strconv.Itoa(rng.IntN(5)))
			}
			m, err1 := mem.Beat(ctx, "tw:slots:{fleet}", "tw:hot:{fleet}", b)
			r, err2 := red.Beat(ctx, "tw:slots:{fleet}", "tw:hot:{fleet}", b)
			slices.Sort(m.Hot)
			slices.Sort(r.Hot)
			if err1 != nil || err2 != nil || m.Slot != r.Slot || m.FloorAt != r.FloorAt || m.Holding != r.Holding || m.Live != r.Live || !slices.Equal(m.Hot, r.Hot) ||
				!slices.Equal(m.Handed, r.Handed) || m.HandedUntil != r.HandedUntil {
				t.Fatalf("call %d, %+v:\nmemory %+v %v\nredis  %+v %v", i, b, m, err1, r, err2)
			}
			continue
		}
		c := Lease{Key: "tw:{k" + strconv.Itoa(rng.IntN(3)) + "}", Now: now, Oldest: now/500 - 20, TTL: time.Hour,
			Member: 1 + rng.Int64N(4), Slot: rng.IntN(5) - 1, Mark: rng.IntN(2) == 0, MarkUntil: now + rng.Int64N(3000),
			Floor: rng.Int64N(8), Events: 20 + rng.Int64N(200), Holding: rng.Uint64N(32), Held: rng.Int64N(5), Want: rng.Int64N(30),
			Until: now + rng.Int64N(12_000)}
		for range rng.IntN(3) {
			c.Push = append(c.Push, SlotCount{Slot: now/500 - rng.Int64N(25), Count: 1 + rng.Int64N(9)})
		}
		m := leaseAll(t, mem, []Lease{c})[0]
		r := leaseAll(t, red, []Lease{c})[0]
		if m.Granted != r.Granted || m.Room != r.Room || m.MarksUntil != r.MarksUntil || !maps.Equal(slotMap(m), slotMap(r)) {
			t.Fatalf("call %d, %+v:\nmemory %+v\nredis  %+v", i, c, m, r)
		}
	}
}
