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
	flushed := "0"
	if b.Flushed {
		flushed = "1"
	}
	leasing := 0
	if b.Leasing {
		leasing = 1
	}
	args := make([]any, 0, 12+len(b.Handed)+len(b.Hot))
	args = append(args, b.Member, b.Slot, b.Now, b.TTL.Milliseconds(), flushed, b.Keep.Milliseconds(), b.View.Milliseconds(), b.MaxInstances, b.HotFor.Milliseconds(),
		leasing, b.HandedUntil, len(b.Handed))
	for _, h := range b.Handed {
		args = append(args, h)
	}
	for _, h := range b.Hot {
		args = append(args, h)
	}
	res, err := slotsScript.Run(ctx, r.client, []string{key, hotKey}, args...).Slice()
	if err != nil {
		return SlotTable{}, fmt.Errorf("fleet heartbeat: %w", err)
	}
	if len(res) < 6 {
		return SlotTable{}, fmt.Errorf("fleet heartbeat: unexpected reply %v", res)
	}
	slot, err1 := toInt(res[0])
	at, err2 := toInt(res[1])
	holding, ok := res[2].(string)
	live, err3 := toInt(res[3])
	handedUntil, err4 := toInt(res[4])
	handed, err5 := toInt(res[5])
	if err := errors.Join(err1, err2, err3, err4, err5); err != nil || !ok || handed < 0 || int(handed) > len(res)-6 {
		return SlotTable{}, fmt.Errorf("fleet heartbeat: unexpected reply %v", res)
	}
	t := SlotTable{Slot: int(slot), FloorAt: at, Live: int(live)}
	if handed > 0 {
		t.HandedUntil = handedUntil
	}
	for _, k := range res[6 : 6+handed] {
		if s, ok := k.(string); ok {
			t.Handed = append(t.Handed, s)
		}
	}
	for j := range min(len(holding), 64) {
		if holding[j] == '1' {
			t.Holding |= 1 << j
		}
	}
	for _, h := range res[6+handed:] {
		if s, ok := h.(string); ok {
			t.Hot = append(t.Hot, s)
		}
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

// holdingArg is lease.lua's holding set: "1" at j+1 for each slot j.
func holdingArg(h uint64) string {
	var b [64]byte
	n := 0
	for j := range 64 {
		b[j] = '0'
		if h&(1<<j) != 0 {
			b[j], n = '1', j+1
		}
	}
	return string(b[:n])
}

// runPipeline sends the calls listed in todo in one pipeline and returns
// those that failed with NOSCRIPT.
func (r *RedisStore) runPipeline(ctx context.Context, calls []Lease, replies []LeaseReply, todo []int) (noScript []int) {
	cmds := make([]*redis.Cmd, len(todo))
	_, _ = r.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for j, i := range todo {
			c := &calls[i]
			args := make([]any, 0, 13+2*len(c.Push))
			mark := 0
			if c.Mark {
				mark = 1
			}
			args = append(args, c.Now, c.Oldest, c.TTL.Milliseconds(), c.Member, c.Slot, mark, c.MarkUntil,
				c.Floor, c.Events, holdingArg(c.Holding), c.Held, c.Want, c.Until)
			for _, a := range c.Push {
				args = append(args, a.Slot, a.Count)
			}
			cmds[j] = leaseScript.EvalSha(ctx, p, []string{c.Key}, args...)
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
	if !ok || len(vals) < 3 || len(vals)%2 != 1 {
		return LeaseReply{Err: fmt.Errorf("leasing %s: unexpected reply %v", key, res)}
	}
	ints := make([]int64, len(vals))
	for i, v := range vals {
		n, err := toInt(v)
		if err != nil {
			return LeaseReply{Err: fmt.Errorf("leasing %s: %w", key, err)}
		}
		ints[i] = n
	}
	r := LeaseReply{Granted: ints[0], Room: ints[1], MarksUntil: ints[2]}
	for i := 3; i < len(ints); i += 2 {
		r.Slots = append(r.Slots, SlotCount{Slot: ints[i], Count: ints[i+1]})
	}
	return r
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
