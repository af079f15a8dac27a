-- One instance's beat on the slot table (see Beat in store.go; MemoryStore.Beat
-- takes the same steps). KEYS[1] is the slot table: "s<j>" = "<member> <life>
-- <until> <flushed>" for instance slot j: its holder, the holder's life (when
-- it took the slot, Unix ms; "l" is the last life given, and each is one
-- past it at least), live until then, and 1 if its release pushed every
-- floor admit. KEYS[2] is the hot keys: key -> until (Unix ms). Both share a
-- hash tag.
-- ARGV[1] member            ARGV[2] the slot it holds (-1: none, take one)
-- ARGV[3] now (Unix ms)     ARGV[4] live for (ms; 0: it releases its slot)
-- ARGV[5] 1: the release pushed every floor admit
-- ARGV[6] keep (ms): a dead holder's floor admits count this long after it
-- ARGV[7] max instances as this instance is configured: the fleet's number
--         ("n") is the one the table's counting records took their slots
--         under, and an instance configured otherwise takes no slot
--         (its floors would not add up with theirs) until none counts
-- ARGV[8] a hot key is kept this long past its until
-- ARGV[9] settle (ms): a slot released flushed is free this long after
-- ARGV[10…] pairs of a key this instance called hot and until when
-- Returns { slot, life, live, the fleet's max instances n, the lives whose
-- floor admits may count (one per slot of n, 0: none), then pairs of hot
-- key and until }.
local tbl, hot = KEYS[1], KEYS[2]
local member, slot, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local ttl, keep, n = tonumber(ARGV[4]), tonumber(ARGV[6]), tonumber(ARGV[7])
local recs, lastLife, stored = {}, 0, nil
local fields = redis.call('HGETALL', tbl)
for i = 1, #fields, 2 do
	local j = tonumber(string.sub(fields[i], 2))
	local m, l, u, fl = string.match(fields[i + 1], '^(%d+) (%d+) (%d+) (%d)$')
	if fields[i] == 'l' then
		lastLife = tonumber(fields[i + 1])
	elseif fields[i] == 'n' then
		stored = tonumber(fields[i + 1])
	elseif j and m then
		recs[j] = { m = m, life = tonumber(l), untl = tonumber(u), flushed = fl == '1' }
	end
end
-- A record's floor admits count while it lives, and a keep after a death.
-- Its slot is free once they do not, and a released one a settle after its
-- release: by then a hot period that began before has been heard of.
local settle = tonumber(ARGV[9])
local function counts(r)
	return r.untl > now or not r.flushed and r.untl + keep > now
end
local function free(r)
	return not counts(r) and (not r.flushed or r.untl + settle <= now)
end
local function save(j)
	local r = recs[j]
	redis.call('HSET', tbl, 's' .. j, r.m .. ' ' .. r.life .. ' ' .. r.untl .. ' ' .. (r.flushed and '1' or '0'))
end
local configured, anyCounts = n, false
for _, r in pairs(recs) do
	anyCounts = anyCounts or counts(r)
end
if anyCounts and stored then
	n = stored
end
if n ~= stored then
	redis.call('HSET', tbl, 'n', n)
end
if n ~= configured or slot >= 0 and (slot >= n or not recs[slot] or recs[slot].m ~= member) then
	slot = -1 -- lost: its record lapsed and another took it (or n differs)
end
if slot >= 0 then
	local r = recs[slot]
	r.untl, r.flushed = now + ttl, ARGV[5] == '1'
	save(slot)
elseif ttl > 0 and n == configured then
	for j = 0, n - 1 do
		if not recs[j] or free(recs[j]) then
			slot, lastLife = j, math.max(now, lastLife + 1)
			recs[j] = { m = member, life = lastLife, untl = now + ttl, flushed = false }
			save(j)
			redis.call('HSET', tbl, 'l', lastLife)
			break
		end
	end
end
redis.call('PEXPIRE', tbl, keep + 60000)
local out, live = { -1, 0, 0, n }, 0
if slot >= 0 and ttl > 0 then
	out[1], out[2] = slot, recs[slot].life
end
for j = 0, n - 1 do
	local r = recs[j]
	if r and r.untl > now then
		live = live + 1
	end
	out[#out + 1] = r and counts(r) and r.life or 0
end
out[3] = live
local hotKeep, untils, set, old, latest = tonumber(ARGV[8]), {}, {}, {}, 0
fields = redis.call('HGETALL', hot)
for i = 1, #fields, 2 do
	untils[fields[i]] = tonumber(fields[i + 1])
end
for i = 10, #ARGV, 2 do
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
