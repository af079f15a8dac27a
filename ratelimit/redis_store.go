package ratelimit

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

//go:embed lease.lua
var leaseLua string

var leaseScript = redis.NewScript(leaseLua)

//go:embed slots.lua
var slotsLua string

var slotsScript = redis.NewScript(slotsLua)

// RedisStore keeps the fleet's counts in Redis (standalone, Sentinel or
// Cluster, through go-redis's UniversalClient): one hash per zone and key,
// one script call per key and pass, all of a pass's calls in one pipeline.
// Each key's commands touch one Cluster slot.
type RedisStore struct {
	client redis.UniversalClient
	loaded atomic.Bool // the lease script is known to the servers (as far as we know)
}

var _ SlotStore = (*RedisStore)(nil)

// NewRedisStore uses client, which the caller owns and closes. The client
// must not retry commands by itself (MaxRetries -1): a re-sent lease whose
// first reply was lost would push its admits twice.
func NewRedisStore(client redis.UniversalClient) *RedisStore {
	return &RedisStore{client: client}
}

// Lease implements SlotStore. Calls that fail with NOSCRIPT (a server that
// has not seen the script: a restart or a failover) did not run, so they
// are loaded and sent once more; any other failure is the call's error.
func (r *RedisStore) Lease(ctx context.Context, calls []Lease, replies []LeaseReply) error {
	if len(calls) == 0 {
		return nil
	}
	if !r.loaded.Load() {
		if err := r.load(ctx); err != nil {
			for i := range replies {
				replies[i] = LeaseReply{Err: err}
			}
			return err
		}
	}
	todo := make([]int, len(calls))
	for i := range todo {
		todo[i] = i
	}
	for attempt := 0; ; attempt++ {
		noScript := r.run(ctx, calls, replies, todo)
		if len(noScript) == 0 || attempt > 0 {
			break
		}
		if err := r.load(ctx); err != nil {
			break
		}
		todo = noScript
	}
	for i := range replies {
		if replies[i].Err != nil {
			return replies[i].Err
		}
	}
	return nil
}

// Beat implements SlotStore.
func (r *RedisStore) Beat(ctx context.Context, key, hotKey string, b Beat) (SlotTable, error) {
	res, err := slotsScript.Run(ctx, r.client, []string{key, hotKey}, beatArgs(&b)...).Slice()
	if err != nil {
		return SlotTable{}, fmt.Errorf("fleet heartbeat: %w", err)
	}
	t, err := parseSlotTable(res)
	if err != nil {
		return SlotTable{}, fmt.Errorf("fleet heartbeat: %w", err)
	}
	return t, nil
}

// beatArgs are slots.lua's arguments for b.
func beatArgs(b *Beat) []any {
	args := make([]any, 0, 9+2*len(b.Hot))
	args = append(args, b.Member, b.Slot, b.Now, b.TTL.Milliseconds(), bit(b.Flushed), b.Keep.Milliseconds(), b.MaxInstances, b.HotKeep.Milliseconds(),
		b.Settle.Milliseconds())
	for _, h := range b.Hot {
		args = append(args, h.Key, h.Until)
	}
	return args
}

// parseSlotTable reads slots.lua's reply: slot, life, live, the fleet's
// max instances n, a life per slot of n, then pairs of hot key and until.
func parseSlotTable(res []any) (SlotTable, error) {
	if len(res) < 4 {
		return SlotTable{}, fmt.Errorf("unexpected reply %v", res)
	}
	n, err := toInt(res[3])
	if err != nil || n < 1 || n > 64 {
		return SlotTable{}, fmt.Errorf("unexpected reply %v", res)
	}
	head := 4 + int(n)
	if len(res) < head || (len(res)-head)%2 != 0 {
		return SlotTable{}, fmt.Errorf("unexpected reply %v", res)
	}
	ints := make([]int64, head)
	for i := range ints {
		v, err := toInt(res[i])
		if err != nil {
			return SlotTable{}, err
		}
		ints[i] = v
	}
	t := SlotTable{Slot: int(ints[0]), Life: ints[1], Live: int(ints[2]), Slots: int(n)}
	for _, l := range ints[4:] {
		if l != 0 {
			t.Lives = append(t.Lives, l)
		}
	}
	for i := head; i < len(res); i += 2 {
		k, ok := res[i].(string)
		u, err := toInt(res[i+1])
		if !ok || err != nil {
			return SlotTable{}, fmt.Errorf("unexpected hot key %v %v", res[i], res[i+1])
		}
		t.Hot = append(t.Hot, HotKey{Key: k, Until: u})
	}
	return t, nil
}

