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

//go:embed sync.lua
var syncLua string

var syncScript = redis.NewScript(syncLua)

//go:embed heartbeat.lua
var heartbeatLua string

var heartbeatScript = redis.NewScript(heartbeatLua)

// RedisStore keeps the fleet's slot counts in Redis (standalone, Sentinel or
// Cluster, through go-redis's UniversalClient): one hash per zone and key,
// one script call per key and pass, all of a pass's calls in one pipeline.
// Each key's commands touch one Cluster slot, so a pass works the same on a
// single node and on a Cluster.
type RedisStore struct {
	client redis.UniversalClient
	loaded atomic.Bool // the script is known to the servers (as far as we know)
}

var _ SlotStore = (*RedisStore)(nil)

// NewRedisStore uses client, which the caller owns and closes. The client
// must not retry commands by itself (MaxRetries -1): a re-sent step whose
// first reply was lost would count its admits twice.
func NewRedisStore(client redis.UniversalClient) *RedisStore {
	return &RedisStore{client: client}
}

// Sync implements SlotStore. Steps that fail with NOSCRIPT (a server that has
// not seen the script: a restart or a failover) did not run, so they are
// loaded and sent once more; any other failure is the step's error.
func (r *RedisStore) Sync(ctx context.Context, steps []Step, replies []Reply) error {
	if len(steps) == 0 {
		return nil
	}
	if !r.loaded.Load() {
		if err := r.load(ctx); err != nil {
			for i := range replies {
				replies[i] = Reply{Err: err}
			}
			return err
		}
	}
	todo := make([]int, len(steps))
	for i := range todo {
		todo[i] = i
	}
	for attempt := 0; ; attempt++ {
		noScript := r.run(ctx, steps, replies, todo)
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

// Heartbeat implements SlotStore.
func (r *RedisStore) Heartbeat(ctx context.Context, key, hotKey string, hb Heartbeat) (Fleet, error) {
	args := make([]any, 0, 8+3*len(hb.Hot))
	args = append(args, hb.Member, hb.Now, hb.TTL.Milliseconds(), hb.Joined, hb.Keep.Milliseconds(), hb.Seen, hb.Promise, knownArg(hb.Known))
	for _, h := range hb.Hot {
		args = append(args, h.Key, h.Until, h.Room)
	}
	res, err := heartbeatScript.Run(ctx, r.client, []string{key, hotKey, key + ":promises"}, args...).Slice()
	if err != nil {
		return Fleet{}, fmt.Errorf("fleet heartbeat: %w", err)
	}
	f, err := parseFleet(res)
	if err != nil {
		return Fleet{}, fmt.Errorf("fleet heartbeat: %w", err)
	}
	return f, nil
}

// knownArg is heartbeat.lua's list of the promises a heartbeat holds.
func knownArg(known []KnownPromise) string {
	var b []byte
	for _, k := range known {
		b = strconv.AppendInt(b, k.Member, 10)
		b = append(b, ':')
		b = strconv.AppendInt(b, k.Until, 10)
		b = append(b, ' ')
	}
	return string(b)
}

// parseFleet reads heartbeat.lua's reply.
func parseFleet(res []any) (Fleet, error) {
	ints := func(vals []any) ([]int64, error) {
		out := make([]int64, len(vals))
		for i, v := range vals {
			n, err := toInt(v)
			if err != nil {
				return nil, err
			}
			out[i] = n
		}
		return out, nil
	}
	if len(res) < 3 {
		return Fleet{}, fmt.Errorf("unexpected reply %v", res)
	}
	head, err := ints(res[:3])
	if err != nil {
		return Fleet{}, err
	}
	f := Fleet{Fresh: head[0] == 1, Founded: head[1]}
	n := int(head[2])
	rest := res[3:]
	if n < 0 || len(rest) < 5*n || (len(rest)-5*n)%4 != 0 {
		return Fleet{}, fmt.Errorf("unexpected reply %v", res)
	}
	for i := 0; i < 5*n; i += 5 {
		nums, err := ints(rest[i : i+4])
		promise, ok := rest[i+4].(string)
		if err != nil || !ok {
			return Fleet{}, fmt.Errorf("unexpected record %v", rest[i:i+5])
		}
		r := MemberRecord{Member: nums[0], Until: nums[1], Joined: nums[2], Seen: nums[3]}
		switch promise {
		case "":
		case "=":
			r.PromiseKnown = true
		default:
			r.Promise = []byte(promise)
		}
		f.Members = append(f.Members, r)
	}
	for hot := rest[5*n:]; len(hot) > 0; hot = hot[4:] {
		key, ok := hot[0].(string)
		nums, err := ints(hot[1:4])
		if !ok || err != nil {
			return Fleet{}, fmt.Errorf("unexpected hot key %v", hot[:4])
		}
		f.Hot = append(f.Hot, HotKey{Key: key, Until: nums[0], Room: nums[1], At: nums[2]})
	}
	return f, nil
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
	if err := r.client.ScriptLoad(ctx, syncLua).Err(); err != nil {
		return fmt.Errorf("loading the sync script: %w", err)
	}
	r.loaded.Store(true)
	return nil
}

// run sends the steps listed in todo, in pipelines of at most pipelineSteps,
// and returns those that failed with NOSCRIPT.
func (r *RedisStore) run(ctx context.Context, steps []Step, replies []Reply, todo []int) (noScript []int) {
	for len(todo) > 0 {
		n := min(len(todo), pipelineSteps)
		noScript = append(noScript, r.runPipeline(ctx, steps, replies, todo[:n])...)
		todo = todo[n:]
	}
	return noScript
}

// pipelineSteps bounds one pipeline, so that the store answers it well
// within the client's read timeout: a graceful stop pushes every key held on
// a floor share, 100,000 of them in one pipeline outlasted a 500ms timeout.
const pipelineSteps = 4096

// runPipeline sends the steps listed in todo in one pipeline and returns
// those that failed with NOSCRIPT.
func (r *RedisStore) runPipeline(ctx context.Context, steps []Step, replies []Reply, todo []int) (noScript []int) {
	cmds := make([]*redis.Cmd, len(todo))
	_, _ = r.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for j, i := range todo {
			st := &steps[i]
			args := make([]any, 0, 17+2*len(st.Floor))
			args = append(args, st.Oldest, st.TTL.Milliseconds(), st.Demand, st.Member, st.Now, st.MemberTTL.Milliseconds(), st.Reserve, st.Limit, st.Adds[0].Slot)
			floorID := st.FloorID
			if floorID == "" {
				floorID = "0"
			}
			args = append(args, floorID, len(st.Floor))
			for _, a := range st.Floor {
				args = append(args, a.Slot, a.Count)
			}
			for _, a := range [3]SlotCount{st.Adds[0], st.Adds[1], st.Moved} {
				if a.Count != 0 {
					args = append(args, a.Slot, a.Count)
				}
			}
			cmds[j] = syncScript.EvalSha(ctx, p, []string{st.Key}, args...)
		}
		return nil
	})
	for j, i := range todo {
		res, err := cmds[j].Result()
		if err != nil {
			if redis.HasErrorPrefix(err, "NOSCRIPT") {
				noScript = append(noScript, i)
			}
			replies[i] = Reply{Err: fmt.Errorf("syncing %s: %w", steps[i].Key, err)}
			continue
		}
		replies[i] = parseReply(steps[i].Key, res)
	}
	return noScript
}

func parseReply(key string, res any) Reply {
	vals, ok := res.([]any)
	if !ok || len(vals) < 3 || len(vals)%2 != 1 {
		return Reply{Err: fmt.Errorf("syncing %s: unexpected reply %v", key, res)}
	}
	ints := make([]int64, len(vals))
	for i, v := range vals {
		n, err := toInt(v)
		if err != nil {
			return Reply{Err: fmt.Errorf("syncing %s: %w", key, err)}
		}
		ints[i] = n
	}
	r := Reply{Demand: ints[0], Syncing: ints[1], Reserved: ints[2], Slots: make([]SlotCount, 0, len(ints)/2)}
	for i := 3; i < len(ints); i += 2 {
		r.Slots = append(r.Slots, SlotCount{Slot: ints[i], Count: max(ints[i+1], 0)})
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
