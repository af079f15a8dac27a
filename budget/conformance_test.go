package budget

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// storeCase sets up one kind of store for a test run; the setup's result
// builds a Store per case (cases keep apart by key prefix).
type storeCase struct {
	name  string
	setup func(t *testing.T) func(t *testing.T) Store
}

func storeCases() []storeCase {
	return []storeCase{
		{"memory", func(*testing.T) func(*testing.T) Store {
			return func(*testing.T) Store { return NewMemoryStore() }
		}},
		{"redis", func(t *testing.T) func(*testing.T) Store {
			srv := redistest.Start(t)
			return func(t *testing.T) Store { return NewRedisStore(srv.Client(t)) }
		}},
		{"redis-cluster", func(t *testing.T) func(*testing.T) Store {
			c := redistest.StartCluster(t)
			return func(t *testing.T) Store { return NewRedisStore(c.Client(t)) }
		}},
		{"redis-sentinel", func(t *testing.T) func(*testing.T) Store {
			s := redistest.StartSentinel(t, 1)
			return func(t *testing.T) Store { return NewRedisStore(s.Client(t)) }
		}},
	}
}

// recordOf names a record owned by "test" in the owners' set of its prefix.
func recordOf(key string) Record {
	prefix, _, _ := strings.Cut(key, ":res:")
	return Record{Key: key, Owners: prefix + ":owners", Owner: "test"}
}

func tokenBudget(name string, scope Scope, limit int64) Budget {
	return Budget{Name: name, Scope: scope, Unit: Tokens, Limit: limit, Window: time.Hour}
}

