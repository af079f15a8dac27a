#!/usr/bin/env bash
# The stream meter's throughput on the golden transcripts (BenchmarkMeter, a
# new Meter per stream, 512-byte writes) beside the encoding/json meter it
# replaced (BenchmarkMeterReference, the same input), in interleaved rounds:
# each round runs both, in turn first. It prints per format the median and
# best MB/s of each and the median of the per-round ratios Meter/Reference.
#
# On a shared machine one binary's MB/s moves by up to 2x within minutes;
# the two meters of one round see about the same machine, so their ratio
# moves far less than either figure. (bench/instructions.sh-style counts,
# which do not move at all, are in BENCHMARKS.md.)
#
# Settings (environment), with defaults: ROUNDS (11), BENCHTIME (200ms, per
# benchmark and round), CPU (1: GOMAXPROCS of the benchmark).
set -euo pipefail
ROUNDS=${ROUNDS:-11}
BENCHTIME=${BENCHTIME:-200ms}
CPU=${CPU:-1}

cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
go test -c -o "$work/usage.test" ./budget/usage

# run ROUND BENCH: appends "ROUND BENCH FORMAT MB/s" lines to $work/runs.
run() {
	(cd budget/usage && "$work/usage.test" -test.run '^$' -test.bench "^Benchmark$2\$" \
		-test.benchtime "$BENCHTIME" -test.cpu "$CPU") |
		awk -v r="$1" -v b="$2" '$1 ~ /^Benchmark/ { split($1, n, "/"); sub(/-[0-9]+$/, "", n[2]); for (i = 1; i < NF; i++) if ($(i+1) == "MB/s") print r, b, n[2], $i }' >>"$work/runs"
}

for ((r = 1; r <= ROUNDS; r++)); do
	if ((r % 2)); then run "$r" Meter; run "$r" MeterReference; else run "$r" MeterReference; run "$r" Meter; fi
	printf 'round %d done\n' "$r" >&2
done

median() { sort -g | awk '{v[NR] = $1} END {if (NR % 2) print v[(NR + 1) / 2]; else printf "%.2f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

echo "## Stream meter: golden transcripts, $ROUNDS interleaved rounds of -test.benchtime $BENCHTIME, -test.cpu $CPU"
echo "$(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); $(go version | cut -d' ' -f3)"
echo
echo "| format | Meter median MB/s | Meter best | Reference median MB/s | Reference best | median ratio Meter/Reference |"
echo "|---|---:|---:|---:|---:|---:|"
for f in $(awk '{print $3}' "$work/runs" | awk '!seen[$0]++'); do
	m=$(awk -v f="$f" '$2 == "Meter" && $3 == f {print $4}' "$work/runs")
	ref=$(awk -v f="$f" '$2 == "MeterReference" && $3 == f {print $4}' "$work/runs")
	ratio=$(awk -v f="$f" '$3 == f {v[$1 " " $2] = $4} END {for (k in v) {split(k, p, " "); if (p[2] == "Meter" && (p[1] " MeterReference") in v) print v[k] / v[p[1] " MeterReference"]}}' "$work/runs" | median)
	printf '| %s | %s | %s | %s | %s | %.1f |\n' "$f" "$(echo "$m" | median)" "$(echo "$m" | sort -g | tail -1)" \
		"$(echo "$ref" | median)" "$(echo "$ref" | sort -g | tail -1)" "$ratio"
done
