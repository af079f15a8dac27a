# fleetguard: `make test` is the one test command (CI runs it through .ci/run).

GO ?= go

.PHONY: test redis-server vet unit fuzz bench caddy

# make test runs every test and every fuzzer's seed inputs under the race
# detector. On an empty build cache most of it is the race build of Caddy's
# tree. The fuzzers' mutation (make fuzz) needs a second build of that tree,
# instrumented, which alone would take make test past ten minutes on two
# cores: it is a target of its own, which CI runs after make test
# (.ci/run).
test: redis-server vet unit

# Tests start real redis-server processes (internal/redistest) and build
# clusters with redis-cli. Install the Debian package (it brings redis-cli)
# when either is missing and we can; otherwise say how.
redis-server:
	@if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then \
		redis-server --version; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "redis-server missing: installing Debian's redis-server"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null && redis-server --version; \
	else \
		echo "redis-server is required by the tests; install it with: sudo apt-get update && sudo apt-get install -y redis-server" >&2; \
		exit 1; \
	fi

# go vet with -race compiles every package as the race-detector tests below
# do, two at a time (unit's -p 1 would compile one at a time): the tests then
# link what it built.
vet:
	@test -z "$$(gofmt -l .)" || (echo "gofmt needed on:"; gofmt -l .; exit 1)
	@echo "go vet -race ./... (on an empty build cache this first builds Caddy and its dependencies with the race detector: minutes)"
	$(GO) vet -race ./...

# -vet=off: vet above ran every analyzer on every package and test file (go
# test's own vet would check a subset again, over the whole tree).
# The budget's ceiling suite runs alone, after every other test (two
# packages at a time): it holds only while the upstream sees a cut within its
# margin (two events), and a fake upstream that streams an event every 2 ms
# on a machine shared with another package's race-detector tests outran it
# (CI, 2026-12-03: billed 3,103 of a counter of 2,999).
CEILING := ^TestTheCeilingHoldsForAnyTextInEveryAPI$$
unit:
	$(GO) test -race -vet=off -count=1 -p 2 -skip '$(CEILING)' ./...
	$(GO) test -race -vet=off -count=1 -run '$(CEILING)' .

# The stream meter and the JSON usage readers take bytes from upstreams (and
# must read what the encoding/json readers they replaced read: the
# *MatchesReference fuzzers), the request readers from clients; each fuzzer
# runs from its seeds for a number of inputs (a count, not a duration: a duration's deadline can end a run with
# "context deadline exceeded" while a worker is busy). FUZZTIME overrides the
# counts for every fuzzer, e.g. make fuzz FUZZTIME=5m.
FUZZ_FAST ?= 150000x
FUZZ_SLOW ?= 3000x
fuzz: redis-server
	$(GO) test -vet=off -run '^$$' -fuzz '^FuzzMeter$$' -fuzztime $(or $(FUZZTIME),$(FUZZ_FAST)) ./budget/usage
	$(GO) test -vet=off -run '^$$' -fuzz '^FuzzFromJSON$$' -fuzztime $(or $(FUZZTIME),$(FUZZ_FAST)) ./budget/usage
	$(GO) test -vet=off -run '^$$' -fuzz '^FuzzMeterMatchesReference$$' -fuzztime $(or $(FUZZTIME),$(FUZZ_FAST)) ./budget/usage
	$(GO) test -vet=off -run '^$$' -fuzz '^FuzzFromJSONMatchesReference$$' -fuzztime $(or $(FUZZTIME),$(FUZZ_FAST)) ./budget/usage
	$(GO) test -vet=off -run '^$$' -fuzz '^FuzzParseRequestReadsExactCase$$' -fuzztime $(or $(FUZZTIME),$(FUZZ_FAST)) ./budget/usage
	$(GO) test -vet=off -run '^$$' -fuzz '^FuzzCountsAsTiktoken$$' -fuzztime $(or $(FUZZTIME),$(FUZZ_FAST)) ./budget/bpe
	$(GO) test -vet=off -run '^$$' -fuzz '^FuzzLLMBudgetBodies$$' -fuzztime $(or $(FUZZTIME),$(FUZZ_SLOW)) .
	$(GO) test -vet=off -run '^$$' -fuzz '^FuzzLeasedStream$$' -fuzztime $(or $(FUZZTIME),$(FUZZ_SLOW)) .
	$(GO) test -vet=off -run '^$$' -fuzz '^FuzzClosedWorld$$' -fuzztime $(or $(FUZZTIME),$(FUZZ_SLOW)) .
	$(GO) test -vet=off -run '^$$' -fuzz '^FuzzKeyFormsMatchTheReplacer$$' -fuzztime $(or $(FUZZTIME),$(FUZZ_SLOW)) .

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

caddy:
	$(GO) build -o bin/caddy ./cmd/caddy
