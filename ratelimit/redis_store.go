package ratelimit

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// RedisStore keeps the fleet's counters in Redis (standalone, Sentinel or
// Cluster, through go-redis's UniversalClient).
type RedisStore struct {
	client redis.UniversalClient
}

var _ CounterStore = (*RedisStore)(nil)

// NewRedisStore uses client, which the caller owns and closes.
func NewRedisStore(client redis.UniversalClient) *RedisStore {
	return &RedisStore{client: client}
}

// Add pushes every increment as INCRBY + PEXPIRE in one MULTI/EXEC, so a failed
// batch applies nothing and a retry can never count an admit twice. On Cluster
// go-redis runs one transaction per slot; a key's epochs share a slot through
// their hash tag.
func (r *RedisStore) Add(ctx context.Context, incs []Increment) error {
	if len(incs) == 0 {
		return nil
	}
	_, err := r.client.TxPipelined(ctx, func(p redis.Pipeliner) error {
		for _, inc := range incs {
			p.IncrBy(ctx, inc.Key, inc.By)
			p.PExpire(ctx, inc.Key, inc.TTL)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("pushing %d counter increments: %w", len(incs), err)
	}
	return nil
}

// Get reads the keys with pipelined GETs rather than one MGET, which Redis
// Cluster refuses across slots.
func (r *RedisStore) Get(ctx context.Context, keys []string) ([]int64, error) {
	if len(keys) == 0 {
		return nil, nil
	}
	cmds := make([]*redis.StringCmd, len(keys))
	_, err := r.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			cmds[i] = p.Get(ctx, k)
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("reading %d counters: %w", len(keys), err)
	}
	out := make([]int64, len(keys))
	for i, c := range cmds {
		v, err := c.Int64()
		switch {
		case errors.Is(err, redis.Nil):
		case err != nil:
			return nil, fmt.Errorf("reading counter %s: %w", keys[i], err)
		default:
			out[i] = max(v, 0)
		}
	}
	return out, nil
}
