# Shared setup of the bench/*-try.sh scripts (sourced, not run): a scratch
# folder removed at exit with every background process, the binaries built from
# this checkout, and a throwaway redis-server.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
go build -o "$work/caddy" ./cmd/caddy
go build -o "$work/fakellm" ./bench/fakellm

# start_redis PORT: a redis-server without persistence on PORT.
start_redis() {
	redis-server --port "$1" --save '' --appendonly no >"$work/redis.log" 2>&1 &
}
