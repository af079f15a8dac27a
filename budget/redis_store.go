package budget

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// A reservation's record is a hash: s is its state ("r" reserved, "x" a
// tombstone), n the last extension applied, and h<i> what it holds of the
// i-th counter (1-based, in the order of the reserve's charges), so a settle
// moves each counter from what is held, whatever extensions applied, to what
// was used. For the fleet's sweep of a silent instance's reservations
// (redis_lapse.go) it also names its owner (o), each counter (k<i>) and its
// ttl_ms (t<i>), and, once granted, the grant's number (q) and what a lapse
// returns of each counter (u<i>).

// reserveScript checks every counter against its limit in force, then
// charges every counter and writes the reservation's record, in one
// server-side step: no other client can run between the check and the
// charge, and a denial charges nothing. A counter's limit in force is its
// field of the override table when the table holds one, read here so that an
// override set on any instance applies at the next reserve of every other
// without a call of its own. A record that exists already means the
// reservation was released before this script ran: nothing is charged. A
// charge of 0 writes no counter.
//
// An admitted reservation joins its owner's open set, and its owner's last
// word (in the owners' sorted set, by the store's clock) is now.
//
// KEYS[1]: the record; KEYS[2..n+1]: the counters; KEYS[n+2], if given: the
// override table; then the owners' set and the owner's open set.
// ARGV[1]: record ttl_ms; then amount, limit, ttl_ms and override field (""
// for none) for each counter in order; last, the owner. Returns {admitted
// (0|1|-1 cancelled), denied index (1-based, 0 if admitted), used..., limits
// in force...}.
var reserveScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {-1, 0}
end
local n = (#ARGV - 2) / 4
local owner, owners, open = ARGV[#ARGV], KEYS[#KEYS-1], KEYS[#KEYS]
local limits = {}
for i = 1, n do
  limits[i] = tonumber(ARGV[4*i-1])
end
if #KEYS == n + 4 then
  local fields, at = {}, {}
  for i = 1, n do
    if ARGV[4*i+1] ~= '' then
      fields[#fields+1] = ARGV[4*i+1]
      at[#fields] = i
    end
  end
  if #fields > 0 then
    local set = redis.call('HMGET', KEYS[n+2], unpack(fields))
    for j = 1, #fields do
      if set[j] then
        limits[at[j]] = tonumber(set[j])
      end
    end
  end
end
local used = {}
local denied = 0
for i = 1, n do
  used[i] = tonumber(redis.call('GET', KEYS[i+1]) or '0')
  if denied == 0 and used[i] + tonumber(ARGV[4*i-2]) > limits[i] then
    denied = i
  end
end
local out = {0, denied}
if denied == 0 then
  local record = {'s', 'r', 'o', owner}
  for i = 1, n do
    if tonumber(ARGV[4*i-2]) ~= 0 then
      used[i] = redis.call('INCRBY', KEYS[i+1], ARGV[4*i-2])
      redis.call('PEXPIRE', KEYS[i+1], ARGV[4*i])
    end
    local c = #record
    record[c+1], record[c+2] = 'h' .. i, ARGV[4*i-2]
    record[c+3], record[c+4] = 'k' .. i, KEYS[i+1]
    record[c+5], record[c+6] = 't' .. i, ARGV[4*i]
  end
  redis.call('HSET', KEYS[1], unpack(record))
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  redis.call('SADD', open, KEYS[1])
  redis.call('PEXPIRE', open, ARGV[1])
  local t = redis.call('TIME')
  redis.call('ZADD', owners, t[1] * 1000 + math.floor(t[2] / 1000), owner)
  redis.call('PEXPIRE', owners, ARGV[1])
  out[1] = 1
end
for i = 1, n do
  out[#out+1] = used[i]
end
for i = 1, n do
  out[#out+1] = limits[i]
end
return out
`)

// extendScript adds an extension to a reserved record's counters if each
// stays within its limit, and nothing otherwise, once: extension n applies
// only after n-1, and a repeat (its reply was lost) answers admitted without
// charging again. A record that is not reserved (settled, expired, lost with
// the store's data) admits nothing.
//
// KEYS[1]: the record; KEYS[2..]: its counters, in the reserve's order.
// ARGV[1]: the extension's number (1, 2, ...); then amount, limit, ttl_ms
// for each counter. Returns {admitted (0|1|2 applied before|-1 no
// reservation), denied index (1-based), used...}.
var extendScript = redis.NewScript(`
local rec = redis.call('HMGET', KEYS[1], 's', 'n')
if rec[1] ~= 'r' then
  return {-1, 0}
end
local seq = tonumber(ARGV[1])
local used = {}
for i = 2, #KEYS do
  used[i-1] = tonumber(redis.call('GET', KEYS[i]) or '0')
end
local applied = tonumber(rec[2] or '0')
if applied >= seq then
  return {2, 0, unpack(used)}
end
if applied ~= seq - 1 then
  return {-1, 0}
end
for i = 2, #KEYS do
  if used[i-1] + tonumber(ARGV[3*i-4]) > tonumber(ARGV[3*i-3]) then
    return {0, i-1, unpack(used)}
  end
end
for i = 2, #KEYS do
  if tonumber(ARGV[3*i-4]) ~= 0 then
    used[i-1] = redis.call('INCRBY', KEYS[i], ARGV[3*i-4])
    redis.call('PEXPIRE', KEYS[i], ARGV[3*i-2])
    redis.call('HINCRBY', KEYS[1], 'h' .. (i-1), ARGV[3*i-4])
  end
end
redis.call('HSET', KEYS[1], 'n', seq)
return {1, 0, unpack(used)}
`)

// settleScript moves a reservation's counters from what its record holds to
// what was used, once, to a reserved record only, and deletes the record: a
// repeat after a lost reply finds none and is a no-op, and a release that
// arrives before its reserve leaves a tombstone that cancels the reserve. A
// counter that falls to 0 is deleted, so a released request (an upstream's
// 401 to a stranger) leaves no key behind.
//
// Two things ride on the settle, which is where a counter's value is known
// for sure (a reserve's may be released): a counter with a member keeps its
// value as the member's score in its window's top set, which holds the
// TopSize largest, so the top spenders are read without a scan, exactly,
// from a set as small as that and gone with the window; and a counter with
// alerts marks, in its window's alerted hash, each alert amount it reached
// first (HSETNX): the one settle of the whole fleet that does reports it.
//
// KEYS[1]: the record; KEYS[2..n+1]: its counters, in the reserve's order;
// then, for each counter in order, its top set if it has a member and its
// alerted hash if it has alerts; last, the owners' set and its owner's open
// set (an owner with nothing open leaves the owners' set). ARGV[1]: ttl_ms
// of a tombstone; then, for each counter, amount (-1: keep what is held),
// ttl_ms, member ("" for none) and alerts ("<amount> <field> ...", "" for
// none); last, the owner. Returns {0} if not applied, else {1, then each
// counter's alerts reached first (a bit each, in order) and value after}.
var settleScript = redis.NewScript(`
local n = (#ARGV - 2) / 4
local rec_owner = ARGV[#ARGV]
local fields = {'s'}
for i = 1, n do
  fields[i+1] = 'h' .. i
end
local rec = redis.call('HMGET', KEYS[1], unpack(fields))
if rec[1] ~= 'r' then
  if not rec[1] then
    redis.call('HSET', KEYS[1], 's', 'x')
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
  end
  return {0}
end
local out = {1}
local k = n + 1
for i = 1, n do
  local amount, ttl, member, alerts = tonumber(ARGV[4*i-2]), ARGV[4*i-1], ARGV[4*i], ARGV[4*i+1]
  local v
  if amount >= 0 then
    local held = tonumber(rec[i+1] or '0')
    v = redis.call('INCRBY', KEYS[i+1], amount - held)
    if v <= 0 then
      redis.call('DEL', KEYS[i+1])
    else
      redis.call('PEXPIRE', KEYS[i+1], ttl)
    end
  else
    v = tonumber(redis.call('GET', KEYS[i+1]) or '0')
  end
  if member ~= '' then
    k = k + 1
    if v > 0 then
      redis.call('ZADD', KEYS[k], v, member)
      if redis.call('ZCARD', KEYS[k]) > ` + strconv.Itoa(TopSize) + ` then
        redis.call('ZREMRANGEBYRANK', KEYS[k], 0, -` + strconv.Itoa(TopSize+1) + `)
      end
      redis.call('PEXPIRE', KEYS[k], ttl)
    else
      redis.call('ZREM', KEYS[k], member)
    end
  end
  local crossed = 0
  if alerts ~= '' then
    k = k + 1
    local bit = 1
    for at, field in string.gmatch(alerts, '(%d+) (%S+)') do
      if v >= tonumber(at) and redis.call('HSETNX', KEYS[k], field, v) == 1 then
        crossed = crossed + bit
        redis.call('PEXPIRE', KEYS[k], ttl)
      end
      bit = bit * 2
    end
  end
  out[#out+1] = crossed
  out[#out+1] = v
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[#KEYS], KEYS[1])
if redis.call('SCARD', KEYS[#KEYS]) == 0 then
  redis.call('ZREM', KEYS[#KEYS-1], rec_owner)
end
return out
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

// scriptInput starts the KEYS and ARGV of a script call: the record and the
// script's first argument, with room for n counters of perCounter arguments
// each.
func scriptInput(record string, first any, n, perCounter int) ([]string, []any) {
	keys := make([]string, 1, 1+n)
	args := make([]any, 1, 1+perCounter*n)
	keys[0], args[0] = record, first
	return keys, args
}

// chargesInput is the KEYS and ARGV of a script that charges: the record,
// first, then each counter's amount, limit and ttl.
func chargesInput(record string, first any, charges []Charge) ([]string, []any) {
	keys, args := scriptInput(record, first, len(charges), 3)
	for _, c := range charges {
		keys = append(keys, c.Key)
		args = append(args, c.Amount, c.Limit, c.TTL.Milliseconds())
	}
	return keys, args
}

// reserveInput is the KEYS and ARGV of reserveScript: the record, each
// counter, and the override table the charges name, if any.
func reserveInput(rec Record, recordTTL time.Duration, charges []Charge) ([]string, []any, error) {
	keys, args := scriptInput(rec.Key, recordTTL.Milliseconds(), len(charges)+3, 4)
	table := ""
	for _, c := range charges {
		keys = append(keys, c.Key)
		args = append(args, c.Amount, c.Limit, c.TTL.Milliseconds(), c.Override)
		if c.Overrides != "" {
			if table != "" && table != c.Overrides {
				return nil, nil, fmt.Errorf("budget reserve: charges name two override tables, %s and %s", table, c.Overrides)
			}
			table = c.Overrides
		}
	}
	if table != "" {
		keys = append(keys, table)
	}
	keys = append(keys, rec.Owners, rec.open())
	args = append(args, rec.Owner)
	return keys, args, nil
}

// Reserve implements Store.
func (r *RedisStore) Reserve(ctx context.Context, rec Record, recordTTL time.Duration, charges []Charge) (ReserveResult, error) {
	keys, args, err := reserveInput(rec, recordTTL, charges)
	if err != nil {
		return ReserveResult{}, err
	}
	vals, err := reserveScript.Run(ctx, r.client, keys, args...).Int64Slice()
	if err != nil {
		return ReserveResult{}, fmt.Errorf("budget reserve script: %w", err)
	}
	if len(vals) == 2 && vals[0] == -1 {
		return ReserveResult{Cancelled: true, Denied: -1}, nil
	}
	n := len(charges)
	if len(vals) != 2+2*n {
		return ReserveResult{}, fmt.Errorf("budget reserve script: %d values for %d budgets", len(vals), n)
	}
	return ReserveResult{Admitted: vals[0] == 1, Denied: int(vals[1]) - 1, Used: vals[2 : 2+n], Limits: vals[2+n:]}, nil
}

// SetOverride implements Store.
func (r *RedisStore) SetOverride(ctx context.Context, table, field string, limit int64) error {
	var err error
	if limit > 0 {
		err = r.client.HSet(ctx, table, field, limit).Err()
	} else {
		err = r.client.HDel(ctx, table, field).Err()
	}
	if err != nil {
		return fmt.Errorf("budget override: %w", err)
	}
	return nil
}

// Override implements Store.
func (r *RedisStore) Override(ctx context.Context, table, field string) (int64, error) {
	n, err := r.client.HGet(ctx, table, field).Int64()
	if errors.Is(err, redis.Nil) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("budget override: %w", err)
	}
	return n, nil
}

// settleInput is the KEYS and ARGV of settleScript.
func settleInput(rec Record, ttl time.Duration, adjs []Adjustment) ([]string, []any) {
	keys, args := scriptInput(rec.Key, ttl.Milliseconds(), 3*len(adjs)+1, 4)
	for _, a := range adjs {
		keys = append(keys, a.Key)
		args = append(args, a.Amount, a.TTL.Milliseconds(), a.Member, alertsArg(a.Alerts))
	}
	for _, a := range adjs {
		if a.Member != "" {
			keys = append(keys, a.Top)
		}
		if len(a.Alerts) > 0 {
			keys = append(keys, a.Alerted)
		}
	}
	return append(keys, rec.Owners, rec.open()), append(args, rec.Owner)
}

// alertsArg is alerts as settleScript reads them: "<amount> <field> ...".
func alertsArg(alerts []Alert) string {
	var b strings.Builder
	for i, al := range alerts {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(strconv.FormatInt(al.At, 10) + " " + al.Field)
	}
	return b.String()
}

// Settle implements Store.
func (r *RedisStore) Settle(ctx context.Context, rec Record, ttl time.Duration, adjs []Adjustment) (bool, error) {
	keys, args := settleInput(rec, ttl, adjs)
	vals, err := settleScript.Run(ctx, r.client, keys, args...).Int64Slice()
	if err != nil {
		return false, fmt.Errorf("budget settle script: %w", err)
	}
	if len(vals) == 1 && vals[0] == 0 {
		return false, nil
	}
	if len(vals) != 1+2*len(adjs) {
		return false, fmt.Errorf("budget settle script: %d values for %d budgets", len(vals), len(adjs))
	}
	for i := range adjs {
		adjs[i].Crossed, adjs[i].After = crossedOf(vals[1+2*i], len(adjs[i].Alerts)), vals[2+2*i]
	}
	return true, nil
}

// crossedOf is the indexes of the bits set in mask, of n.
func crossedOf(mask int64, n int) []int {
	var out []int
	for j := range n {
		if mask&(1<<j) != 0 {
			out = append(out, j)
		}
	}
	return out
}

// Extend implements Store.
func (r *RedisStore) Extend(ctx context.Context, record string, seq int, charges []Charge) (ExtendResult, error) {
	keys, args := chargesInput(record, seq, charges)
	vals, err := extendScript.Run(ctx, r.client, keys, args...).Int64Slice()
	if err != nil {
		return ExtendResult{}, fmt.Errorf("budget extend script: %w", err)
	}
	if len(vals) == 2 && vals[0] == -1 {
		return ExtendResult{Gone: true, Denied: -1}, nil
	}
	if len(vals) != 2+len(charges) {
		return ExtendResult{}, fmt.Errorf("budget extend script: %d values for %d budgets", len(vals), len(charges))
	}
	return ExtendResult{Admitted: vals[0] >= 1, Denied: int(vals[1]) - 1, Used: vals[2:]}, nil
}

// Ping implements Store.
func (r *RedisStore) Ping(ctx context.Context) error {
	if err := r.client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("budget store: %w", err)
	}
	return nil
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

// Reset implements Store. The keys of one call share a hash tag, so the one
// DEL also runs on Redis Cluster.
func (r *RedisStore) Reset(ctx context.Context, keys []string) error {
	if len(keys) == 0 {
		return nil
	}
	if err := r.client.Del(ctx, keys...).Err(); err != nil {
		return fmt.Errorf("budget reset: %w", err)
	}
	return nil
}

// Top implements Store.
func (r *RedisStore) Top(ctx context.Context, top string, n int) ([]TopEntry, error) {
	zs, err := r.client.ZRevRangeWithScores(ctx, top, 0, int64(n)-1).Result()
	if err != nil {
		return nil, fmt.Errorf("budget top: %w", err)
	}
	out := make([]TopEntry, len(zs))
	for i, z := range zs {
		out[i] = TopEntry{Member: z.Member.(string), Used: int64(z.Score)}
	}
	return out, nil
}

// markOnceScript sets a field of a hash if it is not set, and gives a new
// hash its TTL, in one step. KEYS[1]: the hash; ARGV[1]: the field;
// ARGV[2]: ttl_ms. Returns 1 if this call set it.
var markOnceScript = redis.NewScript(`
if redis.call('HSETNX', KEYS[1], ARGV[1], 1) == 0 then
  return 0
end
if redis.call('PTTL', KEYS[1]) < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
`)

// MarkOnce implements Store.
func (r *RedisStore) MarkOnce(ctx context.Context, marks, field string, ttl time.Duration) (bool, error) {
	n, err := markOnceScript.Run(ctx, r.client, []string{marks}, field, ttl.Milliseconds()).Int64()
	if err != nil {
		return false, fmt.Errorf("budget mark: %w", err)
	}
	return n == 1, nil
}
