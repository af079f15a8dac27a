package main

import (
	"math/rand/v2"
	"sort"
	"time"
)

// flow is one part of a load: requests at a steady rate, its keys requested
// round robin, sent to its instances by round robin or at random.
type flow struct {
	First, Keys int     // keys First … First+Keys-1
	Rate        float64 // requests per second, all its keys and instances together
	On          []int   // instances it is sent to (nil: every instance); only live ones receive
	From, To    time.Duration
	Random      bool // a random balancer instead of round robin
	// Heavy, when set, is the part of the flow sent to its first live
	// instance; the rest goes round robin to the others.
	Heavy float64
}

// life is when an instance runs: from Up until Down (0: to the end).
type life struct{ Up, Down time.Duration }

func (l life) live(t time.Duration) bool { return t >= l.Up && (l.Down == 0 || t < l.Down) }

// req is one request of the load: when, to which instance, for which key.
type req struct {
	At   time.Duration
	Inst int
	Key  int
}

// schedule lists the requests of a run in time order.
func schedule(sc scenario) []req {
	rng := rand.New(rand.NewPCG(1, 18))
	if len(sc.Flows) == 0 {
		var out []req
		gap := float64(time.Second) / sc.Rate
		for i := 0; ; i++ {
			at := offset(sc, float64(i)*gap)
			if at >= sc.Duration {
				return out
			}
			out = append(out, req{At: at, Inst: pick(sc, i, rng), Key: i % sc.Keys})
		}
	}
	var out []req
	for _, f := range sc.Flows {
		to := f.To
		if to == 0 {
			to = sc.Duration
		}
		on := f.On
		if on == nil {
			for i := 0; i < sc.Instances; i++ {
				on = append(on, i)
			}
		}
		gap := float64(time.Second) / f.Rate
		live := make([]int, 0, len(on))
		for i := 0; ; i++ {
			at := f.From + time.Duration(float64(i)*gap)
			if at >= to {
				break
			}
			live = live[:0]
			for _, n := range on {
				if sc.life(n).live(at) {
					live = append(live, n)
				}
			}
			if len(live) == 0 {
				continue
			}
			var n int
			switch {
			case f.Heavy > 0 && len(live) > 1:
				n = live[0]
				if float64(i%100) >= 100*f.Heavy {
					n = live[1+i%(len(live)-1)]
				}
			case f.Random:
				n = live[rng.IntN(len(live))]
			default:
				n = live[spread(i, f.Keys, len(live))]
			}
			out = append(out, req{At: at, Inst: n, Key: f.First + i%f.Keys})
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].At < out[j].At })
	return out
}

// offset maps the nominal send time of a request to its time in the run:
// bursty loads send at the rate for one second, then pause one second.
func offset(sc scenario, nominal float64) time.Duration {
	if sc.Pattern != "bursty" {
		return time.Duration(nominal)
	}
	on := float64(time.Second)
	cycles := int64(nominal / on)
	return time.Duration(float64(cycles)*2*on + (nominal - float64(cycles)*on))
}

func pick(sc scenario, i int, rng *rand.Rand) int {
	switch {
	case sc.Pattern == "skewed" && sc.Instances > 1:
		if i%10 < 7 {
			return 0
		}
		return 1 + i%(sc.Instances-1)
	case sc.Pattern == "random":
		return rng.IntN(sc.Instances)
	}
	return spread(i, sc.Keys, sc.Instances)
}

// spread is the round robin instance of the i-th request when keys are
// requested round robin too. Where the key and instance counts share a
// factor, plain i mod n would send each key to the same few instances for
// ever (10,000 keys over 4 instances: every key to one instance); shifting by
// one instance every lcm(keys, n) requests sends each key to every instance in
// turn, as a balancer that does not know the key would.
func spread(i, keys, n int) int {
	g := gcd(keys, n)
	if g == 1 {
		return i % n
	}
	return (i + i/(keys/g*n)) % n
}

func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}