// TestStoreConformance runs the same cases against every Store.
func TestStoreConformance(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T, s Store)
	}{
		{"learning merges as a union of evidence", func(t *testing.T, s Store) {
			e := NewEngine(s, "learn")
			ctx := context.Background()
			a := Learned{Flags: LearnedProven, Scale: 1300, LeaseSize: 900, ProxyAnswers: 4, ProxyRatio: 1200}
			b := Learned{Flags: LearnedTokensRevoked, Scale: 1100, Density: 300, TokensLeaseSize: 500, ProxyDensity: 250}
			if got, err := e.MergeLearned(ctx, "claude-x", a); err != nil || got != a {
				t.Fatalf("the first merge: %+v %v, want %+v", got, err, a)
			}
			want := a.Merge(b)
			if want.Flags != LearnedProven|LearnedTokensRevoked || want.Scale != 1300 || want.Density != 300 {
				t.Fatalf("Merge: %+v", want)
			}
			for _, l := range []Learned{b, a, {}} { // in any order, however often
				if got, err := e.MergeLearned(ctx, "claude-x", l); err != nil || got != want {
					t.Fatalf("merged %+v: %+v %v, want %+v", l, got, err, want)
				}
			}
			if got, _ := e.MergeLearned(ctx, "another-model", Learned{}); got != (Learned{}) {
				t.Fatalf("another model read %+v, want nothing learned", got)
			}
		}},
		{"a silent owner's open reservations are settled to their grants", func(t *testing.T, s Store) {
			ctx := context.Background()
			const owners, counter = "c20:bg:{b}:owners", "c20:bg:{b}:x"
			a := func(id string) Record { return Record{Key: "c20:bg:{b}:res:" + id, Owners: owners, Owner: "a"} }
			reserve := func(id string, n int64) {
				t.Helper()
				if res, err := s.Reserve(ctx, a(id), time.Minute, []Charge{{Key: counter, Amount: n, Limit: 10000, TTL: time.Hour}}); err != nil || !res.Admitted {
					t.Fatalf("reserve %s: %+v %v", id, res, err)
				}
			}
			reserve("granted", 1000)
			reserve("whole", 500)
			reserve("settled", 200)
			// Grant 2 returns 600 of the 1000; grant 1, written after it, is stale.
			for _, g := range []Grant{{Record: a("granted").Key, Seq: 2, Returns: []int64{600}}, {Record: a("granted").Key, Seq: 1, Returns: []int64{900}}} {
				if gone, err := s.Grant(ctx, owners, "a", []Grant{g}); err != nil || gone[0] {
					t.Fatalf("grant %d: %v %v", g.Seq, gone, err)
				}
			}
			if ok, err := s.Settle(ctx, a("settled"), time.Minute, []Adjustment{{Key: counter, Amount: 150, TTL: time.Hour}}); err != nil || !ok {
				t.Fatalf("settle: %v %v", ok, err)
			}
			used := func() int64 {
				t.Helper()
				v, err := s.Get(ctx, []string{counter})
				if err != nil {
					t.Fatal(err)
				}
				return v[0]
			}
			if got := used(); got != 1650 {
				t.Fatalf("before any sweep: %d, want 1650", got)
			}
			if n, err := s.Sweep(ctx, owners, "b", time.Hour, 10); err != nil || n != 0 {
				t.Fatalf("an owner that spoke within the lapse was swept: %d %v", n, err)
			}
			time.Sleep(80 * time.Millisecond)
			if n, err := s.Sweep(ctx, owners, "a", 50*time.Millisecond, 10); err != nil || n != 0 {
				t.Fatalf("the sweeper's own reservations were swept: %d %v", n, err)
			}
			n1, err := s.Sweep(ctx, owners, "b", 50*time.Millisecond, 1)
			if err != nil || n1 != 1 {
				t.Fatalf("a sweep of at most 1: %d %v", n1, err)
			}
			if n2, err := s.Sweep(ctx, owners, "b", 50*time.Millisecond, 10); err != nil || n2 != 1 {
				t.Fatalf("the next sweep: %d %v, want the other open reservation", n2, err)
			}
			// The granted one returns 600; the one never granted keeps its hold.
			if got := used(); got != 1050 {
				t.Fatalf("after the sweep: %d, want 1050 (1000-600 + 500 + 150)", got)
			}
			if ok, err := s.Settle(ctx, a("granted"), time.Minute, []Adjustment{{Key: counter, Amount: 10, TTL: time.Hour}}); err != nil || ok {
				t.Fatalf("the owner's settle after the sweep applied: %v %v", ok, err)
			}
			if gone, err := s.Grant(ctx, owners, "a", []Grant{{Record: a("whole").Key, Seq: 1, Returns: []int64{100}}}); err != nil || !gone[0] {
				t.Fatalf("a grant to a swept reservation: %v %v, want gone", gone, err)
			}
			if got := used(); got != 1050 {
				t.Fatalf("after the late settle and grant: %d, want 1050", got)
			}
			reserve("after", 50) // the owner speaks again: not silent
			if n, err := s.Sweep(ctx, owners, "b", 2*time.Second, 10); err != nil || n != 0 {
				t.Fatalf("an owner that spoke again was swept: %d %v", n, err)
			}
		}},
		{"reserve within limit charges", func(t *testing.T, s Store) {
			e := NewEngine(s, "c1")
			b := []Budget{tokenBudget("daily", PerKey, 100)}
			r, d, err := e.Reserve(context.Background(), b, Dims{Principal: "alice"}, Spend{Tokens: 60})
			if err != nil || d != nil || r == nil {
				t.Fatalf("reserve: %v %v", d, err)
			}
			if r.Holds[0].Used != 60 {
				t.Fatalf("used after = %d, want 60", r.Holds[0].Used)
			}
			assertUsed(t, e, b, Dims{Principal: "alice"}, 60)
			assertUsed(t, e, b, Dims{Principal: "bob"}, 0)
		}},
		{"reserve over limit charges nothing", func(t *testing.T, s Store) {
			e := NewEngine(s, "c2")
			b := []Budget{tokenBudget("daily", Global, 100)}
			mustReserve(t, e, b, Dims{}, 60)
			_, d, err := e.Reserve(context.Background(), b, Dims{}, Spend{Tokens: 41})
			if err != nil || d == nil || d.Budget.Name != "daily" || d.Used != 60 || d.Amount != 41 {
				t.Fatalf("want a denial by daily with 60 used: %+v %v", d, err)
			}
			assertUsed(t, e, b, Dims{}, 60)
			mustReserve(t, e, b, Dims{}, 40) // exactly up to the limit fits
			assertUsed(t, e, b, Dims{}, 100)
		}},
		{"multi-budget all or nothing", func(t *testing.T, s Store) {
			e := NewEngine(s, "c3")
			b := []Budget{tokenBudget("a", Global, 1000), tokenBudget("b", PerTeam, 50)}
			dims := Dims{Team: "red"}
			_, d, err := e.Reserve(context.Background(), b, dims, Spend{Tokens: 80})
			if err != nil || d == nil || d.Budget.Name != "b" {
				t.Fatalf("want a denial by b: %+v %v", d, err)
			}
			assertUsed(t, e, b[:1], dims, 0) // a fits, but is untouched
			mustReserve(t, e, b, dims, 50)
			used, _ := e.Used(context.Background(), b, dims)
			if used[0] != 50 || used[1] != 50 {
				t.Fatalf("both budgets charged: %v, want [50 50]", used)
			}
		}},
		{"settle applies once", func(t *testing.T, s Store) {
			e := NewEngine(s, "c4")
			b := []Budget{tokenBudget("daily", Global, 1000)}
			r := mustReserve(t, e, b, Dims{}, 300)
			for i := 0; i < 3; i++ {
				if err := e.Settle(context.Background(), r, Spend{Tokens: 120}); err != nil {
					t.Fatal(err)
				}
			}
			assertUsed(t, e, b, Dims{}, 120)
		}},
		{"settle above the estimate charges the difference", func(t *testing.T, s Store) {
			e := NewEngine(s, "c5")
			b := []Budget{tokenBudget("daily", Global, 1000)}
			r := mustReserve(t, e, b, Dims{}, 100)
			if err := e.Settle(context.Background(), r, Spend{Tokens: 150}); err != nil {
				t.Fatal(err)
			}
			assertUsed(t, e, b, Dims{}, 150)
		}},
		{"release returns everything", func(t *testing.T, s Store) {
			e := NewEngine(s, "c6")
			b := []Budget{tokenBudget("daily", PerModel, 1000)}
			dims := Dims{Model: "gpt-4o"}
			r := mustReserve(t, e, b, dims, 400)
			if err := e.Release(context.Background(), r); err != nil {
				t.Fatal(err)
			}
			assertUsed(t, e, b, dims, 0)
		}},
		{"settle floors at zero", func(t *testing.T, s Store) {
			ctx := context.Background()
			if _, err := s.Reserve(ctx, recordOf("c7:bg:{b}:res:1"), time.Minute, []Charge{{Key: "c7:bg:{b}:x", Amount: 10, Limit: 100, TTL: time.Hour}}); err != nil {
				t.Fatal(err)
			}
			// A reset while the reservation is in flight: its settle moves the
			// counter from 0 by 3 - 10, and floors there.
			if err := s.Reset(ctx, []string{"c7:bg:{b}:x"}); err != nil {
				t.Fatal(err)
			}
			adj := []Adjustment{{Key: "c7:bg:{b}:x", Amount: 3, TTL: time.Hour}}
			if ok, err := s.Settle(ctx, recordOf("c7:bg:{b}:res:1"), time.Minute, adj); err != nil || !ok {
				t.Fatalf("settle: %v %v", ok, err)
			}
			got, _ := s.Get(ctx, []string{"c7:bg:{b}:x"})
			if got[0] != 0 {
				t.Fatalf("counter = %d, want 0", got[0])
			}
			if ok, _ := s.Settle(ctx, recordOf("c7:bg:{b}:res:1"), time.Minute, adj); ok {
				t.Fatal("a repeated settle must not apply")
			}
		}},
		{"an extension charges within the limits, once, and the settle moves from it", func(t *testing.T, s Store) {
			e := NewEngine(s, "c12")
			ctx := context.Background()
			b := []Budget{tokenBudget("a", Global, 100), tokenBudget("b", PerKey, 1000)}
			dims := Dims{Principal: "alice"}
			r := mustReserve(t, e, b, dims, 30)
			if d, err := e.Extend(ctx, r, Spend{Tokens: 50}); err != nil || d != nil {
				t.Fatalf("extend within the limit: %+v %v", d, err)
			}
			if r.Holds[0].Amount != 80 || r.Holds[0].Used != 80 {
				t.Fatalf("hold after the extension: %+v, want 80 held and used", r.Holds[0])
			}
			// The same extension again, as after a lost reply: admitted, not charged twice.
			if res, err := s.Extend(ctx, e.recordKey(r), 1, []Charge{{Key: r.Holds[0].Key, Amount: 50, Limit: 100}, {Key: r.Holds[1].Key, Amount: 50, Limit: 1000}}); err != nil || !res.Admitted {
				t.Fatalf("a repeated extension: %+v %v, want admitted", res, err)
			}
			assertUsed(t, e, b, dims, 80)
			// Past one budget's limit: neither budget is charged.
			d, err := e.Extend(ctx, r, Spend{Tokens: 21})
			if err != nil || d == nil || d.Budget.Name != "a" || d.Used != 80 {
				t.Fatalf("an extension past a's limit: %+v %v, want a denial by a at 80", d, err)
			}
			used, _ := e.Used(ctx, b, dims)
			if used[0] != 80 || used[1] != 80 {
				t.Fatalf("after a denied extension: %v, want [80 80]", used)
			}
			if d, err := e.Extend(ctx, r, Spend{Tokens: 20}); err != nil || d != nil {
				t.Fatalf("an extension up to the limit: %+v %v", d, err)
			}
			if err := e.Settle(ctx, r, Spend{Tokens: 45}); err != nil {
				t.Fatal(err)
			}
			used, _ = e.Used(ctx, b, dims)
			if used[0] != 45 || used[1] != 45 {
				t.Fatalf("settled at 45 after extensions: %v", used)
			}
			// A settled reservation extends no more.
			if d, err := e.Extend(ctx, r, Spend{Tokens: 1}); err != nil || d == nil {
				t.Fatalf("an extension after the settle: %+v %v, want a denial", d, err)
			}
			assertUsed(t, e, b[:1], dims, 45)
		}},
		{"a settle after an extension whose reply was lost charges what was used", func(t *testing.T, s Store) {
			e := NewEngine(s, "c13")
			ctx := context.Background()
			b := []Budget{tokenBudget("a", PerKey, 1000)}
			for _, keep := range []bool{false, true} {
				dims := Dims{Principal: fmt.Sprint(keep)}
				r := mustReserve(t, e, b, dims, 30)
				// The store applied extension 1; the engine never heard.
				if res, err := s.Extend(ctx, e.recordKey(r), 1, []Charge{{Key: r.Holds[0].Key, Amount: 200, Limit: 1000, TTL: time.Hour}}); err != nil || !res.Admitted {
					t.Fatalf("extend: %+v %v", res, err)
				}
				assertUsed(t, e, b, dims, 230)
				if keep {
					if err := e.Keep(ctx, r); err != nil {
						t.Fatal(err)
					}
					assertUsed(t, e, b, dims, 230) // kept: what the store holds
					continue
				}
				if err := e.Settle(ctx, r, Spend{Tokens: 40}); err != nil {
					t.Fatal(err)
				}
				assertUsed(t, e, b, dims, 40)
			}
		}},
		{"extensions apply in order", func(t *testing.T, s Store) {
			ctx := context.Background()
			record, counter := "c14:bg:{b}:res:1", "c14:bg:{b}:x"
			if _, err := s.Reserve(ctx, recordOf(record), time.Minute, []Charge{{Key: counter, Amount: 10, Limit: 100, TTL: time.Hour}}); err != nil {
				t.Fatal(err)
			}
			res, err := s.Extend(ctx, record, 2, []Charge{{Key: counter, Amount: 10, Limit: 100, TTL: time.Hour}})
			if err != nil || res.Admitted {
				t.Fatalf("extension 2 before 1: %+v %v, want nothing applied", res, err)
			}
			if got, _ := s.Get(ctx, []string{counter}); got[0] != 10 {
				t.Fatalf("counter = %d, want 10", got[0])
			}
			if res, err := s.Extend(ctx, "c14:bg:{b}:res:none", 1, []Charge{{Key: counter, Amount: 10, Limit: 100, TTL: time.Hour}}); err != nil || !res.Gone {
				t.Fatalf("an extension of no reservation: %+v %v, want gone", res, err)
			}
		}},
		{"a release leaves no key behind", func(t *testing.T, s Store) {
			ctx := context.Background()
			record, counter := "c10:bg:{b}:res:1", "c10:bg:{b}:stranger"
			charges := []Charge{{Key: counter, Amount: 30, Limit: 100, TTL: time.Hour}}
			if res, err := s.Reserve(ctx, recordOf(record), time.Minute, charges); err != nil || !res.Admitted {
				t.Fatalf("reserve: %+v %v", res, err)
			}
			if !stored(t, s, record) || !stored(t, s, counter) {
				t.Fatal("a reservation keeps its record and its counter")
			}
			if ok, err := s.Settle(ctx, recordOf(record), time.Minute, []Adjustment{{Key: counter, Amount: 0, TTL: time.Hour}}); err != nil || !ok {
				t.Fatalf("release: %v %v", ok, err)
			}
			if stored(t, s, record) || stored(t, s, counter) {
				t.Fatalf("after the release: record kept %v, counter kept %v; want neither", stored(t, s, record), stored(t, s, counter))
			}
			// The record is gone, not tombstoned: the same id reserves again.
			if res, err := s.Reserve(ctx, recordOf(record), time.Minute, charges); err != nil || !res.Admitted {
				t.Fatalf("a reserve of the same id after the settle: %+v %v, want admitted", res, err)
			}
		}},
		{"a charge of 0 writes no counter", func(t *testing.T, s Store) {
			ctx := context.Background()
			if res, err := s.Reserve(ctx, recordOf("c11:bg:{b}:res:1"), time.Minute, []Charge{{Key: "c11:bg:{b}:free", Amount: 0, Limit: 100, TTL: time.Hour}}); err != nil || !res.Admitted {
				t.Fatalf("reserve: %+v %v", res, err)
			}
			if stored(t, s, "c11:bg:{b}:free") {
				t.Fatal("a charge of 0 wrote a counter")
			}
		}},
		{"a release that arrives before its reserve cancels it", func(t *testing.T, s Store) {
			ctx := context.Background()
			charges := []Charge{{Key: "c9:bg:{b}:x", Amount: 30, Limit: 100, TTL: time.Hour}}
			release := []Adjustment{{Key: "c9:bg:{b}:x", Amount: 0, TTL: time.Hour}}
			if ok, err := s.Settle(ctx, recordOf("c9:bg:{b}:res:late"), time.Minute, release); err != nil || ok {
				t.Fatalf("a release of a reservation that never ran: applied %v, %v; want nothing applied", ok, err)
			}
			res, err := s.Reserve(ctx, recordOf("c9:bg:{b}:res:late"), time.Minute, charges)
			if err != nil || !res.Cancelled || res.Admitted {
				t.Fatalf("the late reserve: %+v, %v; want cancelled", res, err)
			}
			if got, _ := s.Get(ctx, []string{"c9:bg:{b}:x"}); got[0] != 0 {
				t.Fatalf("counter = %d after a cancelled reserve, want 0", got[0])
			}
			// The usual order: reserve, then release, returns the charge once.
			if res, err := s.Reserve(ctx, recordOf("c9:bg:{b}:res:on-time"), time.Minute, charges); err != nil || !res.Admitted {
				t.Fatalf("reserve: %+v %v", res, err)
			}
			for i := 0; i < 2; i++ {
				if _, err := s.Settle(ctx, recordOf("c9:bg:{b}:res:on-time"), time.Minute, release); err != nil {
					t.Fatal(err)
				}
			}
			if got, _ := s.Get(ctx, []string{"c9:bg:{b}:x"}); got[0] != 0 {
				t.Fatalf("counter = %d after reserve and two releases, want 0", got[0])
			}
		}},
		{"reset zeroes only the counters named", func(t *testing.T, s Store) {
			ctx := context.Background()
			e := NewEngine(s, "c10")
			b := tokenBudget("daily", PerKey, 100)
			alice, bob := Dims{Principal: "alice"}, Dims{Principal: "bob"}
			mustReserve(t, e, []Budget{b}, alice, 100)
			mustReserve(t, e, []Budget{b}, bob, 30)
			if _, d, err := e.Reserve(ctx, []Budget{b}, alice, Spend{Tokens: 1}); err != nil || d == nil {
				t.Fatalf("alice is at her limit: denial %+v, error %v", d, err)
			}
			st, err := e.Reset(ctx, &b, ScopeID(&b, alice))
			if err != nil {
				t.Fatal(err)
			}
			if now := time.Now(); now.Before(st.Start) || !now.Before(st.End) || st.End.Sub(st.Start) != b.Window {
				t.Fatalf("reset window [%v, %v) does not hold now", st.Start, st.End)
			}
			if got, err := e.Standing(ctx, &b, ScopeID(&b, alice)); err != nil || got.Used != 0 || got.Start != st.Start {
				t.Fatalf("alice after reset: %+v %v, want 0 used in the same window", got, err)
			}
			assertUsed(t, e, []Budget{b}, bob, 30)
			mustReserve(t, e, []Budget{b}, alice, 100) // the whole limit fits again
			// A missing counter resets to 0 too, and an empty call is fine.
			if err := s.Reset(ctx, []string{"c10:bg:{b}:nothing", "c10:bg:{b}:none"}); err != nil {
				t.Fatal(err)
			}
			if err := s.Reset(ctx, nil); err != nil {
				t.Fatal(err)
			}
		}},
		{"standing reads what was charged", func(t *testing.T, s Store) {
			ctx := context.Background()
			e := NewEngine(s, "c11")
			b := tokenBudget("daily", PerTeam, 1000)
			r := mustReserve(t, e, []Budget{b}, Dims{Team: "red"}, 300)
			if err := e.Settle(ctx, r, Spend{Tokens: 120}); err != nil {
				t.Fatal(err)
			}
			id, err := HashedScopeID(PerTeam, keyhash.Of("red").String())
			if err != nil || id != ScopeID(&b, Dims{Team: "red"}) {
				t.Fatalf("the hashed scope id %q (%v) must name the same counter as ScopeID %q", id, err, ScopeID(&b, Dims{Team: "red"}))
			}
			if st, err := e.Standing(ctx, &b, id); err != nil || st.Used != 120 {
				t.Fatalf("standing %+v %v, want 120 used", st, err)
			}
		}},
		{"a limit set at run time applies to its scope value at the next reserve, on every engine", func(t *testing.T, s Store) {
			ctx := context.Background()
			e, other := NewEngine(s, "c15"), NewEngine(s, "c15") // two instances of a fleet
			b := []Budget{tokenBudget("k", PerKey, 100), tokenBudget("t", PerTeam, 100), tokenBudget("m", PerModel, 100)}
			dims := Dims{Principal: "alice", Team: "red", Model: "gpt-4o"}
			for i, limit := range []int64{300, 50, 200} {
				if err := e.SetLimit(ctx, &b[i], ScopeID(&b[i], dims), limit); err != nil {
					t.Fatal(err)
				}
			}
			_, d, err := other.Reserve(ctx, b, dims, Spend{Tokens: 60})
			if err != nil || d == nil || d.Budget.Name != "t" || d.Limit != 50 {
				t.Fatalf("60 against team red's 50: %+v %v, want a denial by t at its limit 50", d, err)
			}
			r := mustReserve(t, other, b, dims, 50)
			for i, want := range []int64{300, 50, 200} {
				if r.Holds[i].Limit != want {
					t.Fatalf("hold %s: limit %d, want %d", b[i].Name, r.Holds[i].Limit, want)
				}
			}
			// An extension keeps the key's own limit, 300, not the budget's 100.
			rk := mustReserve(t, other, b[:1], dims, 50)
			if d, err := other.Extend(ctx, rk, Spend{Tokens: 200}); err != nil || d != nil {
				t.Fatalf("alice's key to 300 of her 300: %+v %v, want admitted", d, err)
			}
			// Another value of the same scopes keeps the budget's limit.
			if _, d, _ := other.Reserve(ctx, b, Dims{Principal: "bob", Team: "blue", Model: "o3"}, Spend{Tokens: 101}); d == nil || d.Limit != 100 {
				t.Fatalf("bob, blue, o3 at 101: %+v, want a denial at the budget's 100", d)
			}
			if n, from, err := other.Limit(ctx, &b[0], ScopeID(&b[0], dims)); err != nil || n != 300 || from != LimitFromAdmin {
				t.Fatalf("alice's limit: %d from %q (%v), want 300 from admin", n, from, err)
			}
			// Cleared, the team's limit is the budget's again.
			if err := e.SetLimit(ctx, &b[1], ScopeID(&b[1], dims), 0); err != nil {
				t.Fatal(err)
			}
			if n, from, err := other.Limit(ctx, &b[1], ScopeID(&b[1], dims)); err != nil || n != 100 || from != LimitFromBudget {
				t.Fatalf("red's limit after the clear: %d from %q (%v), want 100 from budget", n, from, err)
			}
			r = mustReserve(t, other, b[1:2], dims, 50) // red: 100 of 100
			if r.Holds[0].Limit != 100 {
				t.Fatalf("red's hold after the clear: limit %d, want 100", r.Holds[0].Limit)
			}
			if err := e.SetLimit(ctx, &Budget{Name: "g", Scope: Global, Limit: 1, Window: time.Hour}, "global", 5); err == nil {
				t.Fatal("a global budget's limit was set at run time")
			}
		}},
		{"a fixed limit of the config holds for its value, and one set at run time wins over it", func(t *testing.T, s Store) {
			ctx := context.Background()
			e := NewEngine(s, "c16")
			research := Dims{Team: "research"}
			b := tokenBudget("t", PerTeam, 100)
			b.Fixed = map[string]int64{ScopeID(&b, research): 2000}
			if r := mustReserve(t, e, []Budget{b}, research, 1500); r.Holds[0].Limit != 2000 {
				t.Fatalf("research's hold: limit %d, want its fixed 2000", r.Holds[0].Limit)
			}
			if _, d, _ := e.Reserve(ctx, []Budget{b}, Dims{Team: "ops"}, Spend{Tokens: 101}); d == nil {
				t.Fatal("ops has the budget's 100: 101 must be denied")
			}
			if n, from, _ := e.Limit(ctx, &b, ScopeID(&b, research)); n != 2000 || from != LimitFromConfig {
				t.Fatalf("research's limit: %d from %q, want 2000 from config", n, from)
			}
			if err := e.SetLimit(ctx, &b, ScopeID(&b, research), 1500); err != nil {
				t.Fatal(err)
			}
			if _, d, _ := e.Reserve(ctx, []Budget{b}, research, Spend{Tokens: 1}); d == nil || d.Limit != 1500 {
				t.Fatalf("research at 1500 of the 1500 set at run time: %+v, want a denial at 1500", d)
			}
		}},
		{"top is exact against a replay of the settles", func(t *testing.T, s Store) {
			ctx := context.Background()
			e := NewEngine(s, "c17")
			b := []Budget{tokenBudget("k", PerKey, 1<<40), tokenBudget("t", PerTeam, 1<<40), tokenBudget("g", Global, 1<<40)}
			want := [2]map[string]int64{{}, {}} // the replay: each value's settled total
			rng := rand.New(rand.NewPCG(17, 31))
			for i := range 600 {
				dims := Dims{Principal: fmt.Sprint("sk-", rng.IntN(60)), Team: fmt.Sprint("team-", rng.IntN(7))}
				r := mustReserve(t, e, b, dims, 500)
				var used int64
				var err error
				switch i % 10 {
				case 0: // released: an upstream's error
					err = e.Release(ctx, r)
				case 1: // kept: usage unknown
					used, err = 500, e.Keep(ctx, r)
				default:
					used = int64(1 + rng.IntN(499))
					err = e.Settle(ctx, r, Spend{Tokens: used})
				}
				if err != nil {
					t.Fatal(err)
				}
				want[0][ScopeID(&b[0], dims)] += used
				want[1][ScopeID(&b[1], dims)] += used
			}
			for i := range 2 {
				top, st, err := e.Top(ctx, &b[i], 20)
				if err != nil || !time.Now().Before(st.End) {
					t.Fatalf("top of %s: %v, window %+v", b[i].Name, err, st)
				}
				if exp := replayTop(want[i], 20); fmt.Sprint(top) != fmt.Sprint(exp) {
					t.Fatalf("top of %s:\n got %v\nwant %v", b[i].Name, top, exp)
				}
			}
			if _, _, err := e.Top(ctx, &b[2], 20); err == nil {
				t.Fatal("a global budget has no top")
			}
		}},
		{"a top set holds at most TopSize members", func(t *testing.T, s Store) {
			ctx := context.Background()
			e := NewEngine(s, "c18")
			b := []Budget{tokenBudget("k", PerKey, 1<<40)}
			want := map[string]int64{}
			for i := range TopSize + 50 {
				dims := Dims{Principal: fmt.Sprint("sk-", i)}
				// The late keys spend most: the first 50 are dropped.
				if err := e.Settle(ctx, mustReserve(t, e, b, dims, 10), Spend{Tokens: int64(i + 1)}); err != nil {
					t.Fatal(err)
				}
				want[ScopeID(&b[0], dims)] = int64(i + 1)
			}
			if n := topMembers(t, s, e.topKey(&b[0], time.Now())); n != TopSize {
				t.Fatalf("the top set holds %d members, want TopSize %d", n, TopSize)
			}
			top, _, err := e.Top(ctx, &b[0], MaxTop)
			if err != nil || fmt.Sprint(top) != fmt.Sprint(replayTop(want, MaxTop)) {
				t.Fatalf("top %d after %d spenders: %v %v", MaxTop, TopSize+50, top, err)
			}
		}},
		{"each alert is reached first by exactly one settle of the fleet", func(t *testing.T, s Store) {
			ctx := context.Background()
			engines := []*Engine{NewEngine(s, "c19"), NewEngine(s, "c19")} // two instances
			b := []Budget{tokenBudget("k", PerKey, 1000), tokenBudget("t", PerTeam, 1000), tokenBudget("g", Global, 1000)}
			for i := range b {
				b[i].AlertAt = []int{50, 80, 95}
			}
			dims := Dims{Principal: "alice", Team: "red"}
			var mu sync.Mutex
			seen := map[string]int{}
			var wg sync.WaitGroup
			for i := range 50 { // 50 × 20 = the whole 1000
				wg.Add(1)
				go func() {
					defer wg.Done()
					e := engines[i%2]
					r, d, err := e.Reserve(ctx, b, dims, Spend{Tokens: 20})
					if err != nil || d != nil {
						t.Errorf("reserve %d: %+v %v", i, d, err)
						return
					}
					if err := e.Settle(ctx, r, Spend{Tokens: 20}); err != nil {
						t.Error(err)
						return
					}
					mu.Lock()
					defer mu.Unlock()
					for _, c := range r.Crossings() {
						if c.Used < c.Limit*int64(c.Percent)/100 || c.Limit != 1000 || c.ScopeID != ScopeID(c.Budget, dims) {
							t.Errorf("crossing %+v: below its threshold, or not the scope value's", c)
						}
						seen[fmt.Sprint(c.Budget.Name, " ", c.Percent)]++
					}
				}()
			}
			wg.Wait()
			want := map[string]int{}
			for _, name := range []string{"k", "t", "g"} {
				for _, pct := range []int{50, 80, 95} {
					want[fmt.Sprint(name, " ", pct)] = 1
				}
			}
			if fmt.Sprint(seen) != fmt.Sprint(want) {
				t.Fatalf("crossings %v, want each budget's 50, 80 and 95 once", seen)
			}
			// Past every threshold, a settle in the same window reaches none.
			r := mustReserve(t, engines[0], b, dims, 0)
			if err := engines[0].Settle(ctx, r, Spend{}); err != nil || len(r.Crossings()) != 0 {
				t.Fatalf("a settle after the crossings: %v %v, want none", r.Crossings(), err)
			}
		}},
		{"a denied value is noted first once per window, fleet-wide; standings read counters and limits", func(t *testing.T, s Store) {
			ctx := context.Background()
			e, other := NewEngine(s, "c20"), NewEngine(s, "c20")
			b := tokenBudget("k", PerKey, 100)
			alice, bob := ScopeID(&b, Dims{Principal: "alice"}), ScopeID(&b, Dims{Principal: "bob"})
			for i, tt := range []struct {
				e     *Engine
				id    string
				first bool
			}{{e, alice, true}, {other, alice, false}, {e, alice, false}, {other, bob, true}} {
				if first, err := tt.e.NoteDenied(ctx, &b, tt.id); err != nil || first != tt.first {
					t.Fatalf("note %d: first %v (%v), want %v", i, first, err, tt.first)
				}
			}
			mustReserve(t, e, []Budget{b}, Dims{Principal: "bob"}, 40)
			if err := e.SetLimit(ctx, &b, bob, 500); err != nil {
				t.Fatal(err)
			}
			used, limits, err := other.Standings(ctx, &b, []string{alice, bob})
			if err != nil || fmt.Sprint(used, limits) != "[0 40] [100 500]" {
				t.Fatalf("standings %v %v (%v), want [0 40] [100 500]", used, limits, err)
			}
		}},
		{"usd budgets count micro-dollars", func(t *testing.T, s Store) {
			e := NewEngine(s, "c8")
			b := []Budget{{Name: "spend", Scope: Global, Unit: USD, Limit: USDToMicros(1), Window: time.Hour}, tokenBudget("tok", Global, 1<<40)}
			r, d, err := e.Reserve(context.Background(), b, Dims{}, Spend{Tokens: 5000, CostMicros: 700_000})
			if err != nil || d != nil {
				t.Fatal(d, err)
			}
			if r.Holds[0].Amount != 700_000 || r.Holds[1].Amount != 5000 {
				t.Fatalf("amounts %d, %d", r.Holds[0].Amount, r.Holds[1].Amount)
			}
			_, d, _ = e.Reserve(context.Background(), b, Dims{}, Spend{Tokens: 1, CostMicros: 300_001})
			if d == nil || d.Budget.Unit != USD {
				t.Fatal("the dollar budget must deny past $1")
			}
		}},
	}
	for _, sc := range storeCases() {
		t.Run(sc.name, func(t *testing.T) {
			newStore := sc.setup(t)
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) { c.run(t, newStore(t)) })
			}
		})
	}
}

