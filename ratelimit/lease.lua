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
-- Field lists go in chunks: unpack has a limit.
local function each(cmd, key, args)
	for i = 1, #args, 1000 do
		redis.call(cmd, key, unpack(args, i, math.min(i + 999, #args)))
	end
end
local key = KEYS[1]
local now, oldest, slot = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[5])
local me, mine = 'g' .. ARGV[4], 'p' .. ARGV[5]
local held = tonumber(ARGV[11])
-- One read, then one write of every field that changes (and one delete).
local counts, pushed, old, set = {}, {}, {}, {}
local used = held
local fields = redis.call('HGETALL', key)
for i = 1, #fields, 2 do
	local f, v = fields[i], fields[i + 1]
	local kind = string.sub(f, 1, 1)
	if f == me then
		old[#old + 1] = f -- given back; set again below if it holds anything
	elseif kind == 'g' then
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
	elseif not tonumber(f) or tonumber(f) < oldest then
		old[#old + 1] = f -- left the window, or not ours (another version's)
	else
		counts[tonumber(f)] = tonumber(v)
	end
end
for i = 14, #ARGV, 2 do
	local s, n = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
	if s >= oldest then
		counts[s] = (counts[s] or 0) + n
		set[#set + 1] = s
		set[#set + 1] = counts[s]
	end
end
if ARGV[6] == '1' and (pushed[slot] or 0) < tonumber(ARGV[7]) then
	-- A mark is never shortened: grants rely on it.
	pushed[slot] = tonumber(ARGV[7])
	set[#set + 1] = mine
	set[#set + 1] = ARGV[7]
	for i = #old, 1, -1 do
		if old[i] == mine then
			table.remove(old, i)
		end
	end
end
local out = { 0, 0, 0 }
for s, n in pairs(counts) do
	used = used + n
	out[#out + 1] = s
	out[#out + 1] = n
end
-- A grant relies on the marks of the other holding slots: it ends with the
-- first of them (marksUntil, 0: none).
local holding, floor, marksUntil = ARGV[10], tonumber(ARGV[8]), 0
for j = 1, #holding do
	if string.byte(holding, j) == 49 then
		local m = pushed[j - 1]
		if not m then
			used = used + floor
		elseif floor > 0 and j - 1 ~= slot and (marksUntil == 0 or m < marksUntil) then
			marksUntil = m
		end
	end
end
local room = tonumber(ARGV[9]) - used
-- Past the room, what it holds is cut back (a negative grant).
local grant = math.max(math.min(tonumber(ARGV[12]), room), -held)
if grant + held > 0 then
	set[#set + 1] = me
	set[#set + 1] = (grant + held) .. ' ' .. ARGV[13]
	for i = #old, 1, -1 do
		if old[i] == me then
			table.remove(old, i)
		end
	end
end
if #set > 0 then
	each('HSET', key, set)
end
if #old > 0 then
	each('HDEL', key, old)
end
if #set > 0 or #fields > 0 then
	redis.call('PEXPIRE', key, ARGV[3])
end
out[1], out[2], out[3] = grant, room - grant, marksUntil
return out
