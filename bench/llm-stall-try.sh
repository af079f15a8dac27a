#!/usr/bin/env bash
# Tries llmbudget under Redis stalls the way a new user would: two Caddy
# processes on one Redis in front of bench/fakellm (100 tokens of usage per
# answer), 40 requests a second for 12 s while Redis stalls (DEBUG SLEEP) for
# 2 s and then for 4 s. Prints the answers, the slowest 503 once the store was
# known to be down, and the Redis counter against the usage of the admitted
# requests (they must be equal: a 503 is never charged), and the slowest
# admitted answers (a settle caught in a stall runs after the response).
source "$(dirname "$0")/lib.sh"
redis_port=${REDIS_PORT:-6393}
redis-server --port "$redis_port" --save '' --appendonly no --enable-debug-command yes >"$work/redis.log" 2>&1 &
"$work/fakellm" -addr 127.0.0.1:11502 -input 30 -output 70 2>"$work/fakellm.log" &
for n in 1 2; do
	cat >"$work/llm$n.Caddyfile" <<CFG
{
	admin localhost:$((2400 + n))
	fleetguard {
		redis redis://127.0.0.1:$redis_port/0
		prefix stalltry
	}
}
:$((9300 + n)) {
	llmbudget {
		budget all {
			scope global
			unit tokens
			limit 100000000
			window 1h
		}
	}
	reverse_proxy 127.0.0.1:11502
}
CFG
	"$work/caddy" run --config "$work/llm$n.Caddyfile" >"$work/caddy$n.log" 2>&1 &
done
sleep 2
body='{"model":"gpt-4o","max_tokens":75,"messages":[{"role":"user","content":"hi"}]}'
( sleep 2; redis-cli -p "$redis_port" DEBUG SLEEP 2 >/dev/null; sleep 2; redis-cli -p "$redis_port" DEBUG SLEEP 4 >/dev/null ) &
start=$(date +%s.%N)
for i in $(seq 480); do
	curl -s -o /dev/null -w "%{http_code} %{time_total} $i\n" "localhost:$((9301 + i % 2))/v1/chat/completions" \
		-H 'Content-Type: application/json' -d "$body" >>"$work/answers.txt" &
	sleep 0.025
done
wait_for=480
while [ "$(wc -l <"$work/answers.txt")" -lt "$wait_for" ]; do sleep 0.1; done
sleep 6 # settles and background releases finish
admitted=$(grep -c '^200 ' "$work/answers.txt" || true)
unavailable=$(grep -c '^503 ' "$work/answers.txt" || true)
other=$(grep -vc '^\(200\|503\) ' "$work/answers.txt" || true)
echo "answers: 200=$admitted 503=$unavailable other=$other"
echo "slowest 503s (s): $(grep '^503 ' "$work/answers.txt" | sort -k2 -nr | head -5 | awk '{printf "%s ", $2}')"
echo "503s slower than 0.1 s: $(grep '^503 ' "$work/answers.txt" | awk '$2 > 0.1' | wc -l)"
echo "slowest 200s (s): $(grep '^200 ' "$work/answers.txt" | sort -k2 -nr | head -5 | awk '{printf "%s ", $2}')"
counter=0
for k in $(redis-cli -p "$redis_port" --scan --pattern 'stalltry:bg:{b}:all:*'); do
	counter=$((counter + $(redis-cli -p "$redis_port" get "$k")))
done
echo "usage of admitted requests=$((admitted * 100)) redis counter=$counter"
grep -h 'budget store' "$work"/caddy?.log | sed 's/.*"msg":"\([^"]*\)".*/  log: \1/' | sort | uniq -c
