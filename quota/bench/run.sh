#!/usr/bin/env bash
# Loopback benchmark of floodgate-quota: check and lease decisions per second
# and p99 latency, with the memory store (empty, and full at a million
# buckets), with Redis and with a three-master Redis Cluster.
#
# The service is pinned to CPU 0 with one worker thread and the load
# generator (wrk) to CPU 1, so the figures are per service core. Everything
# listens on 127.0.0.1 only; every row is bounded by DURATION, repeated
# ROUNDS times (the fill of the full store by its count of buckets).
set -euo pipefail

DURATION=${DURATION:-5s}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-32}
FULL_BUCKETS=1000000
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}

for tool in wrk redis-server redis-cli python3; do
  command -v "$tool" >/dev/null || { echo "quota-bench needs $tool (apt-get install wrk redis-server redis-tools python3)" >&2; exit 1; }
done
# exec, so that $! is the program itself and `kill` reaches it; call it only
# in a subshell, never from the script's own shell.
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
scratch=$(mktemp -d)
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$scratch"
}
trap cleanup EXIT

# Redis is not pinned: on two cores it shares whichever the scheduler finds free.
redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
pids+=($!)
wait_port "$redis_port"

# A Redis Cluster of three masters, no replicas (the bench's one domain
# lives in one slot, so one master serves it: the row measures the cluster
# client's routing, not spreading).
cluster_nodes=()
for n in 1 2 3; do
  port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$scratch" \
    --cluster-enabled yes --cluster-port "$(free_port)" --cluster-config-file "$scratch/nodes-$n.conf" >/dev/null &
  pids+=($!)
  wait_port "$port"
  cluster_nodes+=("127.0.0.1:$port")
done
redis-cli --cluster create "${cluster_nodes[@]}" --cluster-replicas 0 --cluster-yes >/dev/null
for node in "${cluster_nodes[@]}"; do
  for _ in $(seq 1 200); do
    redis-cli -p "${node##*:}" cluster info | grep -q cluster_state:ok && break
    sleep 0.05
  done
done
cluster_url="redis+cluster://$(IFS=,; echo "${cluster_nodes[*]}")"

# One wrk run; prints a row and records it. Arguments: label, call, script,
# port, connections.
measure() {
  local out rps p50 p99 errors
  out=$(pin 1 wrk -t1 -c"$5" -d"$DURATION" --latency -s "$here/$3.lua" "http://127.0.0.1:$4")
  rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
  p50=$(awk '$1 == "50%" {print $2}' <<<"$out")
  p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
  errors=$(awk '/Non-2xx/ {print $NF}' <<<"$out")
  printf '%-14s %-14s %14s %10s %10s %8s\n' "$1" "$2" "$rps" "$p50" "$p99" "${errors:-0}"
  echo "$round|$1 $2|$rps|$p50|$p99|${errors:-0}" >>"$scratch/rows"
}

# Starts the service on a free port with the given flags; sets $port.
start_service() {
  port=$(free_port)
  (RUST_LOG=warn TOKIO_WORKER_THREADS=1 pin 0 "$bin" --config "$here/bench.yaml" --listen "127.0.0.1:$port" "$@") &
  pids+=($!)
  wait_port "$port"
}

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg) (absolute figures are only meaningful on an otherwise idle machine; compare rows of one round)"

# Every service runs throughout (idle while another is measured), so that
# each round measures every row within a minute or two of the others.
start_service --store memory
memory_port=$port
start_service --store "redis://127.0.0.1:$redis_port/"
redis_service_port=$port
start_service --store "$cluster_url"
cluster_port=$port
# The memory store full: FULL_BUCKETS live buckets (a day-long window);
# checks of existing buckets are measured while new keys are being refused.
start_service --store memory --memory-max-buckets "$FULL_BUCKETS"
full_port=$port
python3 "$here/fill.py" "$full_port" "$FULL_BUCKETS"

for round in $(seq 1 "$ROUNDS"); do
  printf '\nround %s of %s, load average %s\n' "$round" "$ROUNDS" "$(cut -d' ' -f1 /proc/loadavg)"
  printf '%-14s %-14s %14s %10s %10s %8s\n' store call "decisions/s" "p50" "p99" "non-2xx"
  for row in "memory $memory_port" "redis $redis_service_port" "redis-cluster $cluster_port"; do
    set -- $row
    for call in check lease; do
      measure "$1" "$call" "$call" "$2" "$CONNECTIONS"
    done
  done
  (pin 1 wrk -t1 -c8 -d"$DURATION" -s "$here/new.lua" "http://127.0.0.1:$full_port" >"$scratch/new.out") &
  refusing=$!
  pids+=($refusing)
  measure memory-full "check existing" existing "$full_port" "$CONNECTIONS"
  wait "$refusing"
  refused_rps=$(awk '/^Requests\/sec:/ {print $2}' "$scratch/new.out")
  refused=$(awk '/Non-2xx/ {print $NF}' "$scratch/new.out")
  total=$(awk '/requests in/ {print $1}' "$scratch/new.out")
  printf '%-14s %-14s %14s %10s %10s %8s\n' memory-full "check new" "$refused_rps" "" "" "${refused:-0}/$total"
done
curl -s "http://127.0.0.1:$full_port/metrics" | grep -E '^floodgate_quota_(requests|store_errors)_total' >&2

echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$ROUNDS rounds, $DURATION per row, $CONNECTIONS connections, service on 1 core (1 worker thread), wrk on the other;"
echo "memory-full: $FULL_BUCKETS live buckets; 'check existing' ran at the same time as 'check new' (8 connections, all refused as full)"
echo
# Medians over the rounds, and each row's ratio to the memory check of its
# own round (median of the per-round ratios): on a shared machine the ratios
# mean more than the absolute figures.
python3 - "$scratch/rows" <<'PY'
import statistics, sys
def ms(text):
    for unit, factor in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float("nan")
rounds = {}
for line in open(sys.argv[1]):
    r, label, rps, p50, p99, errors = line.rstrip("\n").split("|")
    rounds.setdefault(r, {})[label] = (float(rps), ms(p50), ms(p99), int(errors))
labels = list(next(iter(rounds.values())))
print(f"{'median of rounds':29} {'decisions/s':>12} {'p50 ms':>8} {'p99 ms':>8} {'÷ memory check: rate':>21} {'p99':>6} {'non-2xx':>8}")
for label in labels:
    rows = [rnd[label] for rnd in rounds.values() if label in rnd]
    refs = [rnd["memory check"] for rnd in rounds.values() if label in rnd]
    med = lambda xs: statistics.median(xs)
    print(f"{label:29} {med([x[0] for x in rows]):12.0f} {med([x[1] for x in rows]):8.2f} {med([x[2] for x in rows]):8.2f}"
          f" {med([x[0] / y[0] for x, y in zip(rows, refs)]):21.2f} {med([x[2] / y[2] for x, y in zip(rows, refs)]):6.2f}"
          f" {sum(x[3] for x in rows):8}")
PY