func mustReserve(t *testing.T, e *Engine, b []Budget, dims Dims, tokens int64) *Reservation {
	t.Helper()
	r, d, err := e.Reserve(context.Background(), b, dims, Spend{Tokens: tokens})
	if err != nil || d != nil {
		t.Fatalf("reserve %d: denial %+v, error %v", tokens, d, err)
	}
	return r
}

func assertUsed(t *testing.T, e *Engine, b []Budget, dims Dims, want int64) {
	t.Helper()
	used, err := e.Used(context.Background(), b, dims)
	if err != nil {
		t.Fatal(err)
	}
	for i, u := range used {
		if u != want {
			t.Fatalf("budget %s: used %d, want %d", b[i].Name, u, want)
		}
	}
}

func TestRedisKeysHideThePrincipalAndExpire(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	e := NewEngine(NewRedisStore(c), "keys")
	b := []Budget{tokenBudget("daily", PerKey, 1000)}
	mustReserve(t, e, b, Dims{Principal: "Bearer sk-secret-123"}, 10)
	keys, err := c.Keys(context.Background(), "*").Result()
	if err != nil || len(keys) != 4 {
		t.Fatalf("keys %v %v, want the counter, the reservation's record, the owners and the owner's open set", keys, err)
	}
	for _, k := range keys {
		if strings.Contains(k, "sk-secret") {
			t.Fatalf("store key %q carries the principal", k)
		}
		ttl := c.PTTL(context.Background(), k).Val()
		if ttl <= time.Hour || ttl > recordTTL {
			t.Fatalf("TTL of %s = %v, want two windows (counter) or the record's %v", k, ttl, recordTTL)
		}
	}
}

