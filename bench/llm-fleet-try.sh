#!/usr/bin/env bash
# Tries llmbudget the way a new user would, against a local OpenAI-compatible
# upstream (bench/fakellm) that reports 100 tokens of usage per request:
#  1. a per-key token budget of 1000 with max_tokens 200: 8 sequential requests
#     are admitted and the 9th gets 429 with a JSON error body;
#  2. two Caddy instances on one Redis, 50 concurrent requests to a slow
#     upstream: the usage of the admitted requests stays within the budget and
#     the Redis counter equals it when all are done.
source "$(dirname "$0")/lib.sh"
redis_port=${REDIS_PORT:-6392}
start_redis "$redis_port"
"$work/fakellm" -addr 127.0.0.1:11501 -input 30 -output 70 -delay 300ms 2>"$work/fakellm.log" &
for n in 1 2; do
	cat >"$work/llm$n.Caddyfile" <<CFG
{
	admin localhost:$((2300 + n))
	fleetguard {
		redis redis://127.0.0.1:$redis_port/0
		prefix llmtry
	}
}
:$((9200 + n)) {
	llmbudget {
		principal {http.request.header.Authorization}
		budget per_key {
			scope key
			unit tokens
			limit 1000
			window 1h
		}
	}
	reverse_proxy 127.0.0.1:11501
}
CFG
	"$work/caddy" run --config "$work/llm$n.Caddyfile" >"$work/caddy$n.log" 2>&1 &
done
sleep 2
body='{"model":"gpt-4o","max_tokens":200,"messages":[{"role":"user","content":"hi"}]}'

echo "== 1. sequential, one instance, key seq-$$"
codes=()
for i in $(seq 9); do
	codes+=("$(curl -s -o "$work/last.json" -w '%{http_code}' localhost:9201/v1/chat/completions \
		-H "Authorization: Bearer seq-$$" -H 'Content-Type: application/json' -d "$body")")
done
echo "statuses: ${codes[*]}"
echo "9th body: $(cat "$work/last.json")"

echo "== 2. 50 concurrent across two instances, key conc-$$"
for i in $(seq 50); do
	curl -s -o /dev/null -w '%{http_code}\n' "localhost:$((9201 + i % 2))/v1/chat/completions" \
		-H "Authorization: Bearer conc-$$" -H 'Content-Type: application/json' -d "$body" >>"$work/conc.txt" &
done
wait_for=50
while [ "$(wc -l <"$work/conc.txt")" -lt "$wait_for" ]; do sleep 0.1; done
sleep 0.5
admitted=$(grep -c '^200$' "$work/conc.txt" || true)
denied=$(grep -c '^429$' "$work/conc.txt" || true)
key=$(redis-cli -p "$redis_port" --scan --pattern 'llmtry:bg:{b}:per_key:*' | while read -r k; do
	[ "$(redis-cli -p "$redis_port" get "$k")" != "" ] && echo "$k"; done | while read -r k; do
	echo "$k $(redis-cli -p "$redis_port" get "$k")"; done)
echo "admitted=$admitted denied=$denied usage_of_admitted=$((admitted * 100)) (budget 1000)"
echo "redis counters (key, value):"
echo "$key"
