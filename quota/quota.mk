# Make targets of the quota service (floodgate-quota), included by the root
# Makefile; paths are relative to the repository root.
#   quota-test   every quota test suite, memory, Redis and Redis Cluster stores (needs redis-server and redis-cli on PATH)
#   quota-bench  loopback benchmark: check and lease decisions/s and p99 (memory; 10⁶ buckets with room and full; Redis; Redis Cluster), gRPC RLS beside /v1/check, leases/s with 1, 10 and 200 leases a call, the hot-key fairness probe, a one-lease probe alone and beside calls of 512 leases (memory, Redis), RLQS reports/s with 100 streams x 1,000 buckets (RLQS_SIDE=1: the RLS/RLQS side-by-side, needs envoy), GET /healthz as the HTTP path's reference, and the table of targets (needs wrk, h2load, redis-server, redis-cli; ONLY=regex runs some rows)
#   quota-run    the service with the memory store on 127.0.0.1:8081 and the sample limits

QUOTA_CARGO ?= cargo

.PHONY: quota-test quota-bench quota-bench-deps quota-run

quota-test:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
	  { echo "quota-test needs redis-server and redis-cli on PATH (make deps-redis, or apt-get install redis-server redis-tools)" >&2; exit 1; }
	$(QUOTA_CARGO) test -p floodgate-quota --all-targets

# The load generators (wrk; h2load, for gRPC) and Redis come from Debian's packages.
quota-bench-deps:
	@command -v wrk >/dev/null && command -v h2load >/dev/null && command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk nghttp2-client redis-server redis-tools >/dev/null; }

quota-bench: quota-bench-deps
	quota/bench/run.sh

quota-run:
	$(QUOTA_CARGO) run -p floodgate-quota -- --config quota/examples/quota.yaml --listen 127.0.0.1:8081 --store memory
