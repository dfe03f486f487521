# pgidem — see README.md. Every target runs against a real Postgres server found through
# DATABASE_URL, libpq PG* variables, or postgres://postgres@127.0.0.1:5432 (internal/dbserver).
# The pooler tests (pooler_test.go) also need PgBouncer: PGIDEM_PGBOUNCER_URL, or a pgbouncer
# binary they start themselves (internal/pgbouncer; Debian: apt-get install pgbouncer).

GO            ?= go
STATICCHECK   := honnef.co/go/tools/cmd/staticcheck@v0.8.2
BENCHSTAT     := golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da
TEST_FLAGS    ?=
BENCH         ?= .
BENCH_COUNT   ?= 6
FLOOR_COUNT   ?= 5
SCALE_COUNT   ?= 1
FUZZTIME      ?= 30s
FUZZ_TARGETS  := FuzzKey FuzzResultRoundTrip FuzzInboxPayload

.PHONY: all test lint fuzz demo bench bench-scale bench-micro bench-river bench-http build tidy

all: lint test

build:
	$(GO) build ./...

## test: every package under the race detector, against real Postgres (and, for the
## watermill module, RabbitMQ on 127.0.0.1:5672 and an in-process Kafka).
test:
	$(GO) test -race -count=1 -timeout 20m $(TEST_FLAGS) ./...
	cd watermill && $(GO) test -race -count=1 -timeout 20m $(TEST_FLAGS) ./...

## fuzz: each fuzz target for FUZZTIME, against real Postgres (seed corpora in each package's testdata/fuzz).
fuzz:
	@set -e; for target in $(FUZZ_TARGETS); do \
		$(GO) test -run '^$$' -fuzz "^$$target\$$" -fuzztime $(FUZZTIME) ./pgidem/; \
	done
	$(GO) test -run '^$$' -fuzz '^FuzzParseKey$$' -fuzztime $(FUZZTIME) ./http/

## lint: gofmt, go vet, staticcheck.
lint:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needs to run on:"; echo "$$unformatted"; exit 1; fi
	$(GO) vet ./...
	$(GO) run $(STATICCHECK) ./...
	cd watermill && $(GO) vet ./... && $(GO) run $(STATICCHECK) ./...

## demo: the lab's three redelivery scenes, the Kafka consumer, the River worker, the HTTP API and reconciling a takeover, on real Postgres.
demo:
	$(GO) run ./examples/lab
	$(GO) run ./examples/consumer
	$(GO) run ./examples/riverworker
	$(GO) run ./examples/httpapi
	$(GO) run ./examples/reconcile

## bench: pgidem against the floor (hand-written statements in pgidem/floor_bench_test.go),
## alternating slices in one process; prints benchstat lines, then each ratio's median and
## range over the runs (about 2 min per run; see docs/performance.md); then how soon a
## waiter returns after the holder's completion, polling against notified.
bench:
	$(GO) test -run '^$$' -bench 'BenchmarkFloor' -benchtime 1x -count $(FLOOR_COUNT) -timeout 15m ./pgidem/ | tee bench.txt
	$(GO) run $(BENCHSTAT) bench.txt
	$(GO) run ./internal/benchsql/benchratio bench.txt
	$(GO) test -run '^$$' -bench 'BenchmarkWakeup' -benchtime 100x ./pgidem/

## bench-scale: p99 of 16 callers with 10 million records (PGIDEM_SCALE_RECORDS) beside
## 10 thousand, and while a sweep of a million expired records runs; then the table's size
## after 10 minutes of churn (PGIDEM_CHURN_DURATION), with autovacuum's defaults and tuned.
## SCALE_COUNT runs, about 25 minutes each.
bench-scale:
	$(GO) test -run '^$$' -bench 'BenchmarkScale|BenchmarkSweepLoad|BenchmarkChurn' -benchtime 1x -count $(SCALE_COUNT) -timeout 90m ./pgidem/ | tee bench-scale.txt
	$(GO) run ./internal/benchsql/benchratio bench-scale.txt

## bench-micro: pgidem's other benchmarks (BenchmarkDo, BenchmarkDoConcurrent, DoTx).
bench-micro:
	$(GO) test -run '^$$' -bench '$(BENCH)' -benchmem -count $(BENCH_COUNT) ./pgidem/

## bench-river: jobs per second through River with and without the middleware.
bench-river:
	$(GO) test -run '^$$' -bench RiverThroughput -benchtime 10000x -count 6 ./river/

## bench-http: a POST handler behind pgidemhttp beside a hand-written raw-SQL wrapper.
bench-http:
	$(GO) test -run '^$$' -bench Handler -count $(BENCH_COUNT) ./http/

tidy:
	$(GO) mod tidy
	cd watermill && $(GO) mod tidy
