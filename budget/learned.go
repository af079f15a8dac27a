package budget

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// Learned is what a model's answers have shown, shared by every instance on
// a store so that a model is cold once per store, not once per process
// (docs/architecture.md, "Learning is the fleet's"). Each field only ever
// grows: flags are set for good, numbers are the most any instance saw. So
// merging is a union of evidence, the same in any order, however often: a
// contrary answer anywhere (a model found hidden, a tokenizer's count
// revoked) withdraws trust everywhere at the next merge, and no instance
// trusts more than some instance's answers showed.
type Learned struct {
	// Flags are LearnedProven, LearnedHidden, LearnedTokensProven and
	// LearnedTokensRevoked.
	Flags uint8
	// Scale and Density are a proxy tokenizer's scale and the densest text
	// it is trusted for (per 1024); LeaseSize and TokensLeaseSize the first
	// lease, a token a byte and by the tokenizer; ProxyAnswers, ProxyRatio
	// and ProxyDensity a proxy's evidence before it is proven.
	Scale, Density, LeaseSize, TokensLeaseSize, ProxyAnswers, ProxyRatio, ProxyDensity int64
}

// The flags of Learned.
const (
	LearnedProven uint8 = 1 << iota
	LearnedHidden
	LearnedTokensProven
	LearnedTokensRevoked
)

// learnedFields are Learned's numbers in the order the store keeps them.
func (l *Learned) numbers() [7]*int64 {
	return [7]*int64{&l.Scale, &l.Density, &l.LeaseSize, &l.TokensLeaseSize, &l.ProxyAnswers, &l.ProxyRatio, &l.ProxyDensity}
}

// Merge is the union of l's evidence and o's.
func (l Learned) Merge(o Learned) Learned {
	l.Flags |= o.Flags
	mine, theirs := l.numbers(), o.numbers()
	for i := range mine {
		*mine[i] = max(*mine[i], *theirs[i])
	}
	return l
}

// learnedTTL is how long a model's learning is kept after its last merge.
const learnedTTL = 30 * 24 * time.Hour

// MergeLearned merges l into what the store has learned of model, and
// returns the union; a zero l reads it. The key carries a hash of the
// model's name, so its length is bounded whatever the name.
func (e *Engine) MergeLearned(ctx context.Context, model string, l Learned) (Learned, error) {
	out, err := e.store.MergeLearned(ctx, e.prefix+":bl:"+keyhash.Of(model).String(), l, learnedTTL)
	if err != nil {
		return Learned{}, e.failed(err)
	}
	return out, nil
}

// MergeLearned implements Store.
func (m *MemoryStore) MergeLearned(_ context.Context, key string, l Learned, ttl time.Duration) (Learned, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.learned == nil {
		m.learned = make(map[string]learnedValue)
	}
	v := m.learned[key]
	if !now.Before(v.expires) {
		v.l = Learned{}
	}
	v.l, v.expires = v.l.Merge(l), now.Add(ttl)
	m.learned[key] = v
	return v.l, nil
}

type learnedValue struct {
	l       Learned
	expires time.Time
}

// mergeLearnedScript merges a Learned into a hash in one step: field f, the
// flags, by bitwise or; n1…n7 the numbers, by max. KEYS[1]: the hash;
// ARGV[1]: ttl_ms; ARGV[2]: the flags; ARGV[3…9]: the numbers. Returns the
// merged flags and numbers.
var mergeLearnedScript = redis.NewScript(`
local out = {}
local f = tonumber(redis.call('HGET', KEYS[1], 'f') or '0')
f = bit.bor(f, tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], 'f', f)
out[1] = f
for i = 1, 7 do
  local name = 'n' .. i
  local v = math.max(tonumber(redis.call('HGET', KEYS[1], name) or '0'), tonumber(ARGV[i + 2]))
  redis.call('HSET', KEYS[1], name, v)
  out[i + 1] = v
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return out
`)

// MergeLearned implements Store.
func (r *RedisStore) MergeLearned(ctx context.Context, key string, l Learned, ttl time.Duration) (Learned, error) {
	args := []any{ttl.Milliseconds(), int64(l.Flags)}
	for _, n := range l.numbers() {
		args = append(args, *n)
	}
	vals, err := mergeLearnedScript.Run(ctx, r.client, []string{key}, args...).Int64Slice()
	if err != nil {
		return Learned{}, fmt.Errorf("budget learned: %w", err)
	}
	if len(vals) != 8 {
		return Learned{}, fmt.Errorf("budget learned: the script returned %d values, want 8", len(vals))
	}
	out := Learned{Flags: uint8(vals[0])}
	for i, n := range out.numbers() {
		*n = vals[i+1]
	}
	return out, nil
}
