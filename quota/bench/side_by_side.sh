#!/usr/bin/env bash
# The side-by-side of Envoy's two global rate limit paths on one load:
# Envoy's ratelimit filter asking floodgate-quota over RLS (one
# ShouldRateLimit call per request) and Envoy's rate limit quota filter
# reporting to it over RLQS (one report per bucket per 5 s per Envoy,
# whatever the traffic). Two Envoys (the shipped examples,
# quota/examples/envoy-ratelimit.yaml and envoy-rlqs.yaml, ports swapped)
# in front of one service, whose own GET /healthz is their backend (Envoy's
# ratelimit filter skips direct responses), each driven by its own wrk with
# the same connections, for the same SIDE_DURATION, over SIDE_TENANTS
# tenants (x-api-key and x-tenant both t<n>, limits far above the load so
# that every request is admitted); prints, per path, requests, calls to
# the service and calls per request. Called by run.sh with RLQS_SIDE=1, or
# alone (BIN=path/to/floodgate-quota, else the release build). Loopback
# only; needs envoy ($ENVOY_BIN), wrk, python3, curl.
set -euo pipefail

SIDE_DURATION=${SIDE_DURATION:-30s}
SIDE_TENANTS=${SIDE_TENANTS:-100}
SIDE_CONNECTIONS=${SIDE_CONNECTIONS:-4}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
envoy=${ENVOY_BIN:-envoy}
if [ -z "${BIN:-}" ]; then
  (cd "$root" && cargo build --release -p floodgate-quota --bin floodgate-quota >&2)
  BIN="$target/release/floodgate-quota"
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
  for _ in $(seq 1 400); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.05
  done
  echo "nothing listens on port $1" >&2; return 1
}
pids=()
scratch=$(mktemp -d)
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$scratch"
}
trap cleanup EXIT

# Limits far above the load: the paths' calls, not denials, are measured.
cat >"$scratch/rls.yaml" <<YAML
domain: envoy
descriptors:
  - key: api_key
    rate_limit: {unit: second, requests_per_unit: 1000000}
YAML
cat >"$scratch/rlqs.yaml" <<YAML
domain: rlqs
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1000000}
YAML
cat >"$scratch/tenants.lua" <<LUA
math.randomseed(7)
request = function()
  local tenant = "t" .. math.random(1, $SIDE_TENANTS)
  return wrk.format("GET", "/healthz", {["x-api-key"] = tenant, ["x-tenant"] = tenant})
end
LUA

http_port=$(free_port)
grpc_port=$(free_port)
RUST_LOG=warn "$BIN" --config "$scratch/rls.yaml" --config "$scratch/rlqs.yaml" --listen "127.0.0.1:$http_port" \
  --grpc-listen "127.0.0.1:$grpc_port" --max-connections-per-peer 0 &
pids+=($!)
wait_port "$http_port"

# An example with its ports swapped: file, listener port, admin port.
bootstrap() {
  sed -e "s/port_value: 10000}/port_value: $2}/" -e "s/port_value: 9901}/port_value: $3}/" \
    -e "s/port_value: 8082}/port_value: $grpc_port}/" -e "s/port_value: 8080}/port_value: $http_port}/" \
    "$root/quota/examples/$1"
}
rls_port=$(free_port)
rlqs_port=$(free_port)
bootstrap envoy-ratelimit.yaml "$rls_port" "$(free_port)" >"$scratch/rls-envoy.yaml"
bootstrap envoy-rlqs.yaml "$rlqs_port" "$(free_port)" >"$scratch/rlqs-envoy.yaml"
for name in rls rlqs; do
  "$envoy" -c "$scratch/$name-envoy.yaml" --concurrency 2 --disable-hot-restart --log-level warn \
    >"$scratch/$name-envoy.log" 2>&1 &
  pids+=($!)
done
wait_port "$rls_port"
wait_port "$rlqs_port"

metric() {
  curl -s "http://127.0.0.1:$http_port/metrics" | awk -v series="$1" 'index($0, series) == 1 {print $2}'
}
rls_calls() { metric 'floodgate_quota_requests_total{endpoint="rls",status="OK"}'; }
rlqs_reports() { metric 'floodgate_quota_rlqs_reports_total{domain="rlqs"}'; }

rls_before=$(rls_calls)
rlqs_before=$(rlqs_reports)
wrk -t1 -c"$SIDE_CONNECTIONS" -d"$SIDE_DURATION" -s "$scratch/tenants.lua" "http://127.0.0.1:$rls_port" >"$scratch/rls.out" &
rls_wrk=$!
wrk -t1 -c"$SIDE_CONNECTIONS" -d"$SIDE_DURATION" -s "$scratch/tenants.lua" "http://127.0.0.1:$rlqs_port" >"$scratch/rlqs.out" &
rlqs_wrk=$!
wait "$rls_wrk" "$rlqs_wrk"
# The RLQS Envoy's last reports of the load come within an interval.
sleep 6
rls_calls=$(( $(rls_calls) - rls_before ))
rlqs_calls=$(( $(rlqs_reports) - rlqs_before ))
requests() { awk '/requests in/ {print $1}' "$1"; }
non2xx() { awk '/Non-2xx/ {print $NF}' "$1"; }
rls_requests=$(requests "$scratch/rls.out")
rlqs_requests=$(requests "$scratch/rlqs.out")

echo "side by side: $SIDE_DURATION, $SIDE_CONNECTIONS connections each, $SIDE_TENANTS tenants, one Envoy (2 workers) per path"
printf '%-28s %10s %8s %14s %16s\n' path requests non-2xx "service calls" "calls/request"
printf '%-28s %10s %8s %14s %16s\n' "RLS (ShouldRateLimit)" "$rls_requests" "$(non2xx "$scratch/rls.out")" "$rls_calls" \
  "$(python3 -c "print(f'{$rls_calls / max($rls_requests, 1):.4f}')")"
printf '%-28s %10s %8s %14s %16s\n' "RLQS (bucket reports)" "$rlqs_requests" "$(non2xx "$scratch/rlqs.out")" "$rlqs_calls" \
  "$(python3 -c "print(f'{$rlqs_calls / max($rlqs_requests, 1):.4f}')")"
