#!/usr/bin/env bash
# What a rate limiter costs a real Caddy, end to end on loopback. Caddy
# processes serve `respond "ok"`:
#
#   plain                    no limiter (and plain-again, a second one)
#   fleetlimit-memory        cmd/caddy of this checkout, the embedded store
#   fleetlimit-redis         the same on a local redis-server
#   fleetlimit-redis-denied  the same with ratelimit_headers denied
#   caddy-ratelimit          a Caddy built with github.com/mholt/caddy-ratelimit
#
# each with one zone keyed on X-API-Key and a limit no run reaches (so the
# cost is measured, not 429s), each run under wrk -t1 -c32, in alternating
# rounds (A B C D, B C D A, …). The script prints each variant's median req/s
# and its median per-round ratio to plain, in one of two modes:
#
#   MODE=paired (default)  each run puts the variant and a yardstick (one more
#                          plain Caddy, under its own wrk) on the same core at
#                          the same time; the variant's score is the
#                          yardstick's CPU time per request over its own, and
#                          its ratio its score over plain's in the round.
#                          What slows the machine during a run slows both.
#   MODE=alone             each variant runs alone; the ratio is req/s over
#                          plain's in the round. On a shared machine whose
#                          speed moves by tens of percent within seconds, this
#                          one's rounds scatter far more.
#
# plain-again's ratio is the run's noise floor. Then a run where every request
# carries a new key (a wrk Lua counter) gives each limiter's new-key
# throughput and its memory per key (VmRSS after minus before over the keys,
# Go's heap headroom included, as an operator would see it; and the live heap
# after a collection). Last, a CPU profile of each limiter under wrk says what
# share of Caddy's CPU is its own work and the header fields it adds: shares
# of one profile, so they do not move with the machine's speed.
#
# Settings (environment), with defaults: MODE (paired), ROUNDS (11),
# SECONDS_PER_RUN (2), CONNECTIONS (32), NEWKEY_SECONDS (8), PROFILE_SECONDS
# (20), PROFILE_DIR (none: where to keep the profiles and binaries),
# COST_EVENTS per COST_WINDOW (20000 per 100ms), PIN (1: Caddy on CPU 0, wrk
# and redis-server on CPU 1; 0: no pinning), CADDY_RATELIMIT_VERSION (v0.1.0),
# REDIS_PORT (6393), BASE_PORT (9300), COMPARE_REV (none; a git revision whose
# fleetlimit variants run beside this checkout's, e.g. COMPARE_REV=main),
# COMPARE_BIN and COMPARE_LABEL (a Caddy binary with fleetguard to run the
# same way).
source "$(dirname "$0")/lib.sh"
# The variants wait stopped (SIGSTOP) between runs: continue them, or a
# stopped one would outlive the script.
trap 'for j in $(jobs -p); do kill "$j" 2>/dev/null; kill -CONT "$j" 2>/dev/null; done; rm -rf "$work"' EXIT

rounds=${ROUNDS:-11}
mode=${MODE:-paired}
case $mode in
paired | alone) ;;
*)
	echo "MODE is paired or alone, not $mode" >&2
	exit 2
	;;
esac
seconds=${SECONDS_PER_RUN:-2}
connections=${CONNECTIONS:-32}
newkey_seconds=${NEWKEY_SECONDS:-8}
pin=${PIN:-1}
crl_version=${CADDY_RATELIMIT_VERSION:-v0.1.0}
redis_port=${REDIS_PORT:-6393}
port=${BASE_PORT:-9300}

if ! command -v wrk >/dev/null 2>&1; then
	if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
		echo "wrk missing: installing Debian's wrk" >&2
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null
	else
		echo "wrk is required: sudo apt-get install -y wrk" >&2
		exit 1
	fi
fi

caddy_cpus="" load_cpus=""
if [ "$pin" = "1" ] && [ "$(nproc)" -ge 2 ]; then
	caddy_cpus="taskset -c 0" load_cpus="taskset -c 1"
