#!/usr/bin/env bash
# The "every request a new key" run of bench/caddy.sh alone, for the
# fleetlimit variants: what a tracked key costs a real Caddy. One Caddy
# (cmd/caddy of this checkout, or BIN) serves `respond "ok"` behind one
# fleetlimit zone keyed on X-API-Key, events 100 per 1m, max_keys 1000000,
# precision 20; wrk -t1 sends a new key on every request (a Lua counter) for
# NEWKEY_SECONDS. It prints caddy.sh's row: req/s, keys, VmRSS before and
# after, RSS/key (after minus before over the keys: garbage and Go's heap
# headroom included, as an operator sees it), heap/key (the live heap after
# a collection, from the admin endpoint's heap profile) and, on Redis, the
# store's bytes a key.
#
# Settings (environment), with defaults: VARIANTS (fleetlimit-memory
# fleetlimit-redis), RUNS (1: runs of each variant, each in a new Caddy, the
# variants alternating), NEWKEY_SECONDS (8), CONNECTIONS (32), BIN (none: a
# Caddy binary with fleetguard to run instead of this checkout's), PIN (1:
# Caddy on CPU 0, wrk and redis-server on CPU 1), REDIS_PORT (6394),
# BASE_PORT (9400).
source "$(dirname "$0")/lib.sh"
trap 'for j in $(jobs -p); do kill "$j" 2>/dev/null; done; rm -rf "$work"' EXIT

variants=(${VARIANTS:-fleetlimit-memory fleetlimit-redis})
runs=${RUNS:-1}
seconds=${NEWKEY_SECONDS:-8}
connections=${CONNECTIONS:-32}
redis_port=${REDIS_PORT:-6394}
port=${BASE_PORT:-9400}
admin_port=$((port + 100))
bin=${BIN:-$work/caddy}
command -v wrk >/dev/null || {
	echo "wrk is required: sudo apt-get install -y wrk" >&2
	exit 1
}
caddy_cpus="" load_cpus=""
if [ "${PIN:-1}" = "1" ] && [ "$(nproc)" -ge 2 ]; then
	caddy_cpus="taskset -c 0" load_cpus="taskset -c 1"
fi
$load_cpus redis-server --port "$redis_port" --save '' --appendonly no >"$work/redis.log" 2>&1 &

cp bench/newkey.lua "$work/newkey.lua"

caddyfile() {
	local global=""
	[ "$1" = fleetlimit-redis ] && global="fleetguard {
		redis redis://127.0.0.1:$redis_port/0
	}"
	cat <<CFG
{
	admin localhost:$admin_port
	auto_https off
	$global
}
:$port {
	fleetlimit {
		zone per_key {
			key {http.request.header.X-API-Key}
			events 100
			window 1m
			max_keys 1000000
		}
	}
	respond "ok"
}
CFG
}

vmrss_kb() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"; }
heap_alloc() {
	curl -fs "http://localhost:$admin_port/debug/pprof/heap?gc=1&debug=1" | sed -n 's/^# HeapAlloc = \([0-9]*\).*/\1/p'
}
redis_memory() { redis-cli -p "$redis_port" info memory | sed -n 's/^used_memory:\([0-9]*\).*/\1/p'; }
load() { $load_cpus wrk -t1 -c"$connections" -d"${2}s" "${@:3}" "http://127.0.0.1:$1/"; }

# run VARIANT: one new-key run in a new Caddy; prints its row.
run() {
	local v=$1 pid before after heap_before heap_after out keys redis_before redis_per_key=-
	redis-cli -p "$redis_port" flushall >/dev/null
	caddyfile "$v" >"$work/Caddyfile"
	$caddy_cpus "$bin" run --adapter caddyfile --config "$work/Caddyfile" >"$work/caddy.log" 2>&1 &
	pid=$!
	for _ in $(seq 100); do
		curl -fs -o /dev/null -H 'X-API-Key: warm' "http://127.0.0.1:$port/" && break
		sleep 0.1
	done
	load "$port" 1 -H 'X-API-Key: warm' >/dev/null
	sleep 0.5
	heap_before=$(heap_alloc) before=$(vmrss_kb "$pid") redis_before=$(redis_memory)
	out=$(load "$port" "$seconds" -s "$work/newkey.lua")
	if grep -q 'Non-2xx' <<<"$out"; then
		echo "answers other than 200: $out" >&2
		exit 1
	fi
	after=$(vmrss_kb "$pid")
	keys=$(sed -n 's/^ *\([0-9]*\) requests in.*/\1/p' <<<"$out")
	heap_after=$(heap_alloc)
	if [ "$v" = fleetlimit-redis ]; then
		sleep 1 # the reconciler's next pass writes the last keys
		redis_per_key=$((($(redis_memory) - redis_before) / keys))
	fi
	printf '| %-28s | %8.0f | %8d | %9d kB | %9d kB | %8d | %9d | %15s |\n' "$v" \
		"$(sed -n 's/^Requests\/sec: *\([0-9.]*\).*/\1/p' <<<"$out")" "$keys" "$before" "$after" \
		$(((after - before) * 1024 / keys)) $(((heap_after - heap_before) / keys)) "$redis_per_key"
	kill "$pid"
	wait "$pid" 2>/dev/null || true
}

sleep 0.5
printf '| %-28s | %8s | %8s | %12s | %12s | %8s | %9s | %15s |\n' variant "req/s" keys "RSS before" "RSS after" "RSS/key" "heap/key" "Redis bytes/key"
printf '|%s|%s|%s|%s|%s|%s|%s|%s|\n' "---" "---:" "---:" "---:" "---:" "---:" "---:" "---:"
for _ in $(seq "$runs"); do
	for v in "${variants[@]}"; do run "$v"; done
done
