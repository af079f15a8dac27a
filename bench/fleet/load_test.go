package main

import (
	"testing"
	"time"
)

func TestSpreadSendsEveryKeyToEveryInstance(t *testing.T) {
	for _, c := range []struct{ keys, n int }{{1, 4}, {1, 3}, {10, 4}, {100, 4}, {10_000, 4}, {3, 2}, {6, 4}} {
		seen := make([]map[int]bool, c.keys)
		per := make([]int, c.n)
		total := c.keys * c.n * c.n
		for i := 0; i < total; i++ {
			k, inst := i%c.keys, spread(i, c.keys, c.n)
			if seen[k] == nil {
				seen[k] = map[int]bool{}
			}
			seen[k][inst] = true
			per[inst]++
		}
		for k, s := range seen {
			if len(s) != c.n {
				t.Fatalf("%d keys over %d instances: key %d meets instances %v", c.keys, c.n, k, s)
			}
		}
		for inst, got := range per {
			if got != total/c.n {
				t.Fatalf("%d keys over %d instances: instance %d got %d of %d requests", c.keys, c.n, inst, got, total)
			}
		}
	}
}

func TestScheduleSendsOnlyToLiveInstances(t *testing.T) {
	const d = 4 * time.Second
	sc := scenario{Instances: 4, Duration: d,
		Flows: []flow{{Keys: 1, Rate: 100}, {First: 1, Keys: 7, Rate: 300, Random: true}},
		Fleet: []life{{}, {Down: d / 2}, {Up: d / 2}, {Up: d / 4, Down: 3 * d / 4}}}
	reqs := schedule(sc)
	if want := int((100 + 300) * d.Seconds()); len(reqs) != want {
		t.Fatalf("%d requests, want %d", len(reqs), want)
	}
	var last time.Duration
	got := make([]int, sc.Instances)
	for _, q := range reqs {
		if q.At < last {
			t.Fatalf("request at %s after one at %s", q.At, last)
		}
		last = q.At
		if !sc.life(q.Inst).live(q.At) {
			t.Fatalf("request at %s to instance %d, which is down", q.At, q.Inst)
		}
		if q.Key < 0 || q.Key >= sc.keys() {
			t.Fatalf("key %d of %d", q.Key, sc.keys())
		}
		got[q.Inst]++
	}
	for inst, n := range got {
		if n == 0 {
			t.Fatalf("instance %d got no request", inst)
		}
	}
	if s := sc.fleetSize(); s != "2" {
		t.Fatalf("fleet size %q, want 2 (two up at the start, two at the end)", s)
	}
	sc.Fleet = []life{{}, {}, {Up: d / 2}, {Up: d / 2}}
	if s := sc.fleetSize(); s != "2→4" {
		t.Fatalf("fleet size %q, want 2→4", s)
	}
}
