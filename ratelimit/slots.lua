-- One instance's beat (see Beat in store.go, whose MemoryStore runs the same
-- steps). KEYS[1] is the slot table: "s<j>" = "<member> <until> <flushed>
-- <floor at>" for instance slot j, "o<j>" = the last time (Unix ms) a beat
-- was answered with slot j out of its holding set. KEYS[2] is the hot keys:
-- key -> until (Unix ms). Both share a Cluster hash tag.
-- ARGV[1] member            ARGV[2] the slot it holds (-1: none, take one)
-- ARGV[3] now (Unix ms)     ARGV[4] live for (ms; 0: it releases its slot)
-- ARGV[5] 1: the release pushed every floor admit
-- ARGV[6] keep (ms): a dead holder's floor admits and marks count this long
-- ARGV[7] view (ms): how long an instance acts on a beat's holding set; a
--         slot left out of an answered beat has its floor a view and a keep
--         later (grants made without it are used a view on, and their
--         admits count a window)
-- ARGV[8] max instances     ARGV[9] hot for (ms)
-- ARGV[10] 1: this instance makes lease calls with the holding set it is
--          answered (the slots out of it are recorded), 0: it makes none
-- ARGV[11] on a release, until when (Unix ms) the keys it hands over may
--          not go on the slot's floor
-- ARGV[12] how many keys follow that it hands over (marked on leases)
-- ARGV[13…] those keys, then the keys this instance names hot
-- A slot released flushed keeps the keys handed over in "m<j>" = "<until>
-- <key> <key> …"; the next holder is answered them and its floor is usable
-- at once for every other key.
-- Returns { slot, floor at, holding, live, until, n, n keys handed over,
-- hot key, … }.
-- Field lists go in chunks: unpack has a limit.
local function each(cmd, key, args)
	for i = 1, #args, 1000 do
		redis.call(cmd, key, unpack(args, i, math.min(i + 999, #args)))
	end
end
local tbl, hot = KEYS[1], KEYS[2]
local member, now = ARGV[1], tonumber(ARGV[3])
local ttl, keep, view, n = tonumber(ARGV[4]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local recs, outAt = {}, {}
local fields = redis.call('HGETALL', tbl)
for i = 1, #fields, 2 do
	local j = tonumber(string.sub(fields[i], 2))
	local kind = string.sub(fields[i], 1, 1)
	if kind == 's' then
		local m, u, fl, at = string.match(fields[i + 1], '^(%d+) (%d+) (%d) (%d+)$')
		recs[j] = { m = m, untl = tonumber(u), flushed = fl == '1', at = tonumber(at) }
	elseif kind == 'o' then
		outAt[j] = tonumber(fields[i + 1])
	end
end
local slot = tonumber(ARGV[2])
if slot >= 0 and (not recs[slot] or recs[slot].m ~= member) then
	slot = -1 -- lost: its record lapsed and another took it
end
local floorAt, handed = 0, {}
local nHanded = tonumber(ARGV[12])
if ttl == 0 then
	if slot >= 0 then
		recs[slot] = { m = member, untl = now, flushed = ARGV[5] == '1', at = recs[slot].at }
		redis.call('HSET', tbl, 's' .. slot, member .. ' ' .. now .. ' ' .. ARGV[5] .. ' ' .. recs[slot].at)
		if ARGV[5] == '1' and nHanded > 0 then
			local m = { ARGV[11] }
			for i = 13, 12 + nHanded do
				m[#m + 1] = ARGV[i]
			end
			redis.call('HSET', tbl, 'm' .. slot, table.concat(m, ' '))
		else
			redis.call('HDEL', tbl, 'm' .. slot)
		end
	end
	slot = -1
else
	if slot < 0 then
		for j = 0, n - 1 do
			local r = recs[j]
			if not r or r.untl <= now then
				local at = math.max(now, outAt[j] and outAt[j] + view + keep or 0)
				if r and not r.flushed then
					at = math.max(at, r.untl + keep)
				end
				if slot < 0 or at < floorAt then
					slot, floorAt = j, at
				end
			end
		end
		if slot >= 0 then
			-- The keys its last holder handed over, if their time is not up.
			local m = redis.call('HGET', tbl, 'm' .. slot)
			if m then
				redis.call('HDEL', tbl, 'm' .. slot)
				for w in string.gmatch(m, '%S+') do
					handed[#handed + 1] = w
				end
				if tonumber(handed[1]) <= now then
					handed = {}
				end
			end
		end
	else
		floorAt = recs[slot].at
	end
	if slot >= 0 then
		recs[slot] = { m = member, untl = now + ttl, flushed = false, at = floorAt }
		redis.call('HSET', tbl, 's' .. slot, member .. ' ' .. (now + ttl) .. ' 0 ' .. floorAt)
	end
end
-- Holding: live slots, dead ones whose admits may still count, and the
-- spare (the lowest other free slot), which a newcomer takes at once.
local holding, live, spare, outs = {}, 0, false, {}
for j = 0, n - 1 do
	local r = recs[j]
	local h = '0'
	if r and r.untl > now then
		h, live = '1', live + 1
	elseif r and not r.flushed and r.untl + keep > now then
		h = '1'
	elseif not spare then
		h, spare = '1', true
	end
	if h == '0' and ARGV[10] == '1' then
		outs[#outs + 1] = 'o' .. j
		outs[#outs + 1] = now
	end
	holding[j + 1] = h
end
if #outs > 0 then
	each('HSET', tbl, outs)
end
redis.call('PEXPIRE', tbl, keep + view + 60000)
local out = { slot, floorAt, table.concat(holding), live, handed[1] or 0, math.max(#handed - 1, 0) }
for i = 2, #handed do
	out[#out + 1] = handed[i]
end
local hotUntil = now + tonumber(ARGV[9])
local named = {}
for i = 13 + nHanded, #ARGV do
	named[#named + 1] = ARGV[i]
	named[#named + 1] = hotUntil
end
if #named > 0 then
	each('HSET', hot, named)
end
local old = {}
fields = redis.call('HGETALL', hot)
for i = 1, #fields, 2 do
	if tonumber(fields[i + 1]) <= now then
		old[#old + 1] = fields[i]
	else
		out[#out + 1] = fields[i]
	end
end
if #old > 0 then
	each('HDEL', hot, old)
end
if #fields > 0 then
	redis.call('PEXPIRE', hot, tonumber(ARGV[9]) + 60000)
end
return out
