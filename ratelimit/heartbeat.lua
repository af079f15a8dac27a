-- One instance's heartbeat. The membership is a hash of instance number ->
-- "<live until> <joined> <seen>" (Unix ms), plus the fields "f" (when the membership
-- was founded) and "k" (how long a record outlives its instance, the longest
-- any member asked for). The hot keys are a hash of key -> "<until> <room>
-- <became hot at>". The promises are a hash of instance number -> its last
-- floor promise (see promise.go). All three share a Cluster hash tag.
-- KEYS[1]  the membership hash
-- KEYS[2]  the hot keys hash
-- KEYS[3]  the promises hash
-- ARGV[1]  this instance's number
-- ARGV[2]  now, Unix ms
-- ARGV[3]  how long this heartbeat lasts, in ms (0: the instance leaves)
-- ARGV[4]  when this instance joined, Unix ms
-- ARGV[5]  how long its record outlives it, in ms
-- ARGV[6]  when it last learned the fleet, Unix ms
-- ARGV[7]  its floor promise ("": keep the one it sent last)
-- ARGV[8]  the gone members' promises it holds: "<number>:<until> ..."
-- ARGV[9…] triples of key, until (Unix ms) and room: the hot keys this
--          instance announces
-- Returns { fresh (1: the membership was empty), founded, number of records,
-- then per record: instance number, until, joined, seen, and its promise if it
-- is gone ("" if live or none, "=" if the caller holds it); then per key hot
-- now: key, until, room, became hot at }.
local members, hot, promises = KEYS[1], KEYS[2], KEYS[3]
local now = tonumber(ARGV[2])
local founded = tonumber(redis.call('HGET', members, 'f'))
local fresh = 0
if not founded then
	founded, fresh = now, 1
	redis.call('HSET', members, 'f', now)
end
local keep = tonumber(redis.call('HGET', members, 'k')) or 0
if tonumber(ARGV[5]) > keep then
	keep = tonumber(ARGV[5])
	redis.call('HSET', members, 'k', keep)
end
redis.call('HSET', members, ARGV[1], (now + tonumber(ARGV[3])) .. ' ' .. ARGV[4] .. ' ' .. ARGV[6])
if ARGV[7] ~= '' then
	redis.call('HSET', promises, ARGV[1], ARGV[7])
end
local known = {}
for m, u in string.gmatch(ARGV[8], '(%d+):(%d+)') do
	known[m] = u
end
local out = { fresh, founded, 0 }
local old = {}
local fields = redis.call('HGETALL', members)
for i = 1, #fields, 2 do
	local f = fields[i]
	if f ~= 'f' and f ~= 'k' then
		local untl, joined, seen = string.match(fields[i + 1], '^(%d+) (%d+) (%d+)$')
		if not untl or tonumber(untl) + keep <= now then
			old[#old + 1] = f
		else
			out[3] = out[3] + 1
			out[#out + 1] = f
			out[#out + 1] = tonumber(untl)
			out[#out + 1] = tonumber(joined)
			out[#out + 1] = tonumber(seen)
			local promise = ''
			if tonumber(untl) <= now then
				if known[f] == untl then
					promise = '='
				else
					promise = redis.call('HGET', promises, f) or ''
				end
			end
			out[#out + 1] = promise
		end
	end
end
if #old > 0 then
	redis.call('HDEL', members, unpack(old))
	redis.call('HDEL', promises, unpack(old))
end
redis.call('PEXPIRE', members, keep + 2 * tonumber(ARGV[3]) + 60000)
redis.call('PEXPIRE', promises, keep + 2 * tonumber(ARGV[3]) + 60000)

for i = 9, #ARGV, 3 do
	local at = now
	local cur = redis.call('HGET', hot, ARGV[i])
	if cur then
		local untl, _, since = string.match(cur, '^(%d+) (%-?%d+) (%d+)$')
		if tonumber(untl) > now then
			at = tonumber(since) -- still hot: it became hot then
		end
	end
	redis.call('HSET', hot, ARGV[i], ARGV[i + 1] .. ' ' .. ARGV[i + 2] .. ' ' .. at)
end
old = {}
fields = redis.call('HGETALL', hot)
for i = 1, #fields, 2 do
	local untl, room, at = string.match(fields[i + 1], '^(%d+) (%-?%d+) (%d+)$')
	untl, at = tonumber(untl), tonumber(at)
	if untl <= now then
		old[#old + 1] = fields[i]
	else
		out[#out + 1] = fields[i]
		out[#out + 1] = untl
		out[#out + 1] = tonumber(room)
		out[#out + 1] = at
	end
end
if #old > 0 then
	redis.call('HDEL', hot, unpack(old))
end
if #fields > 0 or #ARGV >= 9 then
	redis.call('PEXPIRE', hot, 60000 + 2 * tonumber(ARGV[3]))
end
return out
