-- One lease call of one key (see Lease in store.go; MemoryStore.lease takes the
-- same steps, and TestStoreTwinsAgree holds the two to one another). The key
-- is a hash:
--   "<time slot>"  the admits pushed into that time slot
--   "g<member>"    "<count> <until>": an instance's grant, counted until then
--   "m<life>"      that life pushed its floor admits of the key and admits
--                  it on leases only, for the rest of the hot period
--   "h"            "<since> <last>": the key's hot period, which lasts while
--                  hot calls come no more than a gap apart; a new one drops
--                  the marks
-- KEYS[1] the key
-- ARGV[1] now (Unix ms)          ARGV[2] the oldest time slot that counts
-- ARGV[3] the key's expiry (ms)  ARGV[4] the member (instance id)
-- ARGV[5] its life (0: it holds no slot)
-- ARGV[6] 1: a hot call (it marks the life and keeps the period), 0: a push
-- ARGV[7] the floor F            ARGV[8] events   ARGV[9] max instances
-- ARGV[10] settle (ms): a life that began this long after the period did has
--          heard the key is hot and keeps it off its floor; a slot released
--          is free no sooner than that after its release
-- ARGV[11] gap (ms)              ARGV[12] held    ARGV[13] want
-- ARGV[14] the grant counts until (Unix ms)
-- ARGV[15] 1: the slots' lives follow, 0: unknown (every floor is held back)
-- ARGV[16] n, then the n lives whose floor admits may count (one per slot)
-- then pairs of time slot and admits to push.
-- Returns { granted, room left, holders of grants, the window's pushed
-- admits, the oldest time slot that holds some (0: none), when the first
-- other grant lapses (0: none) }: the room grows by then at the latest.
local set, old = {}, {}
local function put(f, v)
	set[#set + 1] = f
	set[#set + 1] = v
end
local function each(cmd, key, args)
	for i = 1, #args, 1000 do -- unpack has a limit
		redis.call(cmd, key, unpack(args, i, math.min(i + 999, #args)))
	end
end
local key, now, oldest = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local me, life, hot = 'g' .. ARGV[4], tonumber(ARGV[5]), ARGV[6] == '1'
local floor, events, settle, gap = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[10]), tonumber(ARGV[11])
local held, want, view, n = tonumber(ARGV[12]), tonumber(ARGV[13]), ARGV[15] == '1', tonumber(ARGV[16])
local used, holders, counts, marks = held, 1, {}, {}
local since, last, had, lapses
local fields = redis.call('HGETALL', key)
for i = 1, #fields, 2 do
	local f, v = fields[i], fields[i + 1]
	local kind = string.sub(f, 1, 1)
	if f == me then
		had = true -- given back; set again below if it holds anything
	elseif kind == 'g' then
		local c, u = string.match(v, '^(%d+) (%d+)$')
		u = tonumber(u)
		if u <= now then
			old[#old + 1] = f
		else
			used, holders = used + tonumber(c), holders + 1
			lapses = math.min(lapses or u, u)
		end
	elseif kind == 'm' then
		marks[tonumber(string.sub(f, 2))] = true
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
	for x in pairs(marks) do
		if hot then
			old[#old + 1] = 'm' .. x
		end
		marks[x] = nil
	end
end
local settled = since + settle
if hot then
	put('h', since .. ' ' .. now)
	-- Only a life older than the settle needs a mark; one no slot lists
	-- counts no more.
	if life > 0 and life < settled and not marks[life] then
		marks[life] = true
		put('m' .. life, 1)
	end
	if view then
		local listed = { [life] = true }
		for i = 17, 16 + n do
			listed[tonumber(ARGV[i])] = true
		end
		for x in pairs(marks) do
			if not listed[x] then
				old[#old + 1] = 'm' .. x
				marks[x] = nil
			end
		end
	end
end
for i = 17 + n, #ARGV, 2 do
	local s, c = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
	if s >= oldest then
		counts[s] = (counts[s] or 0) + c
		put(s, counts[s])
	end
end
local pushed, first = 0, 0
for s, c in pairs(counts) do
	pushed = pushed + c
	if c > 0 and (first == 0 or s < first) then
		first = s
	end
end
used = used + pushed
-- Each slot whose floor may hold admits the store has not seen holds F back:
-- a life that did not mark, older than the period's settle (a younger one
-- has heard the key is hot and keeps it off its floor); while the period is
-- young, any that did not mark, and every free slot (a newcomer may take
-- it before it hears).
local young = now < settled
local reserved = floor * tonumber(ARGV[9])
if view then
	reserved = 0
	if young then
		reserved = floor * (tonumber(ARGV[9]) - n)
	end
	for i = 17, 16 + n do
		local x = tonumber(ARGV[i])
		if not marks[x] and (young or x < settled) then
			reserved = reserved + floor
		end
	end
end
local room = events - used - reserved
-- Past the room, what it holds is cut back (a negative grant).
local grant = math.max(math.min(want, room), -held)
if grant + held > 0 then
	put(me, (grant + held) .. ' ' .. ARGV[14])
else
	holders = holders - 1
	if had then
		old[#old + 1] = me
	end
end
-- Deletes first: a mark a new period dropped may be set again.
if #old > 0 then
	each('HDEL', key, old)
end
if #set > 0 then
	each('HSET', key, set)
end
if #set > 0 or #fields > 0 then
	redis.call('PEXPIRE', key, ARGV[3])
end
return { grant, room - grant, holders, pushed, first, lapses or 0 }
