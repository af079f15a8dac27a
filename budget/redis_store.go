package budget

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// reserveScript checks every counter, then charges every counter, in one
// server-side step: no other client can run between the check and the charge,
// and a denial charges nothing.
//
// KEYS: the counters. ARGV: amount, limit, ttl_ms for each key in order.
// Returns {admitted (0|1), denied index (1-based, 0 if admitted), used...}.
var reserveScript = redis.NewScript(`
local n = #KEYS
local used = {}
local denied = 0
for i = 1, n do
  used[i] = tonumber(redis.call('GET', KEYS[i]) or '0')
  if denied == 0 and used[i] + tonumber(ARGV[3*i-2]) > tonumber(ARGV[3*i-1]) then
    denied = i
  end
end
if denied > 0 then
  return {0, denied, unpack(used)}
end
for i = 1, n do
  used[i] = redis.call('INCRBY', KEYS[i], ARGV[3*i-2])
  redis.call('PEXPIRE', KEYS[i], ARGV[3*i])
end
return {1, 0, unpack(used)}
`)

// settleScript applies a reservation's adjustments at most once: the marker
// is set NX first, so a retry after a lost reply is a no-op.
//
// KEYS[1]: the marker; KEYS[2..]: counters. ARGV[1]: marker ttl_ms; then
// delta, ttl_ms for each counter. Returns 1 if applied, 0 for a repeat.
var settleScript = redis.NewScript(`
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then
  return 0
end
for i = 2, #KEYS do
  local v = redis.call('INCRBY', KEYS[i], ARGV[2*i-2])
  if v < 0 then
    redis.call('SET', KEYS[i], 0)
  end
  redis.call('PEXPIRE', KEYS[i], ARGV[2*i-1])
end
return 1
`)

// RedisStore keeps budget counters in Redis. All keys of one call must share a
// hash tag so the scripts also run on Redis Cluster.
type RedisStore struct {
	client redis.UniversalClient
}

var _ Store = (*RedisStore)(nil)

// NewRedisStore uses client, which the caller owns and closes.
func NewRedisStore(client redis.UniversalClient) *RedisStore {
	return &RedisStore{client: client}
}

// Reserve implements Store.
func (r *RedisStore) Reserve(ctx context.Context, charges []Charge) (ReserveResult, error) {
	keys := make([]string, len(charges))
	args := make([]any, 0, 3*len(charges))
	for i, c := range charges {
		keys[i] = c.Key
		args = append(args, c.Amount, c.Limit, c.TTL.Milliseconds())
	}
	vals, err := reserveScript.Run(ctx, r.client, keys, args...).Int64Slice()
	if err != nil {
		return ReserveResult{}, fmt.Errorf("budget reserve script: %w", err)
	}
	if len(vals) != 2+len(charges) {
		return ReserveResult{}, fmt.Errorf("budget reserve script: %d values for %d budgets", len(vals), len(charges))
	}
	return ReserveResult{Admitted: vals[0] == 1, Denied: int(vals[1]) - 1, Used: vals[2:]}, nil
}

// Settle implements Store.
func (r *RedisStore) Settle(ctx context.Context, marker string, markerTTL time.Duration, adjs []Adjustment) (bool, error) {
	keys := make([]string, 0, 1+len(adjs))
	args := make([]any, 0, 1+2*len(adjs))
	keys = append(keys, marker)
	args = append(args, markerTTL.Milliseconds())
	for _, a := range adjs {
		keys = append(keys, a.Key)
		args = append(args, a.Delta, a.TTL.Milliseconds())
	}
	n, err := settleScript.Run(ctx, r.client, keys, args...).Int64()
	if err != nil {
		return false, fmt.Errorf("budget settle script: %w", err)
	}
	return n == 1, nil
}

// Get implements Store.
func (r *RedisStore) Get(ctx context.Context, keys []string) ([]int64, error) {
	out := make([]int64, len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	vals, err := r.client.MGet(ctx, keys...).Result()
	if err != nil {
		return nil, fmt.Errorf("budget counters: %w", err)
	}
	for i, v := range vals {
		if s, ok := v.(string); ok {
			if out[i], err = strconv.ParseInt(s, 10, 64); err != nil {
				return nil, fmt.Errorf("budget counter %s: %w", keys[i], err)
			}
		}
	}
	return out, nil
}
