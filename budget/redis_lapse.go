package budget

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// storeNow is the store's clock in milliseconds, read by a script: every
// owner's last word and every lapse are on it, so the instances' clocks
// need not agree.
const storeNow = `
local function store_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
`

// grantScript makes now the owner's last word and writes each grant whose
// number is above its record's last.
//
// KEYS[1]: the owners' set; KEYS[2]: the owner's open set; KEYS[3..]: the
// records. ARGV[1]: the owner; ARGV[2]: ttl_ms of the owners' and open sets;
// then, for each record, the grant's number, its count of counters c, and
// c returns. Returns, for each record, 1 if it is not reserved, else 0.
var grantScript = redis.NewScript(storeNow + `
redis.call('ZADD', KEYS[1], store_now(), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
local out, a = {}, 3
for r = 3, #KEYS do
  local seq, c = tonumber(ARGV[a]), tonumber(ARGV[a+1])
  local rec = redis.call('HMGET', KEYS[r], 's', 'q')
  if rec[1] ~= 'r' then
    out[#out+1] = 1
  else
    out[#out+1] = 0
    if seq > tonumber(rec[2] or '0') then
      local fields = {'q', seq}
      for i = 1, c do
        fields[#fields+1] = 'u' .. i
        fields[#fields+1] = ARGV[a+1+i]
      end
      redis.call('HSET', KEYS[r], unpack(fields))
    end
  end
  a = a + 2 + c
end
return out
`)

// sweepScript settles the open reservations of owners silent for the lapse.
// The counters it moves are named by the records, not in KEYS: they share
// the records' hash tag, so they are on the script's Cluster slot.
//
// KEYS[1]: the owners' set. ARGV[1]: lapse_ms; ARGV[2]: the owner not to
// sweep; ARGV[3]: the most reservations to settle; ARGV[4]: a tombstone's
// ttl_ms. Returns how many it settled.
var sweepScript = redis.NewScript(storeNow + `
local silent = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', store_now() - tonumber(ARGV[1]), 'LIMIT', 0, 16)
local settled, most = 0, tonumber(ARGV[3])
for _, owner in ipairs(silent) do
  if owner ~= ARGV[2] and settled < most then
    local open = KEYS[1] .. ':' .. owner
    for _, key in ipairs(redis.call('SPOP', open, most - settled)) do
      local rec = redis.call('HGETALL', key)
      local f = {}
      for j = 1, #rec, 2 do
        f[rec[j]] = rec[j+1]
      end
      if f.s == 'r' then
        local i = 1
        while f['k' .. i] do
          local back = math.min(tonumber(f['u' .. i] or '0'), tonumber(f['h' .. i]))
          if back > 0 then
            local v = redis.call('INCRBY', f['k' .. i], -back)
            if v <= 0 then
              redis.call('DEL', f['k' .. i])
            else
              redis.call('PEXPIRE', f['k' .. i], f['t' .. i])
            end
          end
          i = i + 1
        end
        redis.call('DEL', key)
        redis.call('HSET', key, 's', 'x')
        redis.call('PEXPIRE', key, ARGV[4])
        settled = settled + 1
      end
    end
    if redis.call('SCARD', open) == 0 then
      redis.call('ZREM', KEYS[1], owner)
    end
  end
end
return settled
`)

// Grant implements Store.
func (r *RedisStore) Grant(ctx context.Context, owners, owner string, grants []Grant) ([]bool, error) {
	keys := make([]string, 2, 2+len(grants))
	keys[0], keys[1] = owners, openKey(owners, owner)
	args := []any{owner, recordTTL.Milliseconds()}
	for _, g := range grants {
		keys = append(keys, g.Record)
		args = append(args, g.Seq, len(g.Returns))
		for _, u := range g.Returns {
			args = append(args, u)
		}
	}
	vals, err := grantScript.Run(ctx, r.client, keys, args...).Int64Slice()
	if err != nil {
		return nil, fmt.Errorf("budget grant script: %w", err)
	}
	if len(vals) != len(grants) {
		return nil, fmt.Errorf("budget grant script: %d answers for %d grants", len(vals), len(grants))
	}
	gone := make([]bool, len(grants))
	for i, v := range vals {
		gone[i] = v == 1
	}
	return gone, nil
}

// Sweep implements Store.
func (r *RedisStore) Sweep(ctx context.Context, owners, except string, lapse time.Duration, n int) (int, error) {
	settled, err := sweepScript.Run(ctx, r.client, []string{owners}, lapse.Milliseconds(), except, n, settledTTL.Milliseconds()).Int()
	if err != nil {
		return 0, fmt.Errorf("budget sweep script: %w", err)
	}
	return settled, nil
}
