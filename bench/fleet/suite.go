package main

import (
	"fmt"
	"time"
)

// suiteScenarios are the cases the fleet limit is judged by, limit 1000 per
// 10 s and 100 ms sync for all:
//
//   - accuracy: one key near or over its limit, each with the near-limit
//     mechanisms and without;
//   - load: what the store costs with many keys, most far below their limit,
//     and as the fleet changes, with the default (near-limit) reconciler;
//   - edges: the fleet at its edges (see edgeScenarios).
func suiteScenarios() []scenario {
	base := scenario{Events: 1000, Window: 10 * time.Second, Sync: 100 * time.Millisecond, Pattern: "uniform", Keys: 1, Instances: 4}
	with := func(name string, inst int, rate float64, d time.Duration, pattern string) scenario {
		s := base
		s.Group = "accuracy"
		s.Name, s.Instances, s.Rate, s.Duration, s.Pattern = name, inst, rate, d, pattern
		return s
	}
	cases := []scenario{
		with("1 instance, 4x the limit (400 req/s, 30 s)", 1, 400, 30*time.Second, "uniform"),
		with("4 instances, 400 req/s steady, 30 s", 4, 400, 30*time.Second, "uniform"),
		with("4 instances, 2000 req/s burst, 5 s", 4, 2000, 5*time.Second, "uniform"),
		with("4 instances, 95% of the limit evenly, 30 s", 4, 95, 30*time.Second, "uniform"),
		with("4 instances, 4000 req/s steady, 30 s", 4, 4000, 30*time.Second, "uniform"),
		with("4 instances, 400 req/s skewed 70% to one, 30 s", 4, 400, 30*time.Second, "skewed"),
		with("4 instances, 800 req/s bursty 1 s on/off, 30 s", 4, 800, 30*time.Second, "bursty"),
	}
	var out []scenario
	for _, c := range cases {
		for _, fixed := range []bool{true, false} {
			c.Fixed = fixed
			out = append(out, c)
		}
	}

	const d = 20 * time.Second
	load := func(name string, flows ...flow) scenario {
		s := base
		s.Group, s.Name, s.Duration, s.Flows = "load", name, d, flows
		return s
	}
	// Beside a key at 4x its limit and one at 95% of it, 1,000 keys at 3.5%
	// of theirs make up 4,000 req/s, for the fleet changes.
	changing := []flow{
		{First: 0, Keys: 1, Rate: 400},
		{First: 1, Keys: 1, Rate: 95},
		{First: 2, Keys: 1000, Rate: 3505},
	}
	join := load("2 -> 4 instances at 10 s: 1 key at 4x, 1 at 95%, 1,000 at 3.5%", changing...)
	join.Fleet = []life{{}, {}, {Up: d / 2}, {Up: d / 2}}
	leave := load("4 -> 2 instances at 10 s: 1 key at 4x, 1 at 95%, 1,000 at 3.5%", changing...)
	leave.Fleet = []life{{}, {}, {Down: d / 2}, {Down: d / 2}}
	random := load("95% of the limit, random balancer", flow{Keys: 1, Rate: 95, Random: true})
	// A deploy: each instance stopped and started again in turn, 5 s apart.
	rolling := load("rolling restart every 5 s: 10,000 keys at 0.2% of the limit", flow{Keys: 10_000, Rate: 2000})
	rolling.Restart, rolling.RestartEvery, rolling.Rolling = []int{0, 1, 2, 3}, 5*time.Second, true
	rolling40 := load("rolling restart every 5 s: 100 keys at 40% of the limit", flow{Keys: 100, Rate: 4000})
	rolling40.Restart, rolling40.RestartEvery, rolling40.Rolling = []int{0, 1, 2, 3}, 5*time.Second, true
	out = append(out,
		load("1,000 keys at 4% of the limit", flow{Keys: 1000, Rate: 4000}),
		load("10,000 keys at 0.4% of the limit", flow{Keys: 10_000, Rate: 4000}),
		load("100,000 keys at 0.04% of the limit", flow{Keys: 100_000, Rate: 4000}),
		load("100 keys at 40% of the limit", flow{Keys: 100, Rate: 4000}),
		load("1 key at 4x the limit among 10,000 at 0.36%",
			flow{First: 0, Keys: 1, Rate: 400}, flow{First: 1, Keys: 10_000, Rate: 3600}),
		load("1 key at 1 req/s per instance, at 10 s 4x the limit on 3 of 4",
			flow{Keys: 1, Rate: 1, On: []int{3}},
			flow{Keys: 1, Rate: 3, On: []int{0, 1, 2}, To: d / 2},
			flow{Keys: 1, Rate: 400, On: []int{0, 1, 2}, From: d / 2}),
		join, leave, random, rolling, rolling40,
	)
	return append(out, edgeScenarios()...)
}

// edgeScenarios are the fleet at its edges, limit 100 per 10 s (or smaller
// than the fleet), near-limit mechanisms on: instances that restart, a limit
// smaller than the fleet can share out, most of a key on one instance of 8,
// a fleet that grows. Each has keys under their limit, which must never be
// denied, beside one over it, which must never pass it.
func edgeScenarios() []scenario {
	const d = 40 * time.Second
	edge := func(name string, inst int, events int64, flows ...flow) scenario {
		return scenario{Group: "edges", Name: name, Instances: inst, Events: events, Window: 10 * time.Second,
			Sync: 100 * time.Millisecond, Duration: d, Flows: flows}
	}
	// 4x, 90% and 50% of a limit of 100 per 10 s.
	three := []flow{{First: 0, Keys: 1, Rate: 40}, {First: 1, Keys: 1, Rate: 9}, {First: 2, Keys: 1, Rate: 5}}
	graceful := edge("instances 3 and 4 of 4 restart every 1.5 s: keys at 4x, 90%, 50%", 4, 100, three...)
	graceful.Restart, graceful.RestartEvery = []int{2, 3}, 1500*time.Millisecond
	killed := graceful
	killed.Name, killed.Kill = "instances 3 and 4 of 4 killed and restarted every 1.5 s: keys at 4x, 90%, 50%", true
	join := edge("2 -> 4 instances at 20 s: keys at 4x, 90%, 50%", 4, 100, three...)
	join.Fleet = []life{{}, {}, {Up: d / 2}, {Up: d / 2}}
	skew := edge("8 instances, 90% of each key on one: keys at 4x, 90%, 50%", 8, 100,
		flow{First: 0, Keys: 1, Rate: 40, Heavy: 0.9}, flow{First: 1, Keys: 1, Rate: 9, Heavy: 0.9}, flow{First: 2, Keys: 1, Rate: 5, Heavy: 0.9})
	tiny := func(events int64, inst int) scenario {
		// 13x the limit, and 90% of it, at random instances.
		return edge(fmt.Sprintf("limit %d on %d instances: keys at 13x and 90%%", events, inst), inst, events,
			flow{First: 0, Keys: 1, Rate: 1.3 * float64(events), Random: true}, flow{First: 1, Keys: 1, Rate: 0.09 * float64(events), Random: true})
	}
	return []scenario{graceful, killed, join, skew, tiny(3, 4), tiny(3, 8), tiny(1, 4), tiny(1, 8)}
}
