-- One reconcile step of one key: a hash with a field per slot (the slot number),
-- the field "d" (the key's demand counter), and a field per instance that
-- syncs the key ("-" and the instance's number, so that a field never reads
-- as a slot that counts) holding until when (Unix ms), and a field per floor
-- push applied ("-f" and its id) holding until when it is remembered.
-- KEYS[1]  the key
-- ARGV[1]  the oldest slot that still counts; older fields are dropped
-- ARGV[2]  the expiry to re-arm, in milliseconds
-- ARGV[3]  demand to add
-- ARGV[4]  the instance's number, or 0
-- ARGV[5]  now, Unix ms
-- ARGV[6]  the instance's registration lasts this long, in ms (0: deregister)
-- ARGV[7]  admits to reserve ahead of time (0: none), in slot ARGV[9], as far
--          as the window's count stays within ARGV[8]
-- ARGV[10] the id of the floor push (pairs of ARGV[12…]), "0" if none: it is
--          applied once, whatever the times it is sent
-- ARGV[11] how many pairs of slot and count the floor push holds
-- ARGV[12…] the floor push's pairs, then pairs of slot and count to add
-- Returns { demand, syncing, reserved, slot, count, slot, count, … } for the
-- slots that count, where syncing is how many other instances are
-- registered and reserved how many admits were reserved.
local key = KEYS[1]
local oldest = tonumber(ARGV[1])
local rest = 12 + 2 * tonumber(ARGV[11])
if ARGV[10] == '0' or redis.call('HSETNX', key, '-f' .. ARGV[10], tonumber(ARGV[5]) + tonumber(ARGV[2])) == 1 then
	for i = 12, rest - 1, 2 do
		if tonumber(ARGV[i]) >= oldest then
			redis.call('HINCRBY', key, ARGV[i], ARGV[i + 1])
		end
	end
end
for i = rest, #ARGV, 2 do
	if tonumber(ARGV[i]) >= oldest then
		redis.call('HINCRBY', key, ARGV[i], ARGV[i + 1])
	end
end
if tonumber(ARGV[3]) > 0 then
	redis.call('HINCRBY', key, 'd', ARGV[3])
end
local self = '-' .. ARGV[4]
local now = tonumber(ARGV[5])
local ttl = tonumber(ARGV[6])
local fields = redis.call('HGETALL', key)
local out = { 0, 0, 0 }
local used = 0
local old = {}
local mine = nil -- this instance's registration (until when), if any
for i = 1, #fields, 2 do
	local f = fields[i]
	if f == 'd' then
		out[1] = tonumber(fields[i + 1])
	elseif string.sub(f, 1, 1) == '-' then
		if tonumber(fields[i + 1]) <= now then
			old[#old + 1] = f
		elseif string.sub(f, 2, 2) == 'f' then
			-- a floor push applied: no registration
		elseif f == self then
			mine = tonumber(fields[i + 1])
		else
			out[2] = out[2] + 1
		end
	elseif tonumber(f) < oldest then
		old[#old + 1] = f
	else
		out[#out + 1] = tonumber(f)
		out[#out + 1] = tonumber(fields[i + 1])
		used = used + tonumber(fields[i + 1])
	end
end
local reserve = math.min(tonumber(ARGV[7]), tonumber(ARGV[8]) - used)
if reserve > 0 then
	redis.call('HINCRBY', key, ARGV[9], reserve)
	out[3] = reserve
	out[#out + 1] = tonumber(ARGV[9])
	out[#out + 1] = reserve -- the slot's count is the largest one returned
	for i = 4, #out - 2, 2 do
		if out[i] == out[#out - 1] then
			out[#out] = out[#out] + out[i + 1]
		end
	end
end
if ARGV[4] ~= '0' then
	-- A registration is renewed once half its life is spent, not by every
	-- step; it is dropped at once.
	if ttl > 0 and (mine == nil or mine < now + ttl / 2) then
		redis.call('HSET', key, self, now + ttl)
	elseif ttl == 0 and mine ~= nil then
		old[#old + 1] = self
	end
end
if #old > 0 then
	redis.call('HDEL', key, unpack(old))
end
if #fields > 0 or reserve > 0 or (ARGV[4] ~= '0' and ttl > 0) then
	redis.call('PEXPIRE', key, ARGV[2])
end
return out
