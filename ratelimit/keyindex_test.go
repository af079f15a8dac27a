package ratelimit

import (
	"math/rand/v2"
	"testing"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/offheap"
)

// TestKeyIndexMatchesAMap inserts, finds, removes and sweeps random keys,
// many sharing a home slot and a tag, against a map.
func TestKeyIndexMatchesAMap(t *testing.T) {
	a := &arena{ringLen: 1, mem: new(offheap.Memory)}
	defer a.mem.Release()
	var x keyIndex
	want := map[keyhash.Hash]int32{}
	rng := rand.New(rand.NewPCG(3, 4))
	// A pool of keys ten to a home (the same low bits at every table size)
	// and few tags: long probe runs, some wrapping around the table's end,
	// and tags that match another key's.
	homes := make([]uint64, 300)
	for i := range homes {
		homes[i] = rng.Uint64N(1 << 40)
	}
	pool := make([]keyhash.Hash, 3000)
	for i := range pool {
		pool[i] = keyhash.Hash{Hi: rng.Uint64N(4)<<60 | homes[i%len(homes)], Lo: uint64(i / len(homes) % 4)}
	}
	key := func() keyhash.Hash { return pool[rng.IntN(len(pool))] }
	check := func(h keyhash.Hash) {
		t.Helper()
		_, i, ok := x.find(a, h)
		if wi, wok := want[h]; ok != wok || ok && i != wi {
			t.Fatalf("find %v = %d, %v; want %d, %v", h, i, ok, wi, wok)
		}
	}
	for step := 0; step < 200_000; step++ {
		h := key()
		switch _, there := want[h]; {
		case !there && rng.IntN(3) > 0:
			i := a.alloc()
			a.entry(i).hash = h
			x.insert(a, h, i)
			want[h] = i
		case there:
			pos, i, _ := x.find(a, h)
			x.removeAt(a, pos)
			a.free(i)
			delete(want, h)
		}
		check(h)
		check(key())
		if step%20_000 == 0 {
			sweepLowZero(t, a, &x, want)
			for h := range want {
				check(h)
			}
		}
	}
	n := 0
	x.each(func(int32) { n++ })
	if n != len(want) || x.keys != n {
		t.Fatalf("each saw %d keys, the index counts %d, want %d", n, x.keys, len(want))
	}
}

// sweepLowZero sweeps the keys whose hash's Lo is 0 out of x and want.
func sweepLowZero(t *testing.T, a *arena, x *keyIndex, want map[keyhash.Hash]int32) {
	t.Helper()
	x.sweep(a, func(i int32) bool {
		h := a.entry(i).hash
		if h.Lo != 0 {
			return false
		}
		delete(want, h)
		a.free(i)
		return true
	})
	if x.keys != len(want) {
		t.Fatalf("%d keys after a sweep, want %d", x.keys, len(want))
	}
}