func TestSettleFailureIsDrift(t *testing.T) {
	srv := redistest.Start(t)
	e := NewEngine(NewRedisStore(srv.Client(t)), "drift")
	b := []Budget{tokenBudget("daily", Global, 1000)}
	r := mustReserve(t, e, b, Dims{}, 100)
	srv.Stop()
	err := e.Settle(context.Background(), r, Spend{Tokens: 10})
	if !errors.Is(err, ErrDrift) {
		t.Fatalf("settle against a stopped Redis: %v, want ErrDrift", err)
	}
	if _, _, err := e.Reserve(context.Background(), b, Dims{}, Spend{Tokens: 1}); err == nil {
		t.Fatal("reserve against a stopped Redis must fail")
	}
}

// TestFleetNeverOvershoots runs 3 engines on one Redis with 300 concurrent
// reservations against one budget while a watcher reads the counter.
func TestFleetNeverOvershoots(t *testing.T) {
	srv := redistest.Start(t)
	const limit = 20_000
	b := []Budget{tokenBudget("shared", Global, limit)}
	// Clients that wait for their connections: 300 reserves at once dial
	// about 60, which a busy machine's redis-server accepts slower than
	// the test clients' 200 ms (made for outages) allow.
	client := func() *redis.Client {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr(), DialTimeout: 5 * time.Second})
		t.Cleanup(func() { c.Close() })
		return c
	}
	engines := []*Engine{
		NewEngine(NewRedisStore(client()), "fleet"),
		NewEngine(NewRedisStore(client()), "fleet"),
		NewEngine(NewRedisStore(client()), "fleet"),
	}
	watcher := engines[0]
	stop := make(chan struct{})
	var maxSeen atomic.Int64
	watchDone := make(chan struct{})
	go func() {
		defer close(watchDone)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if used, err := watcher.Used(context.Background(), b, Dims{}); err == nil && used[0] > maxSeen.Load() {
				maxSeen.Store(used[0])
			}
		}
	}()
	var wg sync.WaitGroup
	var admitted, actualSum atomic.Int64
	for i := 0; i < 300; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			e := engines[i%3]
			r, d, err := e.Reserve(context.Background(), b, Dims{}, Spend{Tokens: 200})
			if err != nil {
				t.Error(err)
				return
			}
			if d != nil {
				return
			}
			admitted.Add(1)
			actual := int64(50 + i%150) // always at most the reservation
			// Settles spread in time, not a wait for anything.
			time.Sleep(time.Duration(i%7) * time.Millisecond)
			if err := e.Settle(context.Background(), r, Spend{Tokens: actual}); err != nil {
				t.Error(err)
				return
			}
			actualSum.Add(actual)
		}(i)
	}
	wg.Wait()
	close(stop)
	<-watchDone
	if maxSeen.Load() > limit {
		t.Fatalf("counter reached %d, over the limit %d", maxSeen.Load(), limit)
	}
	used, err := watcher.Used(context.Background(), b, Dims{})
	if err != nil {
		t.Fatal(err)
	}
	if used[0] != actualSum.Load() {
		t.Fatalf("counter %d after all settles, want the sum of actual usage %d", used[0], actualSum.Load())
	}
	if admitted.Load() < limit/200 {
		t.Fatalf("admitted only %d reservations of 200 against %d", admitted.Load(), limit)
	}
	t.Logf("admitted %d of 300, max counter seen %d, final %d", admitted.Load(), maxSeen.Load(), used[0])
}

