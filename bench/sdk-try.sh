#!/usr/bin/env bash
# Tries the official OpenAI and Anthropic Node SDKs at default settings against
# Caddy + llmbudget (a per-key 1000-token budget per hour, no principal set)
# in front of bench/fakellm; installs the SDKs from npm into a scratch folder.
# A third site (:9403) fronts it with a fleetlimit of one request per key per
# 10 minutes: the SDKs must raise their rate-limit error with a readable message.
# A second site (:9402, a per-key 600-token budget per hour) fronts a fakellm
# that writes long answers, so a stream asking for 4096 tokens is admitted
# with its output lease and cut when an extension is refused: the SDKs must
# read it as a finished, truncated answer.
# The OpenAI SDK's ResponsesWS (the Responses API's WebSocket mode) runs on the
# first site against fakellm's socket mode: a refusal must be an error event on
# the open socket; its OpenAIRealtimeWS runs on a fourth site (:9405) against
# fakellm's Realtime over TLS (the SDK dials wss: only): a refusal must be an
# error event on the open session. The @google/genai SDK's ai.live.connect
# runs on a fifth site (:9406) against fakellm's Gemini Live: a refusal must
# close the session with a reason naming the budget.
# Prints PASS/FAIL per check (bench/sdk/try.mjs says what each checks).
source "$(dirname "$0")/lib.sh"
"$work/fakellm" -addr 127.0.0.1:11503 -input 30 -output 70 -chunks 40 -interval 2ms 2>"$work/fakellm.log" &
"$work/fakellm" -addr 127.0.0.1:11504 -input 30 -words -output 3000 -chunks 600 -interval 1ms 2>"$work/fakellm-long.log" &
cat >"$work/sdk.Caddyfile" <<CFG
{
	admin localhost:2501
	skip_install_trust
}
:9401 {
	llmbudget {
		budget per_key {
			scope key
			unit tokens
			limit 1000
			window 1h
		}
	}
	reverse_proxy 127.0.0.1:11503
}
:9404 {
	llmbudget {
		budget per_key_usd {
			scope key
			unit usd
			limit 0.001
			window 1h
		}
		price gpt-4o* 2.50 10.00
		price claude-sonnet* 3.00 15.00
	}
	reverse_proxy 127.0.0.1:11503
}
:9403 {
	fleetlimit {
		zone per_key_rate {
			key {http.request.header.Authorization}{http.request.header.X-Api-Key}
			events 1
			window 10m
		}
	}
	reverse_proxy 127.0.0.1:11503
}
:9406 {
	llmbudget {
		budget live {
			scope key
			unit tokens
			limit 30000
			window 1h
		}
		context_window 20000
	}
	reverse_proxy 127.0.0.1:11503
}
https://127.0.0.1:9405 {
	tls internal
	llmbudget {
		budget realtime {
			scope key
			unit tokens
			limit 30000
			window 1h
		}
		context_window 20000
	}
	reverse_proxy 127.0.0.1:11503
}
:9402 {
	llmbudget {
		budget lease_key {
			scope key
			unit tokens
			limit 600
			window 1h
		}
	}
	reverse_proxy 127.0.0.1:11504
}
CFG
"$work/caddy" run --config "$work/sdk.Caddyfile" >"$work/caddy.log" 2>&1 &
(cd "$work" && npm init -y >/dev/null && npm install --silent openai @anthropic-ai/sdk @google/genai ws >/dev/null 2>&1)
echo "SDKs: openai $(grep -m1 '"version"' "$work/node_modules/openai/package.json" | cut -d'"' -f4), @anthropic-ai/sdk $(grep -m1 '"version"' "$work/node_modules/@anthropic-ai/sdk/package.json" | cut -d'"' -f4), @google/genai $(grep -m1 '"version"' "$work/node_modules/@google/genai/package.json" | cut -d'"' -f4)"
cp bench/sdk/try.mjs "$work/try.mjs"
sleep 1
# A model leases once one streamed answer of its has shown it bills no output
# its text does not show: one short answer of each model first, each under a
# key of its own. gpt-4o's second is counted by its tokenizer (the first
# loads it) and proves its bill within that count, so its cut streams below
# are leased by o200k counts.
for _ in 1 2; do
	curl -s -o /dev/null -H 'Authorization: Bearer sk-warm-chat' -H 'Content-Type: application/json' \
		-d '{"model":"gpt-4o","stream":true,"max_tokens":300,"messages":[{"role":"user","content":"hi"}]}' http://127.0.0.1:9402/v1/chat/completions
	sleep 0.3
done
curl -s -o /dev/null -H 'x-api-key: sk-warm-claude' -H 'anthropic-version: 2023-06-01' -H 'Content-Type: application/json' \
	-d '{"model":"claude-sonnet-4-6","stream":true,"max_tokens":300,"messages":[{"role":"user","content":"hi"}]}' http://127.0.0.1:9402/v1/messages
sleep 0.3
CADDY_URL=http://127.0.0.1:9401 LEASE_URL=http://127.0.0.1:9402 RATE_URL=http://127.0.0.1:9403 USD_URL=http://127.0.0.1:9404 REALTIME_URL=https://127.0.0.1:9405 LIVE_URL=http://127.0.0.1:9406 node "$work/try.mjs"