fi

# A second Caddy with caddy-ratelimit: a throwaway module with this
# checkout's requirements (so Caddy and every shared dependency are at the
# same versions), caddy-ratelimit added.
caddy_version=$(go list -m -f '{{.Version}}' github.com/caddyserver/caddy/v2)
mkdir -p "$work/crl"
cp go.mod go.sum "$work/crl/"
cat >"$work/crl/main.go" <<'GO'
// Command caddy is a Caddy build with the standard modules plus caddy-ratelimit.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"
	_ "github.com/mholt/caddy-ratelimit"
)

func main() { caddycmd.Main() }
GO
(
	cd "$work/crl"
	go mod edit -module caddyratelimitbench
	go get "github.com/mholt/caddy-ratelimit@$crl_version" >/dev/null 2>&1
	go mod tidy >/dev/null 2>&1
	got=$(go list -m -f '{{.Version}}' github.com/caddyserver/caddy/v2)
	if [ "$got" != "$caddy_version" ]; then
		echo "caddy-ratelimit $crl_version moved Caddy to $got (this checkout: $caddy_version)" >&2
		exit 1
	fi
	go build -o "$work/caddy-ratelimit" .
)

# COMPARE_REV: the fleetlimit variants again, built from that revision.
# plain-again is a second plain process: its ratio to plain is the noise
# floor of the run.
# fleetlimit-redis-denied sends the RateLimit headers on 429s only
# (ratelimit_headers denied), as caddy-ratelimit does.
variants=(plain plain-again fleetlimit-memory fleetlimit-redis fleetlimit-redis-denied caddy-ratelimit)
if [ -n "${COMPARE_BIN:-}" ]; then
	cp "$COMPARE_BIN" "$work/caddy-rev"
	COMPARE_REV=${COMPARE_LABEL:-other}
	variants+=("fleetlimit-memory@$COMPARE_REV" "fleetlimit-redis@$COMPARE_REV")
elif [ -n "${COMPARE_REV:-}" ]; then
	mkdir -p "$work/rev"
	git archive "$COMPARE_REV" | tar -x -C "$work/rev"
	(cd "$work/rev" && go build -o "$work/caddy-rev" ./cmd/caddy)
	variants+=("fleetlimit-memory@$COMPARE_REV" "fleetlimit-redis@$COMPARE_REV")
fi

$load_cpus redis-server --port "$redis_port" --save '' --appendonly no >"$work/redis.log" 2>&1 &

# caddyfile VARIANT PORT EVENTS WINDOW: the config of one variant.
admin="admin off"
caddyfile() {
	local global="" handler=""
	case $1 in
	fleetlimit-redis*) global="fleetguard {
		redis redis://127.0.0.1:$redis_port/0
	}" ;;
	esac
	local headers=""
	case $1 in
	*-denied*) headers="ratelimit_headers denied" ;;
	esac
	case $1 in
	fleetlimit-*) handler="fleetlimit {
		zone per_key {
			key {http.request.header.X-API-Key}
			events $3
			window $4
			max_keys 1000000
		}
		$headers
	}" ;;
	caddy-ratelimit) handler="rate_limit {
		zone per_key {
			key {http.request.header.X-API-Key}
			events $3
			window $4
		}
	}" ;;
	esac
	cat <<CFG
{
	$admin
	auto_https off
	$global
}
:$2 {
	$handler
	respond "ok"
}
CFG
}

binary() {
	case $1 in
	caddy-ratelimit) echo "$work/caddy-ratelimit" ;;
	*@*) echo "$work/caddy-rev" ;;
	*) echo "$work/caddy" ;;
	esac
}