// stored reports whether s holds key at all (a counter at 0 reads 0 whether
// it is stored or not; a stranger's must not be).
func stored(t *testing.T, s Store, key string) bool {
	t.Helper()
	switch s := s.(type) {
	case *MemoryStore:
		s.mu.Lock()
		defer s.mu.Unlock()
		_, ok := s.get(key, s.now())
		return ok
	case *RedisStore:
		n, err := s.client.Exists(context.Background(), key).Result()
		if err != nil {
			t.Fatal(err)
		}
		return n == 1
	}
	t.Fatalf("stored: a store of type %T", s)
	return false
}

// replayTop is the top n of used, as Store.Top orders it.
func replayTop(used map[string]int64, n int) []TopEntry {
	out := make([]TopEntry, 0, len(used))
	for m, u := range used {
		if u > 0 {
			out = append(out, TopEntry{Member: m, Used: u})
		}
	}
	slices.SortFunc(out, func(x, y TopEntry) int { return cmp.Or(cmp.Compare(y.Used, x.Used), cmp.Compare(y.Member, x.Member)) })
	return out[:min(n, len(out))]
}

// topMembers is how many members the store keeps in the top set top.
func topMembers(t *testing.T, s Store, top string) int {
	t.Helper()
	switch s := s.(type) {
	case *MemoryStore:
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.tops[top].used)
	case *RedisStore:
		n, err := s.client.ZCard(context.Background(), top).Result()
		if err != nil {
			t.Fatal(err)
		}
		return int(n)
	}
	t.Fatalf("topMembers: a store of type %T", s)
	return 0
}

