#!/usr/bin/env bash
# Tries a two-instance fleet on one machine the way a new user would: two Caddy
# processes built from cmd/caddy, one Redis, sync_interval 100ms, a zone of
# events 20 per 10s keyed on a header; 60 requests 50 ms apart alternating
# between the instances. Prints how many the fleet admitted (expect 20 to 23)
# and whether every 429 carried Retry-After.
source "$(dirname "$0")/lib.sh"
redis_port=${REDIS_PORT:-6391}
start_redis "$redis_port"
for n in 1 2; do
	cat >"$work/fleet$n.Caddyfile" <<CFG
{
	admin localhost:$((2200 + n))
	fleetguard {
		redis redis://127.0.0.1:$redis_port/0
		sync_interval 100ms
	}
}
:$((9100 + n)) {
	fleetlimit {
		zone per_key {
			key {http.request.header.X-API-Key}
			events 20
			window 10s
		}
	}
	respond "instance $n"
}
CFG
	"$work/caddy" run --config "$work/fleet$n.Caddyfile" >"$work/caddy$n.log" 2>&1 &
done
sleep 2
admitted=0 denied=0 missing_retry=0
for i in $(seq 60); do
	headers=$(curl -s -D - -o /dev/null -H "X-API-Key: try-$$" "localhost:$((9101 + i % 2))/")
	case "$(head -1 <<<"$headers" | awk '{print $2}')" in
	200) admitted=$((admitted + 1)) ;;
	429)
		denied=$((denied + 1))
		grep -qi '^retry-after: [0-9]' <<<"$headers" || missing_retry=$((missing_retry + 1))
		;;
	*) echo "unexpected answer: $headers" >&2 ;;
	esac
	sleep 0.05
done
echo "admitted=$admitted denied=$denied denied_without_retry_after=$missing_retry"