// Ping checks that the store answers.
func (r *RedisStore) Ping(ctx context.Context) error {
	if err := r.client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("pinging the store: %w", err)
	}
	return nil
}

func (r *RedisStore) load(ctx context.Context) error {
	// On a Cluster, go-redis loads the script on every primary.
	if err := r.client.ScriptLoad(ctx, leaseLua).Err(); err != nil {
		return fmt.Errorf("loading the lease script: %w", err)
	}
	r.loaded.Store(true)
	return nil
}

// run sends the calls listed in todo, in pipelines of at most pipelineCalls,
// and returns those that failed with NOSCRIPT.
func (r *RedisStore) run(ctx context.Context, calls []Lease, replies []LeaseReply, todo []int) (noScript []int) {
	for len(todo) > 0 {
		n := min(len(todo), pipelineCalls)
		noScript = append(noScript, r.runPipeline(ctx, calls, replies, todo[:n])...)
		todo = todo[n:]
	}
	return noScript
}

// pipelineCalls bounds one pipeline, so that the store answers it well
// within the client's read timeout (a graceful stop pushes every key held
// on a floor).
const pipelineCalls = 4096

// leaseArgs are lease.lua's arguments for c.
func leaseArgs(c *Lease) []any {
	args := make([]any, 0, 16+len(c.Lives)+2*len(c.Push))
	args = append(args, c.Now, c.Oldest, c.TTL.Milliseconds(), c.Member, c.Life, bit(c.Hot), c.Floor, c.Events, c.MaxInstances,
		c.Settle.Milliseconds(), c.Gap.Milliseconds(), c.Held, c.Want, c.Until, bit(c.View), len(c.Lives))
	for _, l := range c.Lives {
		args = append(args, l)
	}
	for _, a := range c.Push {
		args = append(args, a.Slot, a.Count)
	}
	return args
}

// runPipeline sends the calls listed in todo in one pipeline and returns
// those that failed with NOSCRIPT.
func (r *RedisStore) runPipeline(ctx context.Context, calls []Lease, replies []LeaseReply, todo []int) (noScript []int) {
	cmds := make([]*redis.Cmd, len(todo))
	_, _ = r.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for j, i := range todo {
			c := &calls[i]
			cmds[j] = leaseScript.EvalSha(ctx, p, []string{c.Key}, leaseArgs(c)...)
		}
		return nil
	})
	for j, i := range todo {
		res, err := cmds[j].Result()
		if err != nil {
			if redis.HasErrorPrefix(err, "NOSCRIPT") {
				noScript = append(noScript, i)
			}
			replies[i] = LeaseReply{Err: fmt.Errorf("leasing %s: %w", calls[i].Key, err)}
			continue
		}
		replies[i] = parseLease(calls[i].Key, res)
	}
	return noScript
}

func parseLease(key string, res any) LeaseReply {
	vals, ok := res.([]any)
	if !ok || len(vals) != 6 {
		return LeaseReply{Err: fmt.Errorf("leasing %s: unexpected reply %v", key, res)}
	}
	var ints [6]int64
	for i, v := range vals {
		n, err := toInt(v)
		if err != nil {
			return LeaseReply{Err: fmt.Errorf("leasing %s: %w", key, err)}
		}
		ints[i] = n
	}
	return LeaseReply{Granted: ints[0], Room: ints[1], Holders: ints[2], Pushed: ints[3], Oldest: ints[4], Lapses: ints[5]}
}

// bit is a flag as the scripts read it.
func bit(b bool) int {
	if b {
		return 1
	}
	return 0
}

func toInt(v any) (int64, error) {
	switch n := v.(type) {
	case int64:
		return n, nil
	case string:
		return strconv.ParseInt(n, 10, 64)
	}
	return 0, errors.New("not an integer: " + fmt.Sprint(v))
}