// Nothing the new keys hold names a principal: the limits table's fields,
// the top sets' members and the marks of thresholds and denied keys carry
// its hash, as the counters' keys do.
func TestRedisLimitsTopsAndMarksHideThePrincipal(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	ctx := context.Background()
	e := NewEngine(NewRedisStore(c), "hide")
	b := []Budget{tokenBudget("daily", PerKey, 1000)}
	b[0].AlertAt = []int{1}
	dims := Dims{Principal: "Bearer sk-secret-123"}
	id := ScopeID(&b[0], dims)
	if err := e.SetLimit(ctx, &b[0], id, 2000); err != nil {
		t.Fatal(err)
	}
	if err := e.Settle(ctx, mustReserve(t, e, b, dims, 50), Spend{Tokens: 40}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.NoteDenied(ctx, &b[0], id); err != nil {
		t.Fatal(err)
	}
	keys, err := c.Keys(ctx, "*").Result()
	if err != nil || len(keys) != 5 {
		t.Fatalf("keys %v %v, want the counter, the limits, the top set and the two marks", keys, err)
	}
	for _, k := range keys {
		var held []string
		switch c.Type(ctx, k).Val() {
		case "hash":
			held = c.HKeys(ctx, k).Val()
		case "zset":
			held = c.ZRange(ctx, k, 0, -1).Val()
		}
		for _, s := range append(held, k) {
			if strings.Contains(s, "sk-secret") {
				t.Fatalf("%s holds %q, which carries the principal", k, s)
			}
		}
	}
}
