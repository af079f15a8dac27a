-- One lease call of one key (see Lease in store.go; MemoryStore.lease takes the
-- same steps, and TestStoreTwinsAgree holds the two to one another). The key
-- is a hash:
--   "<time slot>"  the admits pushed into that time slot
--   "g<member>"    "<count> <until>": an instance's grant, counted until then
--   "p<slot>"      the life of the instance slot's holder that marked the key:
--                  it pushed its floor admits and admits the key on leases only
--   "h"            "<since> <last>": the key's hot period, which lasts while
--                  hot calls come no more than a gap apart; a new one clears
--                  the marks
-- KEYS[1] the key
-- ARGV[1] now (Unix ms)         ARGV[2] the oldest time slot that counts
-- ARGV[3] the key's expiry (ms) ARGV[4] the member (instance id)
-- ARGV[5] its instance slot (-1: none)   ARGV[6] that slot's life (Unix ms)
-- ARGV[7] 1: a hot call (it marks the slot and keeps the period), 0: a push
-- ARGV[8] the floor F           ARGV[9] events   ARGV[10] max instances
-- ARGV[11] settle (ms): a life that began this long after the period did has
--          heard the key is hot and keeps it off its floor
-- ARGV[12] gap (ms)             ARGV[13] held    ARGV[14] want
-- ARGV[15] the grant counts until (Unix ms)
-- ARGV[16] 1: the lives of the slots follow, 0: unknown (every floor is held)
-- ARGV[17] n, then n triples: instance slot, its holder's life, the life
--          before it (0: none) whose floor admits may still count
-- then pairs of time slot and admits to push.
-- Returns { granted, room left, holders of grants }.
local function each(cmd, key, args)
	for i = 1, #args, 1000 do -- unpack has a limit
		redis.call(cmd, key, unpack(args, i, math.min(i + 999, #args)))
	end
end
local set, old = {}, {}
local function put(f, v)
	set[#set + 1] = f
	set[#set + 1] = v
end
local key, now, oldest = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local me, slot, life = 'g' .. ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local hot, floor, events = ARGV[7] == '1', tonumber(ARGV[8]), tonumber(ARGV[9])
local settle, gap, held, want = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14])
local used, holders, counts, marks = held, 1, {}, {}
local since, last, had
local fields = redis.call('HGETALL', key)
for i = 1, #fields, 2 do
	local f, v = fields[i], fields[i + 1]
	local kind = string.sub(f, 1, 1)
	if f == me then
		had = true -- given back; set again below if it holds anything
	elseif kind == 'g' then
		local n, u = string.match(v, '^(%d+) (%d+)$')
		if tonumber(u) <= now then
			old[#old + 1] = f
		else
			used, holders = used + tonumber(n), holders + 1
		end
	elseif kind == 'p' then
		marks[tonumber(string.sub(f, 2))] = tonumber(v)
	elseif f == 'h' then
		local s, l = string.match(v, '^(%d+) (%d+)$')
		since, last = tonumber(s), tonumber(l)
	elseif not tonumber(f) or tonumber(f) < oldest then
		old[#old + 1] = f -- left the window, or not ours (another version's)
	else
		counts[tonumber(f)] = tonumber(v)
	end
end
if not since or now - last > gap then
	-- A new hot period: the marks were of the last one. A push alone only
	-- reads as if it began one.
	since = now
	for j in pairs(marks) do
		if hot then
			old[#old + 1] = 'p' .. j
		end
		marks[j] = nil
	end
end
if hot then
	put('h', since .. ' ' .. now)
	if slot >= 0 then
		marks[slot] = life
		put('p' .. slot, life)
	end
end
for i = 18 + 3 * tonumber(ARGV[17]), #ARGV, 2 do
	local s, n = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
	if s >= oldest then
		counts[s] = (counts[s] or 0) + n
		put(s, counts[s])
	end
end
for _, n in pairs(counts) do
	used = used + n
end
-- Each slot whose floor may hold admits the store has not seen holds F back:
-- every slot while the period is young (a life may not have heard yet), and
-- after that each slot with a life older than that which did not mark.
local settled = since + settle
local reserved = floor * tonumber(ARGV[10])
if now >= settled and ARGV[16] == '1' then
	reserved = 0
	for i = 18, 17 + 3 * tonumber(ARGV[17]), 3 do
		local m = marks[tonumber(ARGV[i])]
		for _, x in ipairs({ tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]) }) do
			if x > 0 and x < settled and x ~= m then
				reserved = reserved + floor
				break
			end
		end
	end
end
local room = events - used - reserved
-- Past the room, what it holds is cut back (a negative grant).
local grant = math.max(math.min(want, room), -held)
if grant + held > 0 then
	put(me, (grant + held) .. ' ' .. ARGV[15])
else
	holders = holders - 1
	if had then
		old[#old + 1] = me
	end
end
-- Deletes first: a mark a new period cleared may be set again.
if #old > 0 then
	each('HDEL', key, old)
end
if #set > 0 then
	each('HSET', key, set)
end
if #set > 0 or #fields > 0 then
	redis.call('PEXPIRE', key, ARGV[3])
end
return { grant, room - grant, holders }