# start VARIANT PORT EVENTS WINDOW: starts that Caddy and waits until it
# answers; sets started_pid.
start() {
	local file="$work/${1//[^a-z0-9-]/_}"
	caddyfile "$@" >"$file.Caddyfile"
	$caddy_cpus "$(binary "$1")" run --adapter caddyfile --config "$file.Caddyfile" >"$file.log" 2>&1 &
	started_pid=$!
	for _ in $(seq 100); do
		if curl -fs -o /dev/null -H 'X-API-Key: warm' "http://127.0.0.1:$2/"; then
			return
		fi
		sleep 0.1
	done
	echo "$1 did not start:" >&2
	cat "$file.log" >&2
	exit 1
}

stop() {
	kill -CONT "$1"
	kill "$1"
	wait "$1" 2>/dev/null || true
}

# load PORT SECONDS [wrk args...]: wrk's output for one run.
load() {
	local port=$1 d=$2
	shift 2
	$load_cpus wrk -t1 -c"$connections" -d"${d}s" "$@" "http://127.0.0.1:$port/"
}

rps() { sed -n 's/^Requests\/sec: *\([0-9.]*\).*/\1/p'; }
requests() { sed -n 's/^ *\([0-9]*\) requests in.*/\1/p'; }

refused() {
	if grep -q 'Non-2xx' <<<"$1"; then
		echo "a run got answers other than 200, the limit was reached:" >&2
		echo "$1" >&2
		exit 1
	fi
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

vmrss_kb() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"; }

# cpu_ns PID: CPU time the process's threads have run, in ns.
cpu_ns() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { printf "%.0f", s }'; }

# One key at a limit no run reaches: 20000 per 100 ms, 200k req/s.
# caddy-ratelimit keeps a ring of one timestamp per allowed event per key
# (24 bytes, with a pointer the GC scans), so the short window keeps its ring
# at 480 kB where 200k per second would be 4.8 MB; fleetlimit keeps 20 counts
# whatever the limit.
cost_events=${COST_EVENTS:-20000} cost_window=${COST_WINDOW:-100ms}

# Every variant is started and warmed up once, then stopped (SIGSTOP): a
# run continues what it measures and stops it again, so only the measured
# Caddy processes run.
declare -A pid vport rates cpus scores
i=0
for v in "${variants[@]}" yardstick; do
	vport[$v]=$((port + i))
	i=$((i + 1))
	start "$v" "${vport[$v]}" "$cost_events" "$cost_window"
	pid[$v]=$started_pid
	load "${vport[$v]}" 1 -H 'X-API-Key: bench' >/dev/null
	kill -STOP "${pid[$v]}"
done

# per_request CPU_NS OUT: CPU µs per request of one run.
per_request() { awk -v c="$1" -v n="$(requests <<<"$2")" 'BEGIN { printf "%.3f", c / n / 1000 }'; }

# alone V: V on its own for one run; appends its req/s and CPU/req.
alone() {
	local v=$1 before after out
	kill -CONT "${pid[$v]}"
	sleep 0.2
	before=$(cpu_ns "${pid[$v]}")
	out=$(load "${vport[$v]}" "$seconds" -H 'X-API-Key: bench')
	after=$(cpu_ns "${pid[$v]}")
	kill -STOP "${pid[$v]}"
	refused "$out"
	rates[$v]+="$(rps <<<"$out") "
	cpus[$v]+="$(per_request $((after - before)) "$out") "
}

# paired V ROUND: V and the yardstick (another plain Caddy) on the same core
# at the same time, each under its own wrk, for one run; appends V's req/s,
# its CPU/req, and its score: the yardstick's CPU/req over V's. Whatever
# slows the machine down during the run slows both.
paired() {
	local v=$1 y=yardstick vb yb va ya vo yo l1 l2
	kill -CONT "${pid[$v]}" "${pid[$y]}"
	sleep 0.2
	vb=$(cpu_ns "${pid[$v]}") yb=$(cpu_ns "${pid[$y]}")
	# Who starts first alternates with the round.
	if [ $(($2 % 2)) = 0 ]; then
		load "${vport[$v]}" "$seconds" -H 'X-API-Key: bench' >"$work/v.out" &
		l1=$!
		load "${vport[$y]}" "$seconds" -H 'X-API-Key: bench' >"$work/y.out" &
		l2=$!
	else
		load "${vport[$y]}" "$seconds" -H 'X-API-Key: bench' >"$work/y.out" &
		l1=$!
		load "${vport[$v]}" "$seconds" -H 'X-API-Key: bench' >"$work/v.out" &
		l2=$!
	fi
	wait "$l1" "$l2"
	va=$(cpu_ns "${pid[$v]}") ya=$(cpu_ns "${pid[$y]}")
	kill -STOP "${pid[$v]}" "${pid[$y]}"
	vo=$(<"$work/v.out") yo=$(<"$work/y.out")
	refused "$vo"
	local vc yc
	vc=$(per_request $((va - vb)) "$vo") yc=$(per_request $((ya - yb)) "$yo")
	rates[$v]+="$(rps <<<"$vo") "
	cpus[$v]+="$vc "
	scores[$v]+="$(awk -v y="$yc" -v v="$vc" 'BEGIN { printf "%.4f", y / v }') "
}

for round in $(seq "$rounds"); do
	# Each round starts one variant further, so none always runs first.
	n=${#variants[@]}
	for k in $(seq 0 $((n - 1))); do
		"$mode" "${variants[$(((round + k) % n))]}" "$round"
	done
	echo "round $round: $(for v in "${variants[@]}"; do printf '%s=%s ' "$v" "$(awk '{ print $NF }' <<<"${cpus[$v]}")"; done)" >&2
done
for v in "${variants[@]}" yardstick; do stop "${pid[$v]}"; done

# ratios A B: the per-round ratios a[i]/b[i] of two lists.
ratios() {
	paste <(tr ' ' '\n' <<<"$1" | sed '/^$/d') <(tr ' ' '\n' <<<"$2" | sed '/^$/d') |
		awk '{ printf "%.3f ", $1 / $2 }'
}
medianof() { tr ' ' '\n' <<<"$1" | sed '/^$/d' | median; }

echo
echo "## End to end ($mode): wrk -t1 -c$connections, $rounds rounds x ${seconds}s, one key, $cost_events events per $cost_window"
echo "$(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); Caddy $caddy_version, $(go version | cut -d' ' -f3), redis-server $(redis-server --version | sed -n 's/.*v=\([0-9.]*\).*/\1/p'), caddy-ratelimit $crl_version"
if [ -n "$caddy_cpus" ]; then echo "Caddy pinned to CPU 0, wrk and redis-server to CPU 1"; else echo "no pinning"; fi
echo
if [ "$mode" = paired ]; then
	echo "Each run puts one variant and the yardstick (a plain Caddy) on the same core at the same time."
	echo "score: the yardstick's CPU time per request over the variant's in that run; ratio: the variant's"
	echo "score over plain's in the same round (what plain's req/s would be over the variant's, alone on a"
	echo "core). req/s and CPU/req are the variant's beside the yardstick (the core is shared: not its speed alone)."
	echo
	printf '| %-28s | %12s | %10s | %12s | %12s | %s |\n' variant "median req/s" "CPU/req µs" "median score" "median ratio" "per round ratio"
	printf '|%s|%s|%s|%s|%s|%s|\n' "---" "---:" "---:" "---:" "---:" "---"
	for v in "${variants[@]}"; do
		r=$(ratios "${scores[$v]}" "${scores[plain]}")
		printf '| %-28s | %12.0f | %10.2f | %12.3f | %12.3f | %s |\n' "$v" \
			"$(medianof "${rates[$v]}")" "$(medianof "${cpus[$v]}")" "$(medianof "${scores[$v]}")" "$(medianof "$r")" "${r% }"
	done
else
	echo "ratio: the variant's req/s over plain's in the same round. CPU/req: Caddy's CPU time per request;"
	echo "its ratio is plain's over the variant's (what the req/s ratio is where Caddy's core is the limit)."
	echo
	printf '| %-28s | %12s | %12s | %10s | %13s | %s |\n' variant "median req/s" "median ratio" "CPU/req µs" "CPU/req ratio" "per round: req/s ratio; CPU/req ratio"
	printf '|%s|%s|%s|%s|%s|%s|\n' "---" "---:" "---:" "---:" "---:" "---"
	for v in "${variants[@]}"; do
		r=$(ratios "${rates[$v]}" "${rates[plain]}")
		c=$(ratios "${cpus[plain]}" "${cpus[$v]}")
		printf '| %-28s | %12.0f | %12.3f | %10.2f | %13.3f | %s; %s |\n' "$v" \
			"$(medianof "${rates[$v]}")" "$(medianof "$r")" "$(medianof "${cpus[$v]}")" "$(medianof "$c")" "${r% }" "${c% }"
	done
fi

# Every request a new key: wrk -t1, so one Lua counter names every key once.
cp bench/newkey.lua "$work/newkey.lua"
newkey_events=100 newkey_window=1m
admin_port=$((port + 100))
admin="admin localhost:$admin_port"
# heap_alloc: the live heap after a collection (the admin endpoint's heap
# profile with gc=1 collects first and ends with runtime.MemStats).
heap_alloc() {
	curl -fs "http://localhost:$admin_port/debug/pprof/heap?gc=1&debug=1" | sed -n 's/^# HeapAlloc = \([0-9]*\).*/\1/p'
}
redis_memory() { redis-cli -p "$redis_port" info memory | sed -n 's/^used_memory:\([0-9]*\).*/\1/p'; }
echo
echo "## New keys: every request a new X-API-Key, ${newkey_seconds}s, events $newkey_events per $newkey_window (fleetlimit max_keys 1000000, precision 20)"
echo
echo "RSS/key: VmRSS after minus before over the keys (garbage and Go's heap headroom included);"
echo "heap/key: the live heap after a collection, after minus before, over the keys."
echo
printf '| %-28s | %8s | %8s | %12s | %12s | %8s | %9s | %15s |\n' variant "req/s" keys "RSS before" "RSS after" "RSS/key" "heap/key" "Redis bytes/key"
printf '|%s|%s|%s|%s|%s|%s|%s|%s|\n' "---" "---:" "---:" "---:" "---:" "---:" "---:" "---:"
for v in fleetlimit-memory fleetlimit-redis caddy-ratelimit; do
	redis-cli -p "$redis_port" flushall >/dev/null
	start "$v" "$port" "$newkey_events" "$newkey_window"
	load "$port" 1 -H 'X-API-Key: warm' >/dev/null
	sleep 0.5
	heap_before=$(heap_alloc)
	before=$(vmrss_kb "$started_pid")
	redis_before=$(redis_memory)
	out=$(load "$port" "$newkey_seconds" -s "$work/newkey.lua")
	refused "$out"
	after=$(vmrss_kb "$started_pid")
	keys=$(requests <<<"$out")
	heap_after=$(heap_alloc)
	redis_per_key=-
	if [ "$v" = fleetlimit-redis ]; then
		sleep 1 # the reconciler's next pass writes the last keys
		redis_per_key=$((($(redis_memory) - redis_before) / keys))
	fi
	printf '| %-28s | %8.0f | %8d | %9d kB | %9d kB | %8d | %9d | %15s |\n' "$v" "$(rps <<<"$out")" "$keys" "$before" "$after" \
		$(((after - before) * 1024 / keys)) $(((heap_after - heap_before) / keys)) "$redis_per_key"
	stop "$started_pid"
done

# Where each limiter's cost is, from a CPU profile of Caddy under wrk (the
# admin endpoint's pprof): shares of one profile's samples, so a machine
# that slows down during the run slows the part and the whole alike. handler:
# the limiter's own work (fleetlimit's gate; caddy-ratelimit's ServeHTTP
# without respond's). headers: net/http copying, sorting and writing the
# response header fields (WriteHeader's clone and writeSubset), which
# grows with the fields a handler adds; beyond plain: headers minus plain's.
# PROFILE_DIR keeps each profile and its binary for go tool pprof.
profile_seconds=${PROFILE_SECONDS:-20}
# share PROFILE BINARY FOCUS [IGNORE]: percent of the samples whose stack
# has FOCUS and not IGNORE.
share() {
	go tool pprof -top -focus="$3" ${4:+-ignore="$4"} "$2" "$1" 2>/dev/null |
		sed -n 's/^Showing nodes accounting for [^,]*, \([0-9.]*\)% of .*/\1/p' | head -1 | grep . || echo 0
}
echo
echo "## CPU profile shares: ${profile_seconds}s of Caddy's CPU profile under wrk -t1 -c$connections, one key, $cost_events events per $cost_window"
echo
echo "handler: the limiter's own work; headers: net/http cloning and writing the response header fields;"
echo "cost: handler + headers beyond plain's, the share of Caddy's CPU the limiter takes (1 - cost is"
echo "its ratio to plain where Caddy's core is the limit)."
echo
printf '| %-28s | %8s | %8s | %8s | %8s | %7s |\n' variant "CPU" handler headers cost "1-cost"
printf '|%s|%s|%s|%s|%s|%s|\n' "---" "---:" "---:" "---:" "---:" "---:"
plain_headers=0
for v in plain fleetlimit-redis fleetlimit-redis-denied caddy-ratelimit; do
	redis-cli -p "$redis_port" flushall >/dev/null
	start "$v" "$port" "$cost_events" "$cost_window"
	load "$port" 1 -H 'X-API-Key: bench' >/dev/null
	load "$port" $((profile_seconds + 2)) -H 'X-API-Key: bench' >"$work/profile.out" &
	sleep 1
	curl -fs -o "$work/cpu.prof" "http://localhost:$admin_port/debug/pprof/profile?seconds=$profile_seconds"
	wait $!
	refused "$(<"$work/profile.out")"
	bin=$(binary "$v")
	if [ -n "${PROFILE_DIR:-}" ]; then
		mkdir -p "$PROFILE_DIR"
		cp "$work/cpu.prof" "$PROFILE_DIR/$v.prof"
		cp "$bin" "$PROFILE_DIR/$v.bin"
	fi
	case $v in
	fleetlimit-*) handler=$(share "$work/cpu.prof" "$bin" 'fleetguard\.\(\*FleetLimit\)\.gate$') ;;
	caddy-ratelimit) handler=$(share "$work/cpu.prof" "$bin" 'caddy-ratelimit\.\(?\*?Handler\)?\.ServeHTTP$' 'caddyhttp\.\(?\*?StaticResponse\)?\.ServeHTTP$') ;;
	*) handler=0 ;;
	esac
	headers=$(share "$work/cpu.prof" "$bin" 'net/http\.(Header\.writeSubset|\(\*response\)\.WriteHeader)$')
	samples=$(go tool pprof -top "$bin" "$work/cpu.prof" 2>/dev/null | sed -n 's/.*Total samples = \([0-9.]*m*s\).*/\1/p')
	[ "$v" = plain ] && plain_headers=$headers
	cost=$(awk -v h="$handler" -v x="$headers" -v p="$plain_headers" 'BEGIN { printf "%.2f", h + x - p }')
	printf '| %-28s | %8s | %7.2f%% | %7.2f%% | %7.2f%% | %7.3f |\n' "$v" "$samples" "$handler" "$headers" "$cost" \
		"$(awk -v c="$cost" 'BEGIN { printf "%.3f", 1 - c / 100 }')"
	stop "$started_pid"
done
