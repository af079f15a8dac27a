#!/usr/bin/env bash
# Tries a two-instance fleet on a 3-node Redis Cluster the way a new user would:
# two Caddy processes built from cmd/caddy, sync_interval 100ms, a zone of
# events 20 per 10s keyed on a header; 5 keys x 40 requests, alternating
# between the instances. Prints what each key got admitted (expect 20 to 23)
# and the reconciler's warnings and errors from both logs (expect none).
source "$(dirname "$0")/lib.sh"
base=${CLUSTER_PORT:-7101}
nodes=()
for i in 0 1 2; do
	port=$((base + i))
	redis-server --port "$port" --save '' --appendonly no --cluster-enabled yes \
		--cluster-config-file "$work/nodes-$i.conf" --cluster-node-timeout 2000 >"$work/redis-$i.log" 2>&1 &
	nodes+=("127.0.0.1:$port")
done
sleep 1
redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$work/cluster.log" 2>&1
until redis-cli -p "$base" cluster info | grep -q cluster_state:ok; do sleep 0.1; done
url="redis://${nodes[0]}?addr=${nodes[1]}&addr=${nodes[2]}"
for n in 1 2; do
	cat >"$work/fleet$n.Caddyfile" <<CFG
{
	admin localhost:$((2300 + n))
	fleetguard {
		redis_cluster "$url"
		sync_interval 100ms
	}
}
:$((9200 + n)) {
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
declare -A admitted
for i in $(seq 40); do
	for k in 1 2 3 4 5; do
		code=$(curl -s -o /dev/null -w '%{http_code}' -H "X-API-Key: key$k-$$" "localhost:$((9201 + (i + k) % 2))/")
		[ "$code" = 200 ] && admitted[$k]=$((${admitted[$k]:-0} + 1))
	done
	sleep 0.02
done
for k in 1 2 3 4 5; do echo "key$k admitted=${admitted[$k]:-0}"; done
echo "reconciler warnings/errors:"
grep -h '"logger":"fleetguard' "$work"/caddy?.log | grep -E '"level":"(warn|error)"' || echo "none"
