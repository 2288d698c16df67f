# idemq: run `make` or `make help` for the list of targets.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

GO ?= go
# Extra flags for go test, e.g. make test TESTFLAGS='-run TestReserve -v'
TESTFLAGS ?=
# Extra arguments for the demo and bench subcommands, e.g. make demo ARGS='--payments 500'
ARGS ?=

# Services the tests use; override to point them elsewhere.
IDEMQ_TEST_POSTGRES_URL ?= postgres://postgres@127.0.0.1:5432/test?sslmode=disable
IDEMQ_TEST_AMQP_URL ?= amqp://guest:guest@127.0.0.1:5672/
export IDEMQ_TEST_POSTGRES_URL IDEMQ_TEST_AMQP_URL

# The library (.), its telemetry setup (consumer/idemqotel), the binary
# (cmd/idemq), the end-to-end tests (integration) and the UI's browser test
# (integration/browser) are five modules tied by go.work; a pattern names each.
PKGS := ./... ./consumer/idemqotel/... ./cmd/idemq/... ./integration/... ./integration/browser/...
# What make test runs a second time through PgBouncer in transaction mode:
# the consumer (every mode, in the conformance suite), the worker, the key
# store and the HTTP middleware, migrations, the outbox and its relay, GC,
# the gateway, the UI and the DLQ tools, and the end-to-end suite.
POOLED_PKGS := ./consumer ./consumer/worker ./dedup/... ./outbox/... ./internal/conformance ./internal/sweep \
	./cmd/idemq/internal/gateway ./cmd/idemq/internal/ui ./cmd/idemq/internal/dlq ./integration

.PHONY: help up test lint demo bench scale chaos cluster cluster-up cluster-down fuzz build jaeger tidy screenshots

help: ## Show this list of targets
	@echo 'Usage: make <target> [TESTFLAGS=...] [ARGS=...]'
	@echo
	@awk 'BEGIN { FS = ":.*## " } /^[a-zA-Z0-9_-]+:.*## / { printf "  %-12s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

up: ## Make sure Postgres (127.0.0.1:5432) and RabbitMQ (127.0.0.1:5672) run, starting them if needed
	@bash deploy/local/ensure-services.sh

test: up ## go vet, then unit + integration tests with -race against real Postgres and RabbitMQ (+ Jaeger, headless Chromium, Node.js)
	@# The tracing test runs a real Jaeger: build it once (about 10 minutes cold,
	@# then cached in ~/.cache/idemq; a no-op when it is there).
	@bash deploy/jaeger/build.sh >/dev/null
	@# The UI's browser test drives headless Chromium: install Debian's
	@# chromium where it is missing (a no-op when it is there).
	@bash deploy/local/ensure-chromium.sh
	@# The interop tests publish and read CloudEvents with Node.js packages
	@# (integration/interop): install Node.js 18+ where it is missing.
	@bash deploy/local/ensure-node.sh
	@# The HTTP rows of idemq bench (and their test) load the servers with
	@# wrk: install Debian's where it is missing.
	@bash deploy/local/ensure-wrk.sh
	@# The suites of POOLED_PKGS run a second time through PgBouncer in
	@# transaction pooling mode (docs/operations.md, "PgBouncer"); the first
	@# pass uses it too (the relay's LISTEN through a pooler): start it.
	$(eval IDEMQ_TEST_PGBOUNCER_URL := $(shell bash deploy/local/ensure-pgbouncer.sh))
	@[[ -n "$(IDEMQ_TEST_PGBOUNCER_URL)" ]] || { echo "PgBouncer did not start (deploy/local/ensure-pgbouncer.sh)"; exit 1; }
	$(GO) vet $(PKGS)
	IDEMQ_TEST_PGBOUNCER_URL='$(IDEMQ_TEST_PGBOUNCER_URL)' $(GO) test -race -count=1 -timeout 20m $(TESTFLAGS) $(PKGS)
	IDEMQ_TEST_PGBOUNCER_URL='$(IDEMQ_TEST_PGBOUNCER_URL)' IDEMQ_TEST_POSTGRES_URL='$(IDEMQ_TEST_PGBOUNCER_URL)' \
		IDEMQ_TEST_POSTGRES_DIRECT_URL='$(IDEMQ_TEST_POSTGRES_URL)' $(GO) test -race -count=1 -timeout 20m $(TESTFLAGS) $(POOLED_PKGS)
	@# Every fuzz target for a bounded time (their seed corpora ran above).
	$(MAKE) fuzz FUZZTIME=$(TEST_FUZZTIME)

