-- The fleet's membership: a hash of instance number -> live until (Unix ms).
-- KEYS[1]  the membership hash
-- ARGV[1]  this instance's number
-- ARGV[2]  now, Unix ms
-- ARGV[3]  how long this heartbeat lasts, in ms
-- Returns { how many instances are live, this one included; 1 if the hash
-- was there before this heartbeat, 0 if not (a new fleet, or a store that
-- restarted empty) }.
local key = KEYS[1]
local now = tonumber(ARGV[2])
local existed = redis.call('EXISTS', key)
redis.call('HSET', key, ARGV[1], now + tonumber(ARGV[3]))
local fields = redis.call('HGETALL', key)
local live = 0
local old = {}
for i = 1, #fields, 2 do
	if tonumber(fields[i + 1]) <= now then
		old[#old + 1] = fields[i]
	else
		live = live + 1
	end
end
if #old > 0 then
	redis.call('HDEL', key, unpack(old))
end
redis.call('PEXPIRE', key, 2 * tonumber(ARGV[3]))
return { live, existed }
