-- One lease call of one key (see Lease in store.go, whose MemoryStore runs the
-- same steps; TestStoreTwinsAgree holds them to one another). The key is a
-- hash: a field per time slot (its pushed admits), "g<member>" = "<count>
-- <until>" (an instance's outstanding grant, counted until then) and
-- "p<slot>" = until (the instance slot pushed its floor admits of the key).
-- KEYS[1]  the key
-- ARGV[1]  now (Unix ms)          ARGV[2]  the oldest time slot that counts
-- ARGV[3]  the key's expiry (ms)  ARGV[4]  the member (instance id)
-- ARGV[5]  its instance slot (-1: none)
-- ARGV[6]  1: mark the slot pushed until ARGV[7] (a mark is never shortened:
--          grants rely on it)
-- ARGV[8]  the floor F           ARGV[9]  events
-- ARGV[10] holding: "1" at position j+1 for each instance slot j that may
--          hold floor admits of any key
-- ARGV[11] admits of its grant the member still holds
-- ARGV[12] admits it asks for     ARGV[13] the grant counts until (Unix ms)
-- ARGV[14…] pairs of time slot and admits to push
-- Returns { granted, room, marks until, slot, count, … }: room is what is left after the
-- grant (events − pushed − grants − F per holding slot not pushed); a
-- negative grant takes back part of what it held.
local key = KEYS[1]
local now, oldest = tonumber(ARGV[1]), tonumber(ARGV[2])
local me = 'g' .. ARGV[4]
redis.call('HDEL', key, me)
for i = 14, #ARGV, 2 do
	if tonumber(ARGV[i]) >= oldest then
		redis.call('HINCRBY', key, ARGV[i], ARGV[i + 1])
	end
end
if ARGV[6] == '1' then
	local cur = tonumber(redis.call('HGET', key, 'p' .. ARGV[5]))
	if not cur or cur < tonumber(ARGV[7]) then
		redis.call('HSET', key, 'p' .. ARGV[5], ARGV[7])
	end
end
local held = tonumber(ARGV[11])
local used, old, out, pushed = held, {}, { 0, 0, 0 }, {}
local fields = redis.call('HGETALL', key)
for i = 1, #fields, 2 do
	local f, v = fields[i], fields[i + 1]
	local kind = string.sub(f, 1, 1)
	if kind == 'g' then
		local n, u = string.match(v, '^(%d+) (%d+)$')
		if tonumber(u) <= now then
			old[#old + 1] = f
		else
			used = used + tonumber(n)
		end
	elseif kind == 'p' then
		if tonumber(v) <= now then
			old[#old + 1] = f
		else
			pushed[tonumber(string.sub(f, 2))] = tonumber(v)
		end
	elseif tonumber(f) < oldest then
		old[#old + 1] = f
	else
		used = used + tonumber(v)
		out[#out + 1] = tonumber(f)
		out[#out + 1] = tonumber(v)
	end
end
-- A grant relies on the marks of the other holding slots: it ends with the
-- first of them (marksUntil, 0: none).
local holding, floor, marksUntil = ARGV[10], tonumber(ARGV[8]), 0
for j = 1, #holding do
	if string.byte(holding, j) == 49 then
		local m = pushed[j - 1]
		if not m then
			used = used + floor
		elseif floor > 0 and j - 1 ~= tonumber(ARGV[5]) and (marksUntil == 0 or m < marksUntil) then
			marksUntil = m
		end
	end
end
local room = tonumber(ARGV[9]) - used
-- Past the room, what it holds is cut back (a negative grant).
local grant = math.max(math.min(tonumber(ARGV[12]), room), -held)
if grant + held > 0 then
	redis.call('HSET', key, me, (grant + held) .. ' ' .. ARGV[13])
end
if #old > 0 then
	redis.call('HDEL', key, unpack(old))
end
redis.call('PEXPIRE', key, ARGV[3])
out[1], out[2], out[3] = grant, room - grant, marksUntil
return out
