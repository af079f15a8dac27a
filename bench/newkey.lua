-- wrk: every request a new X-API-Key (with wrk -t1, one counter names each key once).
local n = 0
request = function()
	n = n + 1
	return wrk.format(nil, nil, { ["X-API-Key"] = "new-" .. n })
end