lint: ## gofmt check, go vet, and golangci-lint when it is on PATH
	@unformatted=$$(find . -name '*.go' -not -path './.git/*' -not -path './.cache/*' -not -path './vendor/*' -print0 | xargs -0 -r gofmt -l); \
	if [[ -n $$unformatted ]]; then echo "gofmt: these files need formatting (gofmt -w):"; echo "$$unformatted"; exit 1; fi
	$(GO) vet $(PKGS)
	@if command -v golangci-lint >/dev/null 2>&1; then \
		echo 'golangci-lint run $(PKGS)'; golangci-lint run $(PKGS); \
	else \
		echo 'golangci-lint not on PATH: skipped (go install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@latest)'; \
	fi

demo: up ## Run the payments scenario end to end (idemq demo), traced into the local Jaeger when it is built (ARGS=--ui builds it)
	@# With the local Jaeger built (make jaeger, or the first make test) and
	@# nothing answering, start it for the run and stop it after: the report
	@# then links a suppressed duplicate to its original processing. With
	@# ARGS=--ui, build it first if needed (once, about 10 minutes), so that
	@# the UI's Duplicates and trace pages have traces to show.
	@started=; \
	if [[ -z "$${OTEL_EXPORTER_OTLP_ENDPOINT:-}" ]] && ! curl -fsS -o /dev/null --max-time 2 http://127.0.0.1:16686/api/services 2>/dev/null; then \
		if [[ " $(ARGS) " == *" --ui "* ]] && ! bash deploy/jaeger/build.sh --cached >/dev/null; then \
			echo "building the local Jaeger once (about 10 minutes on 2 cores, cached in ~/.cache/idemq), for idemq ui's traces"; \
			bash deploy/jaeger/build.sh >/dev/null; \
		fi; \
		if bash deploy/jaeger/build.sh --cached >/dev/null; then \
			bash deploy/jaeger/run.sh && started=1; \
		fi; \
	fi; \
	rc=0; $(GO) run ./cmd/idemq demo $(ARGS) || rc=$$?; \
	if [[ -n "$$started" && -z "$${KEEP_JAEGER:-}" ]]; then \
		echo "stopping the local Jaeger started for the demo (make demo KEEP_JAEGER=1 keeps it, to open the links)"; \
		bash deploy/jaeger/stop.sh; \
	fi; \
	exit $$rc

bench: up ## Run the benchmark of docs/benchmarks.md (a few minutes); ARGS=--full for the 50,000-message run
	@bash deploy/local/ensure-wrk.sh
	$(GO) run ./cmd/idemq bench --plot docs/img/bench.svg $(ARGS)

# make scale: one simulated day of keys, then SCALE_CYCLES cycles of a worker
# at SCALE_RATE operations/s while GC retires as many (docs/operations.md).
# Develop with e.g. make scale SCALE_KEYS=200000 SCALE_CYCLE=20s.
SCALE_KEYS ?= 10000000
SCALE_CYCLES ?= 10
SCALE_CYCLE ?= 1m
SCALE_RATE ?= 400
# GC vacuums each table after deleting: the CI Postgres runs with autovacuum
# off; where it is on, SCALE_ARGS= measures autovacuum alone.
SCALE_ARGS ?= --vacuum

scale: up ## Retention at size: load 10 M keys (SCALE_KEYS), run a worker while GC retires as many, print a table per cycle (under 30 min)
	$(GO) run ./cmd/idemq scale --keys $(SCALE_KEYS) --cycles $(SCALE_CYCLES) --cycle $(SCALE_CYCLE) --rate $(SCALE_RATE) $(SCALE_ARGS) $(ARGS)

chaos: up ## Long soaks (build tag chaos): 50,000 messages under faults, then 200 entities × 50 ordered events; IDEMQ_CHAOS_MESSAGES=N to change
	$(GO) test -race -count=1 -timeout 60m -tags chaos -v $(TESTFLAGS) ./integration/chaos/...

