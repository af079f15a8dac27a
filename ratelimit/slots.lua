-- One instance's beat on the slot table (see Beat in store.go; MemoryStore.Beat
-- takes the same steps). KEYS[1] is the slot table: "s<j>" = "<member> <life>
-- <until> <flushed> <floor at> <before>" for instance slot j: its holder, the
-- holder's life (when it took the slot, Unix ms; "l" is the last life given,
-- and each is one past it at least), live until then, 1 if its release pushed every floor admit, when its floor is
-- usable, and the life before it whose floor admits count until then.
-- KEYS[2] is the hot keys: key -> until (Unix ms). Both share a hash tag.
-- ARGV[1] member            ARGV[2] the slot it holds (-1: none, take one)
-- ARGV[3] now (Unix ms)     ARGV[4] live for (ms; 0: it releases its slot)
-- ARGV[5] 1: the release pushed every floor admit
-- ARGV[6] keep (ms): a dead holder's floor admits count this long after it
-- ARGV[7] max instances     ARGV[8] a hot key is kept this long past its until
-- ARGV[9…] pairs of a key this instance called hot and until when
-- Returns { slot, life, floor at, live, then for each slot the life of its
-- holder and the life before it whose floor admits may count (0: none),
-- then pairs of hot key and until }.
local tbl, hot = KEYS[1], KEYS[2]
local member, slot, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local ttl, keep, n = tonumber(ARGV[4]), tonumber(ARGV[6]), tonumber(ARGV[7])
local recs, lastLife = {}, 0
local fields = redis.call('HGETALL', tbl)
for i = 1, #fields, 2 do
	if fields[i] == 'l' then
		lastLife = tonumber(fields[i + 1])
	end
	local j = tonumber(string.sub(fields[i], 2))
	local m, l, u, fl, at, b = string.match(fields[i + 1], '^(%d+) (%d+) (%d+) (%d) (%d+) (%d+)$')
	if j and m then
		recs[j] = { m = m, life = tonumber(l), untl = tonumber(u), flushed = fl == '1', at = tonumber(at), before = tonumber(b) }
	end
end
-- A record's floor admits count while it lives, and a keep after a death.
local function counts(r)
	return r.untl > now or not r.flushed and r.untl + keep > now
end
local function save(j)
	local r = recs[j]
	local fl = r.flushed and '1' or '0'
	redis.call('HSET', tbl, 's' .. j, r.m .. ' ' .. r.life .. ' ' .. r.untl .. ' ' .. fl .. ' ' .. r.at .. ' ' .. r.before)
end
if slot >= 0 and (slot >= n or not recs[slot] or recs[slot].m ~= member) then
	slot = -1 -- lost: its record lapsed and another took it
end
if slot >= 0 then
	local r = recs[slot]
	r.untl, r.flushed = now + ttl, ARGV[5] == '1'
	if ttl == 0 then
		r.untl = now
	end
	save(slot)
elseif ttl > 0 then
	-- Take the free slot whose floor is usable first: one whose last holder
	-- died waits until that one's floor admits have left the window.
	local best, bestAt, bestBefore = -1, 0, 0
	for j = 0, n - 1 do
		local r = recs[j]
		local at, before = now, 0
		if r and r.untl > now then
			at = nil
		elseif r and r.at > now then
			at, before = r.at, r.before -- its holder left before its floor
		elseif r and counts(r) then
			at, before = r.untl + keep, r.life
		end
		if at and (best < 0 or at < bestAt) then
			best, bestAt, bestBefore = j, at, before
		end
	end
	if best >= 0 then
		local life = math.max(now, lastLife + 1)
		slot = best
		recs[slot] = { m = member, life = life, untl = now + ttl, flushed = false, at = bestAt, before = bestBefore }
		save(slot)
		redis.call('HSET', tbl, 'l', life)
	end
end
if ttl == 0 then
	slot = -1
end
redis.call('PEXPIRE', tbl, keep + 60000)
local out, live = { slot, 0, 0, 0 }, 0
if slot >= 0 then
	out[2], out[3] = recs[slot].life, recs[slot].at
end
for j = 0, n - 1 do
	local r, a, b = recs[j], 0, 0
	if r and counts(r) then
		a = r.life
	end
	if r and r.at > now then
		b = r.before
	end
	if r and r.untl > now then
		live = live + 1
	end
	out[#out + 1] = a
	out[#out + 1] = b
end
out[4] = live
local hotKeep, untils, set, old, latest = tonumber(ARGV[8]), {}, {}, {}, 0
fields = redis.call('HGETALL', hot)
for i = 1, #fields, 2 do
	untils[fields[i]] = tonumber(fields[i + 1])
end
for i = 9, #ARGV, 2 do
	local u = tonumber(ARGV[i + 1])
	if u > (untils[ARGV[i]] or 0) then
		untils[ARGV[i]] = u
		set[#set + 1] = ARGV[i]
		set[#set + 1] = u
	end
end
for k, u in pairs(untils) do
	if u + hotKeep <= now then
		old[#old + 1] = k
	else
		out[#out + 1] = k
		out[#out + 1] = u
		latest = math.max(latest, u)
	end
end
-- unpack has a limit: field lists go in chunks.
for i = 1, #set, 1000 do
	redis.call('HSET', hot, unpack(set, i, math.min(i + 999, #set)))
end
for i = 1, #old, 1000 do
	redis.call('HDEL', hot, unpack(old, i, math.min(i + 999, #old)))
end
if latest > 0 then
	redis.call('PEXPIRE', hot, latest + hotKeep - now)
end
return out
