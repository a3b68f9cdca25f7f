#!/usr/bin/env bash
# Loopback benchmark of floodgate-quota: check and lease decisions per second
# and p99 latency, with the memory store and with Redis.
#
# The service is pinned to CPU 0 with one worker thread and the load
# generator (wrk) to CPU 1, so the figures are per service core. Everything
# listens on 127.0.0.1 only; every run is bounded by DURATION.
set -euo pipefail

DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-32}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}

for tool in wrk redis-server python3; do
  command -v "$tool" >/dev/null || { echo "quota-bench needs $tool (apt-get install wrk redis-server python3)" >&2; exit 1; }
done
# exec, so that $! is the program itself and `kill` reaches it.
pin() { if command -v taskset >/dev/null; then exec taskset -c "$1" "${@:2}"; else exec "${@:2}"; fi; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
  for _ in $(seq 1 200); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.05
  done
  echo "nothing listens on port $1" >&2; return 1
}

(cd "$root" && cargo build --release -p floodgate-quota --bin floodgate-quota >&2)
bin="$target/release/floodgate-quota"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

redis_port=$(free_port)
# Redis is not pinned: on two cores it shares whichever the scheduler finds free.
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
pids+=($!)
wait_port "$redis_port"

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg) (figures are only meaningful on an otherwise idle machine)"
printf '\n%-8s %-6s %14s %10s %10s %8s\n' store call "decisions/s" "p50" "p99" "non-2xx"
for store in memory "redis://127.0.0.1:$redis_port/"; do
  port=$(free_port)
  (RUST_LOG=warn TOKIO_WORKER_THREADS=1 pin 0 "$bin" --config "$here/bench.yaml" --listen "127.0.0.1:$port" --store "$store") &
  service=$!
  pids+=($service)
  wait_port "$port"
  name=${store%%:*}
  for call in check lease; do
    out=$(pin 1 wrk -t1 -c"$CONNECTIONS" -d"$DURATION" --latency -s "$here/$call.lua" "http://127.0.0.1:$port")
    rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
    p50=$(awk '$1 == "50%" {print $2}' <<<"$out")
    p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
    errors=$(awk '/Non-2xx/ {print $NF}' <<<"$out")
    printf '%-8s %-6s %14s %10s %10s %8s\n' "$name" "$call" "$rps" "$p50" "$p99" "${errors:-0}"
  done
  kill "$service"
  wait "$service" 2>/dev/null || true
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "duration $DURATION per row, $CONNECTIONS connections, service on 1 core (1 worker thread), wrk on the other"
