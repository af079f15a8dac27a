package ratelimit

import (
	"context"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
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
		{"script", func(t *testing.T) func(testing.TB) SlotStore {
			m := newScriptStore(t) // one store shared by every "instance"
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
				calls = append(calls, Lease{Key: prefix + strconv.Itoa(k), Now: t0, Oldest: 80, TTL: time.Minute, Member: 1, Events: 1000,
					Push: []SlotCount{{Slot: 100, Count: int64(k + 1)}, {Slot: 99, Count: 2}, {Slot: 79, Count: 50}}})
			}
			leaseAll(t, s, calls)
			replies := leaseAll(t, s, calls) // the same pushes again: the counts double
			for k, r := range replies {
				if r.Room != 1000-2*int64(k+1)-4 || r.Granted != 0 {
					t.Fatalf("key %d: %+v, want slots 100 and 99 counted twice, 79 not at all", k, r)
				}
			}
			for k := range calls {
				calls[k].Oldest, calls[k].Push = 100, nil
			}
			if r := leaseAll(t, s, calls)[0]; r.Room != 1000-2 {
				t.Fatalf("slot 99 left the window: %+v", r)
			}
			if d := expiresIn(t, s, prefix+"0"); d <= 50*time.Second || d > time.Minute {
				t.Fatalf("expires in %s, want the call's TTL", d)
			}
		}},
		{"a grant holds back the floors that may hold admits unseen: young, every unmarked life and free slot; settled, the older ones", func(t *testing.T, s SlotStore, prefix string) {
			// Four slots with floors of 10. Lives older than the period's
			// settle may hold floor admits unless they marked the key.
			old0, old1, old2, young := t0-5000, t0-4000, t0-3000, t0+1500
			base := Lease{Now: t0, TTL: time.Minute, Floor: 10, Events: 100, MaxInstances: 4, Settle: time.Second, Gap: 5 * time.Second,
				Until: t0 + 4000, Hot: true, View: true, Lives: []int64{old0, old1, young, old2}}
			var calls []Lease
			for k := range keys {
				c := base
				c.Key, c.Member, c.Life, c.Want = prefix+strconv.Itoa(k), 2, old1, 1000
				c.Push = []SlotCount{{Slot: 5, Count: 40}}
				calls = append(calls, c)
			}
			for k, r := range leaseAll(t, s, calls) {
				// The period began now: 100 - 40 pushed - 3 floors (old1
				// marks now): 30.
				if r.Granted != 30 || r.Room != 0 || r.Holders != 1 {
					t.Fatalf("key %d: %+v, want 30 granted and no room left", k, r)
				}
			}
			// Settled, the member of old0 holds 3 and asks for 5: old1
			// marked, old0 marks now, young is younger than the settle,
			// old2 is not and did not mark. 100 - 40 - 30 - 3 - 10 = 17.
			c := base
			c.Key, c.Now, c.Member, c.Life, c.Held, c.Want = prefix+"0", t0+1000, 3, old0, 3, 5
			if r := leaseAll(t, s, []Lease{c})[0]; r.Granted != 5 || r.Room != 12 || r.Holders != 2 {
				t.Fatalf("settled: %+v, want 5 granted, 12 left, 2 holders", r)
			}
			// Past the gap a new period begins: the marks are dropped (old0
			// marks again) and member 2's grant has lapsed.
			c.Now, c.Held, c.Want = t0+6500, 8, 0
			if r := leaseAll(t, s, []Lease{c})[0]; r.Granted != 0 || r.Room != 100-40-8-30 {
				t.Fatalf("a new period: %+v, want the three other floors held back again", r)
			}
			// A free slot is held back while the period is young.
			c.Now, c.Lives = t0+6600, []int64{old0, old1, young}
			if r := leaseAll(t, s, []Lease{c})[0]; r.Room != 100-40-8-30 {
				t.Fatalf("a free slot in a young period: %+v", r)
			}
			// A push alone gives the grant back and marks nothing.
			m := base
			m.Key, m.Member, m.Life = prefix+"x", 3, old0
			leaseAll(t, s, []Lease{m})
			p := base
			p.Key, p.Now, p.Member, p.Life, p.Hot = prefix+"x", t0+100, 2, old1, false
			leaseAll(t, s, []Lease{p})
			o := base
			o.Key, o.Now, o.Member, o.Life = prefix+"x", t0+200, 9, 0
			if r := leaseAll(t, s, []Lease{o})[0]; r.Room != 100-30 {
				t.Fatalf("after a push alone: %+v, want old1 still held back", r)
			}
		}},
		{"without a view every floor is held back", func(t *testing.T, s SlotStore, prefix string) {
			c := Lease{Key: prefix + "v", Now: t0, TTL: time.Minute, Member: 9, Life: t0 - 9000, Floor: 7, Events: 50, MaxInstances: 3,
				Settle: time.Second, Gap: time.Minute, Hot: true, Want: 100, Until: t0 + 60_000}
			leaseAll(t, s, []Lease{c})
			c.Now, c.Held, c.Want = t0+2000, 29, 0
			if r := leaseAll(t, s, []Lease{c})[0]; r.Room != 50-29-21 {
				t.Fatalf("%+v, want 3 floors held back", r)
			}
			c.View, c.Lives = true, []int64{t0 - 9000}
			if r := leaseAll(t, s, []Lease{c})[0]; r.Room != 50-29 {
				t.Fatalf("%+v, want none held back (only this slot's life, marked)", r)
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

// beater runs a case's beats on s's slot table tbl (hot keys hot), with
// Keep 10 s, Settle 1 s and HotKeep 1 s, and MaxInstances 4 unless the beat
// says; the hot keys come back sorted.
func beater(t *testing.T, s SlotStore, tbl, hot string) func(Beat) SlotTable {
	return func(b Beat) SlotTable {
		t.Helper()
		b.Keep, b.Settle, b.HotKeep = 10*time.Second, time.Second, time.Second
		if b.MaxInstances == 0 {
			b.MaxInstances = 4
		}
		st, err := s.Beat(context.Background(), tbl, hot, b)
		if err != nil {
			t.Fatal(err)
		}
		slices.SortFunc(st.Hot, func(a, b HotKey) int { return strings.Compare(a.Key, b.Key) })
		return st
	}
}

// TestSlotTableConformance: every store hands out instance slots alike. A
// newcomer takes the lowest free slot: never held, released flushed a settle
// ago, or whose holder's floor admits no longer count (a keep after its end); each
// holder has a life of its own, one past the last at least; hot keys are
// answered until HotKeep past their until.
func TestSlotTableConformance(t *testing.T) {
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			beat := beater(t, sc.setup(t)(t), "st:slots:{fleet}", "st:hot:{fleet}")
			a := beat(Beat{Member: 11, Slot: -1, Now: t0, TTL: 2 * time.Second, Hot: []HotKey{{"k1", t0 + 1500}}})
			if a.Slot != 0 || a.Life != t0 || a.Live != 1 || !slices.Equal(a.Hot, []HotKey{{"k1", t0 + 1500}}) || !slices.Equal(a.Lives, []int64{t0}) {
				t.Fatalf("first: %+v", a)
			}
			if b := beat(Beat{Member: 12, Slot: -1, Now: t0, TTL: 2100 * time.Millisecond, Hot: []HotKey{{"k1", t0 + 900}, {"k2", t0 + 2000}}}); b.Slot != 1 ||
				b.Life != t0+1 || b.Live != 2 || !slices.Equal(b.Hot, []HotKey{{"k1", t0 + 1500}, {"k2", t0 + 2000}}) {
				t.Fatalf("second, in the same millisecond: %+v, want a life of its own", b)
			}
			// 11 releases flushed; 12 dies (its record ends at t0+2100).
			if r := beat(Beat{Member: 11, Slot: 0, Now: t0 + 300, Flushed: true}); r.Slot != -1 || len(r.Hot) != 2 {
				t.Fatalf("a release: %+v", r)
			}
			if r := beat(Beat{Member: 20, Slot: -1, Now: t0 + 400, TTL: 2 * time.Second}); r.Slot != 2 {
				t.Fatalf("right after a release: %+v, want slot 2 (slot 0 is free a settle after its release)", r)
			}
			beat(Beat{Member: 20, Slot: 2, Now: t0 + 500, Flushed: true})
			c := beat(Beat{Member: 13, Slot: -1, Now: t0 + 3000, TTL: 2 * time.Second})
			if c.Slot != 0 || c.Life != t0+3000 || c.Live != 1 || len(c.Hot) != 0 || !slices.Equal(c.Lives, []int64{t0 + 3000, t0 + 1}) {
				t.Fatalf("after a release and a death: %+v, want the flushed slot 0, the dead one's life counted", c)
			}
			beat(Beat{Member: 14, Slot: -1, Now: t0 + 3100, TTL: 2 * time.Second})
			if d := beat(Beat{Member: 15, Slot: -1, Now: t0 + 3200, TTL: 2 * time.Second}); d.Slot != 3 {
				t.Fatalf("a newcomer: %+v, want slot 3, not the dead one's", d)
			}
			if e := beat(Beat{Member: 16, Slot: -1, Now: t0 + 3300, TTL: 2 * time.Second}); e.Slot != -1 || e.Live != 3 {
				t.Fatalf("past the free slots: %+v, want none while the dead one's floor admits count", e)
			}
			if f := beat(Beat{Member: 16, Slot: -1, Now: t0 + 12_100, TTL: 2 * time.Second}); f.Slot != 1 || f.Life != t0+12_100 {
				t.Fatalf("a keep after the death: %+v, want slot 1", f)
			}
			if st := beat(Beat{Member: 12, Slot: 1, Now: t0 + 12_200, TTL: 2 * time.Second}); st.Slot != -1 {
				t.Fatalf("the dead holder back: %+v, want its slot lost", st)
			}
		})
	}
}

