# The benchmark of issue 4. The root Makefile includes this file; it also runs
# on its own from the repository root:
#
#   make -f bench/bench.mk filter-bench         # the full run (about 15 minutes on 2 cores, estimated)
#   make -f bench/bench.mk filter-bench-quick   # 1 round of 2 s: a smoke test
#   make -f bench/bench.mk filter-bench-ab BASE_WASM=old.wasm  # this module against another, alternating rounds
#
# Paths are relative to the repository root. Tunables (environment or make
# variables): BENCH_ROUNDS, BENCH_DURATION, BENCH_WARMUP, BENCH_CONNECTIONS,
# BENCH_THREADS, BENCH_LATENCY_REQUESTS, BENCH_ACCURACY_SECS,
# BENCH_ACCURACY_CONNECTIONS, BENCH_MEMORY_KEYS, BENCH_MEMORY_CONNECTIONS,
# BENCH_MEMORY_MAX_SECS, BENCH_QUOTA_UNIT,
# BENCH_PARTS (throughput,latency,accuracy,memory), BENCH_VARIANTS, BENCH_RESULTS_DIR;
# ENVOY_BIN (else `envoy` on the PATH), WRK_BIN, QUOTA_BIN. See bench/README.md.

# The modules the harness loads are the ones built here: where cargo puts
# them (target/, unless CARGO_TARGET_DIR says otherwise), as absolute paths.
# They are passed to the harness on its command line only: this file is
# included by the root Makefile, and an exported FLOODGATE_WASM or
# FLOODGATE_NATIVE would also reach the e2e tests.
BENCH_WASM_DIR := $(abspath $(or $(CARGO_TARGET_DIR),target))/wasm32-wasip1/release
BENCH_NATIVE_DIR := $(abspath $(or $(CARGO_TARGET_DIR),target))/native
BENCH_RUN := FLOODGATE_WASM=$(BENCH_WASM_DIR)/floodgate.wasm \
  FLOODGATE_NATIVE=$(BENCH_NATIVE_DIR)/libfloodgate_native.so \
  NOOP_WASM=$(BENCH_WASM_DIR)/floodgate_bench_noop.wasm \
  NOOP_NATIVE=$(BENCH_NATIVE_DIR)/libfloodgate_bench_noop_native.so \
  PROBE_WASM=$(BENCH_WASM_DIR)/floodgate_bench_probe.wasm \
  QUOTA_BIN=$(abspath $(or $(CARGO_TARGET_DIR),target))/release/floodgate-quota \
  cargo run --quiet --release -p floodgate-bench

.PHONY: filter-bench filter-bench-quick filter-bench-build filter-bench-deps filter-bench-ab

filter-bench-deps:
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	@command -v $${WRK_BIN:-wrk} >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; }

# The filters in the release profile the shipped module uses (Floodgate, the
# no-op and the host-call probe of the opt-in diagnostics), the native
# module and its no-op in the profile `make native` uses, the harness, and
# floodgate-quota (variant r: Envoy's global filter asking it over gRPC; the
# global-mode variants: Floodgate asking it over HTTP). Floodgate's module
# keeps only its own callbacks' exports, as `make wasm` leaves it.
filter-bench-build: filter-bench-deps
	cargo build --release --target wasm32-wasip1 -p floodgate-filter -p floodgate-bench-noop -p floodgate-bench-probe
	python3 scripts/wasm-exports.py $(BENCH_WASM_DIR)/floodgate.wasm filter/exports.txt
	cargo build --profile native -p floodgate-native -p floodgate-bench-noop-native
	cargo build --release -p floodgate-bench -p floodgate-quota

filter-bench: filter-bench-build
	$(BENCH_RUN)

filter-bench-quick: filter-bench-build
	BENCH_ROUNDS=1 BENCH_DURATION=2 BENCH_WARMUP=1 BENCH_LATENCY_REQUESTS=500 BENCH_ACCURACY_SECS=2 \
	  BENCH_MEMORY_KEYS=100000 $(BENCH_RUN)

# This module against BASE_WASM (e.g. main's before a change) on the local
# rows, in alternating rounds of one run each (AB_ROUNDS, default 4).
filter-bench-ab: filter-bench-build
	@test -n "$(BASE_WASM)" || { echo "BASE_WASM=<a floodgate.wasm to compare with> is required"; exit 2; }
	python3 bench/scripts/ab.py $(BASE_WASM) $(BENCH_WASM_DIR)/floodgate.wasm $(or $(AB_ROUNDS),4)