# make cluster: the soak on a three-node RabbitMQ cluster and three Postgres
# members under Patroni (synchronous mode, one etcd), made on this machine for
# the run and removed after it, also when it fails or is interrupted
# (docs/operations.md, Production topology and Production Postgres).
cluster: ## Soak on the production topology (3 RabbitMQ nodes, 3 Postgres members under Patroni + etcd) with node losses, leader kills and switchovers, unordered and ordered; creates and removes it (under 35 min)
	@trap '$(MAKE) cluster-down' EXIT; \
	$(GO) test -race -count=1 -timeout 34m -tags cluster -run '^(TestFailoverLosesOnlyAsynchronousReservations|TestSoakCluster|TestSoakOrderedCluster)$$' -v $(TESTFLAGS) ./integration/chaos/

cluster-up: ## Create the topology of make cluster and leave it running; prints IDEMQ_AMQP_URL and IDEMQ_POSTGRES_URL for it
	@$(GO) test -count=1 -tags cluster -run '^TestClusterUp$$' -v ./integration/chaos/ | grep '^IDEMQ_'

cluster-down: ## Remove what make cluster left: nodes idemq-c1..c3@localhost, Patroni, its Postgres and etcd under /var/lib/postgresql/idemq-patroni
	@$(GO) test -count=1 -tags cluster -run '^TestClusterDown$$' ./integration/chaos/

# Fuzz targets as package:Target; make fuzz runs each for FUZZTIME. Their seed
# corpora (testdata/fuzz) also run as plain tests in make test.
FUZZTIME ?= 10s
# How long make test fuzzes each target.
# A count, not a duration: Go 1.26's fuzz coordinator can fail a target with
# "context deadline exceeded" when a duration's deadline races a busy worker
# (golang/go#75804, fixed in Go 1.27); a count has no deadline to race.
# About 5 s per target on this machine.
TEST_FUZZTIME ?= 20000x
FUZZ_TARGETS := dedup:FuzzValidateKey dedup:FuzzJSONFieldsFingerprint \
	internal/wire:FuzzExtractKey internal/wire:FuzzExtractTenant internal/wire:FuzzParseAttempt \
	internal/wire:FuzzDeadLetterHeaders consumer:FuzzTraceContext \
	internal/fieldtable:FuzzRoundTrip cmd/idemq/internal/ui:FuzzLocalPath internal/redact:FuzzRedact

screenshots: up ## Take docs/img/ui-*.png anew: the browser tests, writing their screenshots into docs/img
	@bash deploy/local/ensure-chromium.sh
	cd integration/browser && IDEMQ_UI_SCREENSHOTS=$(CURDIR)/docs/img $(GO) test -count=1 -run 'TestOperator' .

fuzz: ## Fuzz key, tenant, attempt, trace context, fingerprint, dead-letter header parsing and the field-table codec, FUZZTIME (10s) each
	@for target in $(FUZZ_TARGETS); do \
		pkg=$${target%%:*}; name=$${target##*:}; \
		echo "fuzz ./$$pkg $$name for $(FUZZTIME)"; \
		$(GO) test -run='^$$' -fuzz="^$$name\$$" -fuzztime=$(FUZZTIME) ./$$pkg || exit 1; \
	done

tidy: ## go mod tidy in each module (idemqotel, the binary and the tests against this checkout's library)
	GOWORK=off $(GO) mod tidy
	@# idemqotel, the binary and the tests require the library (and the binary
	@# idemqotel) at a placeholder version that go.work maps to this checkout;
	@# tidy sees them through replaces that are dropped again (go install
	@# refuses a go.mod with replace directives).
	@for m in consumer/idemqotel cmd/idemq integration integration/browser; do \
		echo "go mod tidy in $$m"; \
		(cd $$m && $(GO) mod edit -replace github.com/idemq/idemq=$(CURDIR) && \
			{ [[ $$m == consumer/idemqotel ]] || $(GO) mod edit -replace github.com/idemq/idemq/consumer/idemqotel=$(CURDIR)/consumer/idemqotel; } && \
			{ GOWORK=off $(GO) mod tidy; rc=$$?; \
				$(GO) mod edit -dropreplace github.com/idemq/idemq -dropreplace github.com/idemq/idemq/consumer/idemqotel; exit $$rc; }) || exit 1; \
	done

build: ## Build the idemq binary into bin/idemq
	$(GO) build -o bin/idemq ./cmd/idemq

jaeger: ## Start a local Jaeger v2 (UI/API 127.0.0.1:16686, OTLP 4317/4318)
	@bash deploy/jaeger/run.sh
