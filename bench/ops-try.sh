#!/usr/bin/env bash
# Tries the operations surface the way a new user would, on the memory store
# and on Redis: one Caddy with the `metrics` option, fleetlimit and llmbudget
# in front of bench/fakellm (30 + 70 tokens per answer); traffic, then
# `caddy reload` and more traffic. Prints the fleetguard series on /metrics
# before and after the reload, /fleetguard/status, a budget's standing, its
# reset, and what a config that fails to load (its port is taken) leaves.
source "$(dirname "$0")/lib.sh"
redis_port=${REDIS_PORT:-6394}
start_redis "$redis_port"
# -overwrite-cap: each answer reports 70 output tokens over its max_tokens of 20,
# so the budget's settles overshoot it (the 300 used of 250 the results show).
"$work/fakellm" -addr 127.0.0.1:11503 -input 30 -output 70 -overwrite-cap 2>"$work/fakellm.log" &
sleep 0.5

config() { # config STORE_BLOCK SYNC_INTERVAL PORT
	cat <<CFG
{
	admin localhost:2419
	metrics
	fleetguard {
		$1
		sync_interval $2
	}
}
:$3 {
	handle /limited {
		fleetlimit {
			zone try_zone {
				key {http.request.header.X-API-Key}
				events 3
				window 1m
			}
		}
		respond "ok"
	}
	handle {
		llmbudget {
			budget try_tokens {
				scope key
				unit tokens
				limit 250
				window 1h
			}
			price gpt-4o* 2.50 10.00 1.25
		}
		reverse_proxy 127.0.0.1:11503
	}
}
CFG
}

traffic() {
	for i in 1 2 3 4 5; do curl -s -o /dev/null -w '%{http_code} ' -H 'X-API-Key: try-key' localhost:9401/limited; done
	for i in 1 2 3 4; do
		curl -s -o /dev/null -w '%{http_code} ' localhost:9401/v1/chat/completions -H 'Authorization: Bearer try-secret' \
			-H 'Content-Type: application/json' -d '{"model":"gpt-4o","max_tokens":20,"messages":[{"role":"user","content":"hi"}]}'
		sleep 0.2
	done
	echo
}

series() {
	curl -s localhost:2419/metrics | grep -E '^fleetguard_(fleetlimit_requests_total\{.*try_zone|llmbudget_requests_total\{budget="try_tokens",decision="(admitted|denied)"|llmbudget_tokens_total\{kind="input",model="gpt-4o\*"|store_healthy|fleetlimit_tracked_keys|fleetlimit_reconcile_duration_seconds_count|llmbudget_usage_ratio_count)' | sed 's/^/    /'
}

for store in "memory" "redis"; do
	block="prefix try_$store"
	[ "$store" = redis ] && block="redis redis://127.0.0.1:$redis_port/0
		prefix try_$store"
	echo "== $store store"
	config "$block" 100ms 9401 >"$work/$store.Caddyfile"
	"$work/caddy" run --config "$work/$store.Caddyfile" >"$work/caddy-$store.log" 2>&1 &
	pid=$!
	sleep 1.5
	echo -n "  answers: "; traffic
	sleep 0.5
	echo "  /metrics:"; series
	"$work/caddy" reload --config "$work/$store.Caddyfile" --address localhost:2419 --force 2>>"$work/reload.log"
	echo -n "  after caddy reload, answers: "; traffic
	sleep 0.5
	echo "  /metrics after the reload:"; series
	echo "  status: $(curl -s localhost:2419/fleetguard/status)"
	echo "  budget: $(curl -s -G localhost:2419/fleetguard/budgets/try_tokens --data-urlencode 'key=Bearer try-secret')"
	echo "  reset:  $(curl -s -X POST -G localhost:2419/fleetguard/budgets/try_tokens/reset --data-urlencode 'key=Bearer try-secret')"
	echo "  budget: $(curl -s -G localhost:2419/fleetguard/budgets/try_tokens --data-urlencode 'key=Bearer try-secret')"
	# A config that fails to start (its port is taken by the upstream) changes nothing.
	config "$block
		near_limit off" 3s 11503 >"$work/bad.Caddyfile"
	if "$work/caddy" reload --config "$work/bad.Caddyfile" --address localhost:2419 >"$work/bad.log" 2>&1; then
		echo "  the bad config loaded?"
	else
		echo "  bad config refused: $(grep -o 'address already in use' "$work/bad.log" | head -1)"
	fi
	echo "  status after it: $(curl -s localhost:2419/fleetguard/status | grep -o '"sync_interval":"[^"]*"')"
	if grep -q 'try-secret\|try-key' <(grep -v '"logger":"http.log\|"logger":"admin.api"' "$work/caddy-$store.log"); then
		echo "  a raw key is in fleetguard's log lines!"
	fi
	kill "$pid"; wait "$pid" 2>/dev/null || true
done
