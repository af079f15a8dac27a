#!/usr/bin/env bash
# Tries streamed metering the way a new user would: a local upstream streams
# 20 OpenAI chunks 50 ms apart and reports 100 tokens of usage only when asked
# for it (stream_options.include_usage, which llmbudget adds). Prints the time
# to the first chunk at the client, how much the budget counter grew for an
# OpenAI stream and for an Anthropic stream (message_start input 30 + last
# message_delta output 70 = 100).
source "$(dirname "$0")/lib.sh"
redis_port=${REDIS_PORT:-6393}
start_redis "$redis_port"
"$work/fakellm" -addr 127.0.0.1:11502 -input 30 -output 70 -chunks 20 -interval 50ms 2>"$work/fakellm.log" &
cat >"$work/Caddyfile" <<CFG
{
	admin localhost:2401
	fleetguard {
		redis redis://127.0.0.1:$redis_port/0
		prefix streamtry
	}
}
:9301 {
	llmbudget {
		budget all {
			unit tokens
			limit 1000000
			window 1h
		}
	}
	reverse_proxy 127.0.0.1:11502
}
CFG
"$work/caddy" run --config "$work/Caddyfile" >"$work/caddy.log" 2>&1 &
sleep 2
counter() {
	local k
	k=$(redis-cli -p "$redis_port" --scan --pattern 'streamtry:bg:{b}:all:*' | head -1)
	if [ -z "$k" ]; then echo 0; else redis-cli -p "$redis_port" get "$k"; fi
}
stream() { # path body
	local start first=""
	start=$(date +%s%N)
	curl -sN "localhost:9301$1" -H 'Content-Type: application/json' -d "$2" | while IFS= read -r line; do
		if [ -z "$first" ] && [[ $line == data:* ]]; then
			first=$(($(date +%s%N) - start))
			echo "first chunk after $((first / 1000000)) ms"
		fi
	done
	echo "whole stream after $((($(date +%s%N) - start) / 1000000)) ms"
}
before=$(counter)
stream /v1/chat/completions '{"model":"gpt-4o","stream":true,"max_tokens":500,"messages":[{"role":"user","content":"count"}]}'
sleep 0.3
after=$(counter)
echo "OpenAI stream: counter grew by $((after - before)) (upstream reported 100)"
before=$after
stream /v1/messages '{"model":"claude-sonnet-4-5","stream":true,"max_tokens":500,"messages":[{"role":"user","content":"count"}]}'
sleep 0.3
after=$(counter)
echo "Anthropic stream: counter grew by $((after - before)) (message_start 30 + last message_delta 70)"
