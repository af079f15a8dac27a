#!/usr/bin/env bash
# instructions.sh PKG BENCH [N1 N2]: instructions per op of one Go benchmark,
# counted by valgrind's callgrind, which counts the same whatever else the
# machine is doing (wall-clock ns/op on a shared machine moves by ±20%).
# The benchmark runs N1 and N2 times (default 20000 and 120000); the
# difference of the two totals over N2-N1 cancels the setup. Go's async
# preemption signals trip callgrind, so they are off for the count.
#
# The whole process's count includes work that follows the wall clock (the
# scavenger, sysmon, GC cycles falling differently), and under valgrind's
# slowdown that can swamp a short op: two runs can differ by more than the op.
# INSIDE=<function> counts only while that function is on the stack (its
# callees and the GC assists of its allocations included), over the N2+1
# calls of the benchmark's two invocations (b.N 1, then N2): repeatable to a
# few instructions. Use it when the op is one function's call.
#   bash bench/instructions.sh . 'FleetLimitServeHTTP$'
#   INSIDE='*FleetLimit).ServeHTTP' bash bench/instructions.sh . 'FleetLimitServeHTTP$'
#   TESTBIN=/tmp/old.test bash bench/instructions.sh - 'FleetLimitServeHTTP$'
set -euo pipefail
pkg=$1 bench=$2 n1=${3:-20000} n2=${4:-120000}
if ! command -v valgrind >/dev/null 2>&1; then
	echo "valgrind is required: sudo apt-get install -y valgrind" >&2
	exit 1
fi
bin=${TESTBIN:-}
if [ -z "$bin" ]; then
	bin=$(mktemp)
	trap 'rm -f "$bin"' EXIT
	go test -c -o "$bin" "$pkg"
fi
# total N: the instructions of a run of N; a run that callgrind did not see
# to its end (it prints no total) is tried again, up to three times.
total() {
	local count
	for _ in 1 2 3; do
		count=$(GODEBUG=asyncpreemptoff=1 valgrind --tool=callgrind --callgrind-out-file=/dev/null ${INSIDE:+--toggle-collect="$INSIDE"} "$bin" \
			-test.run '^$' -test.bench "$bench" -test.benchtime "$1x" -test.cpu 1 2>&1 |
			sed -n 's/.*Collected : \([0-9]*\).*/\1/p')
		if [ -n "$count" ]; then
			echo "$count"
			return
		fi
	done
	echo "callgrind gave no total for $1 runs of $bench" >&2
	exit 1
}
if [ -n "${INSIDE:-}" ]; then
	c=$(total "$n2")
	echo $((c / (n2 + 1)))
	exit
fi
a=$(total "$n1")
b=$(total "$n2")
echo $(((b - a) / (n2 - n1)))
