package ratelimit

import (
	"bytes"
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/redistest"
	"github.com/fleetguard/fleetguard/internal/wait"
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

func syncSteps(t testing.TB, s SlotStore, steps []Step) []Reply {
	t.Helper()
	replies := make([]Reply, len(steps))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Sync(ctx, steps, replies); err != nil {
		t.Fatalf("sync: %v", err)
	}
	return replies
}

func slotMap(r Reply) map[int64]int64 {
	m := make(map[int64]int64, len(r.Slots))
	for _, s := range r.Slots {
		m[s.Slot] = s.Count
	}
	return m
}

// TestSlotStoreConformance runs the same cases against every SlotStore, each
// with many keys per call so that a Cluster spreads them over its nodes.
func TestSlotStoreConformance(t *testing.T) {
	const keys = 60
	cases := []struct {
		name string
		run  func(t *testing.T, newStore func(testing.TB) SlotStore, prefix string)
	}{
		{"adds land in their slots, per key", func(t *testing.T, newStore func(testing.TB) SlotStore, prefix string) {
			s := newStore(t)
			var steps []Step
			for k := 0; k < keys; k++ {
				steps = append(steps, Step{Key: prefix + strconv.Itoa(k), Oldest: 80, TTL: time.Minute, Demand: int64(k + 1),
					Adds: [2]SlotCount{{Slot: 100, Count: int64(k + 1)}, {Slot: 99, Count: 2}}})
			}
			syncSteps(t, s, steps)
			replies := syncSteps(t, s, steps) // the same adds again: the counts double
			for k, r := range replies {
				got := slotMap(r)
				if len(got) != 2 || got[100] != int64(2*(k+1)) || got[99] != 4 || r.Demand != int64(2*(k+1)) {
					t.Fatalf("key %d: slots %v demand %d, want 100:%d 99:4 demand %d", k, got, r.Demand, 2*(k+1), 2*(k+1))
				}
			}
		}},
		{"a floor push counts once, however often it is sent", func(t *testing.T, newStore func(testing.TB) SlotStore, prefix string) {
			s := newStore(t)
			now := time.Now().UnixMilli()
			var steps []Step
			for k := 0; k < keys; k++ {
				steps = append(steps, Step{Key: prefix + strconv.Itoa(k), Oldest: 80, TTL: time.Minute, Now: now,
					Adds:  [2]SlotCount{{Slot: 100, Count: 1}},
					Floor: []SlotCount{{Slot: 98, Count: 5}, {Slot: 99, Count: int64(k + 1)}}, FloorID: "7." + strconv.Itoa(k)})
			}
			syncSteps(t, s, steps)
			replies := syncSteps(t, s, steps) // sent again: its adds count again, its floor push does not
			for k, r := range replies {
				got := slotMap(r)
				if len(got) != 3 || got[98] != 5 || got[99] != int64(k+1) || got[100] != 2 || r.Syncing != 0 {
					t.Fatalf("key %d: slots %v, %d syncing; want 98:5 99:%d 100:2, none syncing", k, got, r.Syncing, k+1)
				}
			}
		}},
		{"slots older than the window are dropped", func(t *testing.T, newStore func(testing.TB) SlotStore, prefix string) {
			s := newStore(t)
			var steps []Step
			for k := 0; k < keys; k++ {
				steps = append(steps, Step{Key: prefix + strconv.Itoa(k), Oldest: 0, TTL: time.Minute,
					Adds: [2]SlotCount{{Slot: 10, Count: 3}, {Slot: 20, Count: 5}}})
			}
			syncSteps(t, s, steps)
			for k := range steps {
				// Slot 10 has left; an add to a slot that has left is ignored.
				steps[k] = Step{Key: steps[k].Key, Oldest: 15, TTL: time.Minute, Adds: [2]SlotCount{{Slot: 12, Count: 7}}}
			}
			for k, r := range syncSteps(t, s, steps) {
				if got := slotMap(r); len(got) != 1 || got[20] != 5 {
					t.Fatalf("key %d: slots %v, want only 20:5", k, got)
				}
			}
		}},
		{"a read of an unknown key creates nothing", func(t *testing.T, newStore func(testing.TB) SlotStore, prefix string) {
			s := newStore(t)
			steps := []Step{{Key: prefix + "nothing", Oldest: 1, TTL: time.Minute}}
			for i := 0; i < 2; i++ {
				r := syncSteps(t, s, steps)[0]
				if len(r.Slots) != 0 || r.Demand != 0 {
					t.Fatalf("read %d: %+v, want empty", i, r)
				}
			}
		}},
		{"the expiry is re-armed by every step", func(t *testing.T, newStore func(testing.TB) SlotStore, prefix string) {
			s := newStore(t)
			key := prefix + "ttl"
			syncSteps(t, s, []Step{{Key: key, Oldest: 0, TTL: time.Hour, Adds: [2]SlotCount{{Slot: 1, Count: 1}}}})
			// Each step, a read too, sets the expiry to its own TTL.
			for _, ttl := range []time.Duration{10 * time.Minute, 2 * time.Hour, 5 * time.Minute} {
				if r := syncSteps(t, s, []Step{{Key: key, Oldest: 0, TTL: ttl}})[0]; slotMap(r)[1] != 1 {
					t.Fatalf("read: %+v, want the slot kept", r)
				}
				if got := expiresIn(t, s, key); got > ttl || got < ttl-time.Minute {
					t.Fatalf("after a step with TTL %v the key expires in %v", ttl, got)
				}
			}
			// Past its expiry the key is gone: a read finds nothing.
			syncSteps(t, s, []Step{{Key: key, Oldest: 0, TTL: 20 * time.Millisecond}})
			// (Redis answers 0 for a key in the millisecond it expires, still
			// there: a read in that millisecond would find it.)
			wait.Until(t, 5*time.Second, "the key's expiry", func() bool { return expiresIn(t, s, key) < 0 })
			if r := syncSteps(t, s, []Step{{Key: key, Oldest: 0, TTL: time.Minute}})[0]; len(r.Slots) != 0 {
				t.Fatalf("after the expiry: %+v, want nothing", r)
			}
		}},
		{"instances add up", func(t *testing.T, newStore func(testing.TB) SlotStore, prefix string) {
			a, b := newStore(t), newStore(t)
			mk := func(n int64) []Step {
				var steps []Step
				for k := 0; k < keys; k++ {
					steps = append(steps, Step{Key: prefix + strconv.Itoa(k), Oldest: 0, TTL: time.Minute, Demand: n,
						Adds: [2]SlotCount{{Slot: 5, Count: n}}})
				}
				return steps
			}
			syncSteps(t, a, mk(2))
			for k, r := range syncSteps(t, b, mk(3)) {
				if slotMap(r)[5] != 5 || r.Demand != 5 {
					t.Fatalf("key %d: %+v, want 5 from both instances", k, r)
				}
			}
		}},
		{"reservations stay within the limit", func(t *testing.T, newStore func(testing.TB) SlotStore, prefix string) {
			a, b := newStore(t), newStore(t)
			mk := func(reserve, add int64) []Step {
				var steps []Step
				for k := 0; k < keys; k++ {
					steps = append(steps, Step{Key: prefix + strconv.Itoa(k), Oldest: 0, TTL: time.Minute,
						Adds: [2]SlotCount{{Slot: 9, Count: add}}, Reserve: reserve, Limit: 3})
				}
				return steps
			}
			// One admit, then 1 of 1 and 1 of 5 asked: the third is all
			// the limit of 3 leaves; then nothing is left.
			for i, want := range []struct{ reserve, add, got, slot int64 }{{1, 1, 1, 2}, {5, 0, 1, 3}, {1, 0, 0, 3}} {
				s := a
				if i%2 == 1 {
					s = b
				}
				for k, r := range syncSteps(t, s, mk(want.reserve, want.add)) {
					if r.Reserved != want.got || slotMap(r)[9] != want.slot {
						t.Fatalf("step %d, key %d: reserved %d slots %v, want %d reserved and slot 9 at %d", i, k, r.Reserved, slotMap(r), want.got, want.slot)
					}
				}
			}
		}},
	}
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			newStore := sc.setup(t)
			for i, c := range cases {
				t.Run(c.name, func(t *testing.T) {
					c.run(t, newStore, "conf"+strconv.Itoa(i)+":{k")
				})
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
	var steps []Step
	for k := 0; k < 50; k++ {
		steps = append(steps, Step{Key: z.storeKey(hashOf(strconv.Itoa(k))), Oldest: 0, TTL: time.Minute,
			Adds: [2]SlotCount{{Slot: 1, Count: 1}}})
	}
	syncSteps(t, s, steps)
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
		return k.expires.Sub(s.now())
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

// TestHeartbeatConformance: every store keeps the fleet's membership and hot
// keys alike. A record outlives its instance by the longest Keep asked for,
// with when it joined and when it last learned the fleet; the founding time
// stays; a hot key keeps when it became hot while it is announced again, and
// is gone once its announcements stop; a member's floor promise is kept when
// it sends none, and shown only once it is gone.
func TestHeartbeatConformance(t *testing.T) {
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			s := sc.setup(t)(t)
			ctx := context.Background()
			const members, hot = "hb:members:{fleet}", "hb:hot:{fleet}"
			beat := func(hb Heartbeat) Fleet {
				t.Helper()
				f, err := s.Heartbeat(ctx, members, hot, hb)
				if err != nil {
					t.Fatal(err)
				}
				return f
			}
			const t0 = int64(1_800_000_000_000) // Unix ms
			keep := 10 * time.Second
			promise := []byte{3, 0, 255, 0, 0, 7}
			f := beat(Heartbeat{Member: 1 << 52, Now: t0, TTL: 2 * time.Second, Joined: t0, Seen: t0, Keep: keep,
				Hot: []HotKey{{Key: "p:rl:{z:a}:500x20", Until: t0 + 2000, Room: 7}}, Promise: promise})
			if r := f.Members; !f.Fresh || f.Founded != t0 || len(r) != 1 || r[0].Member != 1<<52 || r[0].Joined != t0 || r[0].Until != t0+2000 || r[0].Seen != t0 || r[0].Promise != nil {
				t.Fatalf("first heartbeat: %+v", f)
			}
			if len(f.Hot) != 1 || f.Hot[0] != (HotKey{Key: "p:rl:{z:a}:500x20", Until: t0 + 2000, Room: 7, At: t0}) {
				t.Fatalf("hot keys: %+v", f.Hot)
			}
			// A second instance; the first leaves (TTL 0) having last seen
			// the fleet at t0.
			f = beat(Heartbeat{Member: 2, Now: t0 + 500, TTL: 2 * time.Second, Joined: t0 + 500, Seen: t0 + 500, Keep: time.Second,
				Hot: []HotKey{{Key: "p:rl:{z:a}:500x20", Until: t0 + 2500, Room: -3}}})
			if f.Fresh || f.Founded != t0 || len(f.Members) != 2 {
				t.Fatalf("second instance: %+v", f)
			}
			if len(f.Hot) != 1 || f.Hot[0].At != t0 || f.Hot[0].Room != -3 || f.Hot[0].Until != t0+2500 {
				t.Fatalf("announced again: %+v, want it hot since t0", f.Hot)
			}
			beat(Heartbeat{Member: 1 << 52, Now: t0 + 600, Joined: t0, Seen: t0, Keep: keep})
			// Past the hot key's last announcement, and within the longest
			// keep of the first instance's end.
			f = beat(Heartbeat{Member: 2, Now: t0 + 9000, TTL: 2 * time.Second, Joined: t0 + 500, Seen: t0 + 9000, Keep: time.Second})
			if len(f.Hot) != 0 {
				t.Fatalf("hot keys after their last announcement lapsed: %+v", f.Hot)
			}
			var gone *MemberRecord
			for i := range f.Members {
				if f.Members[i].Member == 1<<52 {
					gone = &f.Members[i]
				}
			}
			if len(f.Members) != 2 || gone == nil || gone.Until != t0+600 || gone.Seen != t0 || !bytes.Equal(gone.Promise, promise) {
				t.Fatalf("the record of an instance that left: %+v", f.Members)
			}
			// A gone member's promise the heartbeat holds is not sent again,
			// unless its record changed since.
			goneOf := func(f Fleet) MemberRecord {
				for _, r := range f.Members {
					if r.Member == 1<<52 {
						return r
					}
				}
				t.Fatalf("no record of the instance that left: %+v", f.Members)
				return MemberRecord{}
			}
			f = beat(Heartbeat{Member: 2, Now: t0 + 9500, TTL: 2 * time.Second, Joined: t0 + 500, Seen: t0 + 9500, Keep: time.Second,
				Known: []KnownPromise{{Member: 1 << 52, Until: t0 + 600}, {Member: 77, Until: t0}}})
			if r := goneOf(f); !r.PromiseKnown || r.Promise != nil || r.Until != t0+600 {
				t.Fatalf("a promise the heartbeat holds: %+v, want it named known and not sent", r)
			}
			f = beat(Heartbeat{Member: 2, Now: t0 + 9600, TTL: 2 * time.Second, Joined: t0 + 500, Seen: t0 + 9600, Keep: time.Second,
				Known: []KnownPromise{{Member: 1 << 52, Until: t0 + 500}}})
			if r := goneOf(f); r.PromiseKnown || !bytes.Equal(r.Promise, promise) {
				t.Fatalf("a promise the heartbeat holds of another record: %+v, want it sent", r)
			}
			f = beat(Heartbeat{Member: 2, Now: t0 + 10_700, TTL: 2 * time.Second, Joined: t0 + 500, Seen: t0 + 10_700, Keep: time.Second})
			if len(f.Members) != 1 || f.Members[0].Member != 2 {
				t.Fatalf("past the longest keep: %+v, want only the live instance", f.Members)
			}
		})
	}
}
