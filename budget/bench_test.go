package budget

import (
	"context"
	"testing"

	"github.com/fleetguard/fleetguard/internal/redistest"
)

func benchBudgets() []Budget {
	return []Budget{
		tokenBudget("per_key", PerKey, 1<<60),
		tokenBudget("per_team", PerTeam, 1<<60),
		{Name: "global_usd", Scope: Global, Unit: USD, Limit: 1 << 60, Window: tokenBudget("", Global, 1).Window},
	}
}

func benchReserveSettle(b *testing.B, s Store) {
	e := NewEngine(s, "bench")
	budgets := benchBudgets()
	dims := Dims{Principal: "Bearer sk-bench", Team: "team-a", Model: "gpt-4o"}
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		r, d, err := e.Reserve(ctx, budgets, dims, Spend{Tokens: 1200, CostMicros: 9000})
		if err != nil || d != nil {
			b.Fatal(d, err)
		}
		if err := e.Settle(ctx, r, Spend{Tokens: 700, CostMicros: 5000}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkReserveSettleMemory: one request's reserve and settle over three
// budgets on the embedded store.
func BenchmarkReserveSettleMemory(b *testing.B) { benchReserveSettle(b, NewMemoryStore()) }

// BenchmarkReserveSettleRedis: the same against a local redis-server (two
// script calls per request).
func BenchmarkReserveSettleRedis(b *testing.B) {
	benchReserveSettle(b, NewRedisStore(redistest.Start(b).Client(b)))
}
