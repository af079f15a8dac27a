-- One reconcile step of one key: a hash with a field per slot (the slot number)
-- and the field "d" (the key's demand counter).
-- KEYS[1]  the key
-- ARGV[1]  the oldest slot that still counts; older fields are dropped
-- ARGV[2]  the expiry to re-arm, in milliseconds
-- ARGV[3]  demand to add
-- ARGV[4…] pairs of slot and count to add
-- Returns { demand, slot, count, slot, count, … } for the slots that count.
local key = KEYS[1]
local oldest = tonumber(ARGV[1])
for i = 4, #ARGV, 2 do
	if tonumber(ARGV[i]) >= oldest then
		redis.call('HINCRBY', key, ARGV[i], ARGV[i + 1])
	end
end
if tonumber(ARGV[3]) > 0 then
	redis.call('HINCRBY', key, 'd', ARGV[3])
end
local fields = redis.call('HGETALL', key)
if #fields == 0 then
	return { 0 }
end
local out = { 0 }
local old = {}
for i = 1, #fields, 2 do
	local f = fields[i]
	if f == 'd' then
		out[1] = tonumber(fields[i + 1])
	elseif tonumber(f) < oldest then
		old[#old + 1] = f
	else
		out[#out + 1] = tonumber(f)
		out[#out + 1] = tonumber(fields[i + 1])
	end
end
if #old > 0 then
	redis.call('HDEL', key, unpack(old))
end
redis.call('PEXPIRE', key, ARGV[2])
return out