// TestSlotTableKeepsTheFleetsMaxInstances: the table keeps the number of
// slots its holders took theirs under. A newcomer configured otherwise takes
// no slot (its floors would not add up with theirs) and learns the fleet's
// number; once no record counts, the next beat's number is the fleet's.
func TestSlotTableKeepsTheFleetsMaxInstances(t *testing.T) {
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			beat := beater(t, sc.setup(t)(t), "mi:slots:{fleet}", "mi:hot:{fleet}")
			if a := beat(Beat{Member: 1, Slot: -1, Now: t0, TTL: 2 * time.Second, MaxInstances: 4}); a.Slot != 0 || a.Slots != 4 {
				t.Fatalf("first: %+v, want slot 0 of 4", a)
			}
			if b := beat(Beat{Member: 2, Slot: -1, Now: t0 + 100, TTL: 2 * time.Second, MaxInstances: 8}); b.Slot != -1 || b.Slots != 4 || len(b.Lives) != 1 {
				t.Fatalf("configured for 8 in a fleet of 4: %+v, want no slot, the fleet's 4 and its life", b)
			}
			if a := beat(Beat{Member: 1, Slot: 0, Now: t0 + 200, TTL: 2 * time.Second, MaxInstances: 8}); a.Slot != -1 || a.Slots != 4 {
				t.Fatalf("the holder reconfigured for 8: %+v, want its slot given up", a)
			}
			// Its record (not renewed, not flushed) counts until a keep after
			// its end, t0+2000.
			if b := beat(Beat{Member: 2, Slot: -1, Now: t0 + 11_900, TTL: 2 * time.Second, MaxInstances: 8}); b.Slot != -1 || b.Slots != 4 {
				t.Fatalf("configured for 8 while one counts: %+v", b)
			}
			if b := beat(Beat{Member: 2, Slot: -1, Now: t0 + 12_100, TTL: 2 * time.Second, MaxInstances: 8}); b.Slot != 0 || b.Slots != 8 || len(b.Lives) != 1 {
				t.Fatalf("configured for 8 once none counts: %+v, want slot 0 of 8", b)
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
		calls = append(calls, Lease{Key: z.storeKey(hashOf(strconv.Itoa(k))), TTL: time.Minute, Events: 10,
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
	case *scriptStore:
		return s.pttl(key)
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

// TestScriptStoreAgreesWithRedis runs the same random calls on the test
// store (the scripts in process) and on Redis and wants the same answers:
// what the simulations in these tests find holds for the store itself.
func TestScriptStoreAgreesWithRedis(t *testing.T) {
	mem, red := newScriptStore(t), NewRedisStore(redistest.Start(t).Client(t))
	rng := rand.New(rand.NewPCG(40, 3))
	ctx := context.Background()
	now := t0
	for i := range 4000 {
		now += rng.Int64N(400)
		if rng.IntN(10) == 0 {
			b := randomBeat(rng, now)
			m, err1 := mem.Beat(ctx, "tw:slots:{fleet}", "tw:hot:{fleet}", b)
			r, err2 := red.Beat(ctx, "tw:slots:{fleet}", "tw:hot:{fleet}", b)
			byKey := func(a, b HotKey) int { return strings.Compare(a.Key, b.Key) }
			slices.SortFunc(m.Hot, byKey)
			slices.SortFunc(r.Hot, byKey)
			if err1 != nil || err2 != nil || m.Slot != r.Slot || m.Life != r.Life || m.Live != r.Live ||
				!slices.Equal(m.Lives, r.Lives) || !slices.Equal(m.Hot, r.Hot) {
				t.Fatalf("call %d, %+v:\nscripts %+v %v\nredis  %+v %v", i, b, m, err1, r, err2)
			}
			continue
		}
		c := randomLease(rng, now)
		m := leaseAll(t, mem, []Lease{c})[0]
		r := leaseAll(t, red, []Lease{c})[0]
		if m != r {
			t.Fatalf("call %d, %+v:\nscripts %+v\nredis  %+v", i, c, m, r)
		}
	}
}

func randomBeat(rng *rand.Rand, now int64) Beat {
	b := Beat{Member: 1 + rng.Int64N(6), Slot: rng.IntN(6) - 2, Now: now, TTL: time.Duration(rng.IntN(3)) * time.Second,
		Flushed: rng.IntN(2) == 0, Keep: time.Duration(rng.IntN(5000)) * time.Millisecond, Settle: time.Duration(rng.IntN(2000)) * time.Millisecond, MaxInstances: 5,
		HotKeep: time.Duration(rng.IntN(3000)) * time.Millisecond}
	for range rng.IntN(3) {
		b.Hot = append(b.Hot, HotKey{Key: "h" + strconv.Itoa(rng.IntN(5)), Until: now + rng.Int64N(3000)})
	}
	return b
}

func randomLease(rng *rand.Rand, now int64) Lease {
	// Lives from a few, so that marks match them.
	life := func() int64 { return (now/1000 - rng.Int64N(6)) * 1000 }
	c := Lease{Key: "tw:{k" + strconv.Itoa(rng.IntN(3)) + "}", Now: now, Oldest: now/500 - 20, TTL: time.Hour,
		Member: 1 + rng.Int64N(4), Life: rng.Int64N(2) * life(), Hot: rng.IntN(4) != 0,
		Floor: rng.Int64N(8), Events: 20 + rng.Int64N(200), MaxInstances: 4, Settle: time.Duration(rng.IntN(2000)) * time.Millisecond,
		Gap: time.Duration(rng.IntN(3000)) * time.Millisecond, Held: rng.Int64N(5), Want: rng.Int64N(30),
		Until: now + rng.Int64N(12_000), View: rng.IntN(4) != 0}
	for range rng.IntN(5) {
		c.Lives = append(c.Lives, life())
	}
	for range rng.IntN(3) {
		c.Push = append(c.Push, SlotCount{Slot: now/500 - rng.Int64N(25), Count: 1 + rng.Int64N(9)})
	}
	return c
}
