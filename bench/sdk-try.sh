#!/usr/bin/env bash
# Tries the official OpenAI and Anthropic Node SDKs at default settings against
# Caddy + llmbudget (a per-key 1000-token budget per hour, no principal set)
# in front of bench/fakellm; installs the SDKs from npm into a scratch folder.
# Prints PASS/FAIL per check (bench/sdk/try.mjs says what each checks).
source "$(dirname "$0")/lib.sh"
"$work/fakellm" -addr 127.0.0.1:11503 -input 30 -output 70 -chunks 40 -interval 2ms 2>"$work/fakellm.log" &
cat >"$work/sdk.Caddyfile" <<CFG
{
	admin localhost:2501
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
CFG
"$work/caddy" run --config "$work/sdk.Caddyfile" >"$work/caddy.log" 2>&1 &
(cd "$work" && npm init -y >/dev/null && npm install --silent openai @anthropic-ai/sdk >/dev/null 2>&1)
echo "SDKs: openai $(grep -m1 '"version"' "$work/node_modules/openai/package.json" | cut -d'"' -f4), @anthropic-ai/sdk $(grep -m1 '"version"' "$work/node_modules/@anthropic-ai/sdk/package.json" | cut -d'"' -f4)"
cp bench/sdk/try.mjs "$work/try.mjs"
sleep 1
CADDY_URL=http://127.0.0.1:9401 node "$work/try.mjs"
