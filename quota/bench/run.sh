#!/usr/bin/env bash
# Loopback benchmark of floodgate-quota: decisions per second and latency of
# /v1/check and /v1/lease with the memory store (and, with 10⁶ buckets, one
# with room and one full), with Redis and with a three-master Redis Cluster,
# and Envoy's rate limit service API over gRPC beside /v1/check; then the table
# of the service's targets (Redis against memory, a full store against one with
# room), as ratios measured in the same run.
#
# Pinning: every service runs with one tokio worker thread
# (TOKIO_WORKER_THREADS=1) under `taskset -c 0`, the load generators (wrk,
# h2load) under `taskset -c 1`, and the Redis processes with them on CPU 1:
# the service's core is the service's. Unpinned, Redis woke on the core of
# the service that wrote to it about half the time and took a third of it
# (redis check 36,800-38,200/s in those runs, 47,200-52,300/s pinned, in
# alternating runs of 2026-11-26 05:43; docs/benchmarks.md). So the figures
# are per service core; a Redis row's CPU 1 carries wrk and Redis both.
#
# Rounds: every row runs once per round, in an order rotated each round, so
# that rows compared with each other ran within a minute or two; the table
# gives medians over the rounds of the figures and of the per-round ratios.
# Everything listens on 127.0.0.1 only; every row is bounded by DURATION.
#
# Calls of many leases and hot keys: leases per second when each call carries
# 1, 10 or 200 leases (memory, Redis), and the hot-key fairness probe (memory,
# Redis), so that a flooded key does not starve other calls touching it: checks
# of [other, hot], calls of two leases and returns of the hot key's leases (4
# connections), alone and while 24 connections flood the hot key.
#
# Big-call fairness (calls of 512 leases once took a one-lease probe's p50 from
# 1 ms to 152 ms on Redis). A one-lease probe (probe1.lua: a call of one lease
# of a fresh key, 2 connections) alone, then while 8 connections send calls of
# 512 leases of fresh keys (big.lua), memory (a fresh service each round, with
# room for 4 x 10^6 records: the flood writes hundreds of thousands a second,
# each kept 31 s) and Redis (a service and a Redis of their own, emptied each
# round). Target: the probe's p99 flooded at most 3x its p99 alone, with 0
# failures. What keeps it short on the service's one core: rounds of at most
# 64 transactions taken in turns between calls, small calls (64 or fewer)
# first and large ones held to 8 of a round beside them and in the 32 rounds
# after (never fewer while they wait) with one round out per slot, not two
# (the other the next small call's), Redis's expiry cycles held to 2.5 ms
# (hz 100), the memory store's slices of 16 with the task yielding between
# them, two large calls decided at a time, yielding between their stages,
# and no transparent huge pages (their refaults zeroed 2 MiB on the serving
# thread). Run just these rows with ONLY=big_call (ONLY matches the row's
# command, `big_call_rows memory ...`, not its label).
#
# RLQS (Envoy's rate_limit_quota filter): bucket reports answered per second on
# the service's core, 100 streams (Envoys) each reporting the same 1,000
# buckets, every stream's next report sent as soon as its last is answered
# (floodgate-rlqs-load, pinned with the other load generators), memory and
# Redis; p50/p99 are those of an answer (a stream's report of its 1,000
# buckets, sent to assigned); the last column is the bucket reports left
# unanswered (not decided within --store-timeout; a report not answered in
# 6 s is counted unanswered whole and the stream sends its next, as an
# Envoy does: the run goes on). RLQS_STREAMS and RLQS_BUCKETS change the shape
# (RLQS_STREAMS=2 RLQS_BUCKETS=10 for a smoke run). The side-by-side of Envoy's
# RLS path and RLQS on one load is `side_by_side.sh` (needs envoy): RLQS_SIDE=1
# runs it after the rounds.
#
# The HTTP reference row: GET /healthz on the memory service, with the
# check row's connections and pinning: the service's own HTTP path (accept,
# parse, route, answer) with no body and no store work, so that memory
# checks per core read as a share of what this machine serves at all.
#
# Tunables: ROUNDS (5), DURATION (5s), CONNECTIONS (32), FULL_BUCKETS
# (1000000), ONLY (a regular expression: only the rows whose label matches,
# e.g. ONLY='leases, |fairness' ROUNDS=1 DURATION=2s for a quick look); BIN
# (a built binary to measure instead of building this tree's); COMPARE_BIN=path/to/another/floodgate-quota adds Redis rows of
# that binary (labelled COMPARE_LABEL: check, lease, leases of 10 and 200 a
# call, the fairness probe) and its memory check and /healthz rows, to
# compare designs in the same run.
set -euo pipefail

ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-5s}
CONNECTIONS=${CONNECTIONS:-32}
FULL_BUCKETS=${FULL_BUCKETS:-1000000}
ONLY=${ONLY:-}
RLQS_STREAMS=${RLQS_STREAMS:-100}
RLQS_BUCKETS=${RLQS_BUCKETS:-1000}
RLQS_SIDE=${RLQS_SIDE:-}
# existing.lua picks among the buckets fill.py made.
export BUCKETS=$FULL_BUCKETS
COMPARE_BIN=${COMPARE_BIN:-}
COMPARE_LABEL=${COMPARE_LABEL:-compare}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}

for tool in wrk h2load redis-server redis-cli python3 taskset curl; do
  command -v "$tool" >/dev/null || {
    echo "quota-bench needs $tool (apt-get install wrk nghttp2-client redis-server redis-tools python3 util-linux curl)" >&2
    exit 1
  }
done
# exec, so that $! is the program itself and `kill` reaches it; call it only
# in a subshell, never from the script's own shell.
pin() { exec taskset -c "$1" "${@:2}"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
  for _ in $(seq 1 200); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.05
  done
  echo "nothing listens on port $1" >&2; return 1
}

# BIN=path/to/floodgate-quota measures that build instead (no cargo build).
if [ -n "${BIN:-}" ]; then
  bin=$BIN
else
  (cd "$root" && cargo build --release -p floodgate-quota --bin floodgate-quota >&2)
  bin="$target/release/floodgate-quota"
fi
# RLQS_LOAD=path/to/floodgate-rlqs-load uses that build of the load generator.
if [ -n "${RLQS_LOAD:-}" ]; then
  rlqs_load=$RLQS_LOAD
else
  (cd "$root" && cargo build --release -p floodgate-quota --bin floodgate-rlqs-load >&2)
  rlqs_load="$target/release/floodgate-rlqs-load"
fi

pids=()
scratch=$(mktemp -d)
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$scratch"
}
trap cleanup EXIT

# Starts a Redis on CPU 1 with the given extra arguments; sets $port. Every
# Redis runs as quota/redis.conf has it for latency (hz 100: its expiry
# cycles of at most 2.5 ms, not 25), without its persistence.
start_redis() {
  port=$(free_port)
  pin 1 redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --hz 100 "$@" >/dev/null &
  pids+=($!)
  wait_port "$port"
}

start_redis
redis_port=$port

# A Redis Cluster of three masters, no replicas (the bench's one domain
# lives in one slot, so one master serves it: the rows measure the cluster
# client's routing, not spreading).
cluster_nodes=()
for n in 1 2 3; do
  start_redis --dir "$scratch" --cluster-enabled yes --cluster-port "$(free_port)" \
    --cluster-config-file "$scratch/nodes-$n.conf"
  cluster_nodes+=("127.0.0.1:$port")
done
timeout 60 redis-cli --cluster create "${cluster_nodes[@]}" --cluster-replicas 0 --cluster-yes >/dev/null
for node in "${cluster_nodes[@]}"; do
  for _ in $(seq 1 200); do
    redis-cli -p "${node##*:}" cluster info | grep -q cluster_state:ok && break
    sleep 0.05
  done
done
cluster_url="redis+cluster://$(IFS=,; echo "${cluster_nodes[*]}")"

# Starts a service on a free port with the given binary and flags; sets $port.
# wrk's 32 connections come from one address: no per-peer cap for this one.
start_service() {
  port=$(free_port)
  local binary=$1
  shift
  local peers=()
  # (A compare binary of a release before the flag goes without it.) One
  # address is not one caller here either: wrk's connections are many
  # callers' load (--callers none, where the build has it).
  local help
  help=$("$binary" --help 2>/dev/null || true)
  [[ $help == *--max-connections-per-peer* ]] && peers=(--max-connections-per-peer 0)
  [[ $help == *--callers* ]] && peers+=(--callers none)
  (RUST_LOG=warn TOKIO_WORKER_THREADS=1 pin 0 "$binary" --config "$here/bench.yaml" --listen "127.0.0.1:$port" \
    "${peers[@]}" "$@") &
  pids+=($!)
  wait_port "$port"
}

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg) (absolute figures are only meaningful on an otherwise idle machine; the ratios compare rows of one round)"

# Every service runs throughout (idle while another is measured).
grpc_port=$(free_port)
start_service "$bin" --store memory --grpc-listen "127.0.0.1:$grpc_port"
memory_port=$port
# The memory fairness probe has a memory store of its own: the lease rows
# above write up to 130,000 lease records a second, each kept 31 s, and
# fill the shared store's room for them (10^6 records: their 503s are
# theirs to report); the probe measures a hot key's effect on other calls.
start_service "$bin" --store memory
fairness_memory_port=$port
wait_port "$grpc_port"
redis_grpc_port=$(free_port)
start_service "$bin" --store "redis://127.0.0.1:$redis_port/" --grpc-listen "127.0.0.1:$redis_grpc_port"
redis_service_port=$port
wait_port "$redis_grpc_port"
# The rows of many leases a call have a Redis of their own: they write up
# to 70,000 lease records a second, each kept 31 s, and Redis expiring
# hundreds of thousands of them (its expiry cycle runs up to 25 ms at a
# time) stalled the check and lease rows of the next round (redis check
# p99 2 ms in the first round, 22-28 ms in the others).
start_redis
leases_redis_port=$port
start_service "$bin" --store "redis://127.0.0.1:$leases_redis_port/"
redis_leases_service_port=$port
start_service "$bin" --store "$cluster_url"
cluster_port=$port
# The memory rows of many leases a call have a service of their own, with
# room for what they write: up to 270,000 lease records a second, each kept
# 31 s (on the check rows' service, with room for 10^6, a round's rows
# filled it and the next rounds measured a full room).
start_service "$bin" --store memory --memory-max-buckets 16000000
leases_memory_port=$port
# The Redis big-call rows have a Redis and a service of their own: on the
# leases rows' Redis the probe "alone" ran while Redis expired what those
# rows had written (its p99 22 ms against 1.2 ms on a fresh Redis).
start_redis
big_redis_port=$port
start_service "$bin" --store "redis://127.0.0.1:$big_redis_port/"
big_redis_service_port=$port
compare_port=""
if [ -n "$COMPARE_BIN" ]; then
  start_service "$COMPARE_BIN" --store "redis://127.0.0.1:$redis_port/"
  compare_port=$port
  start_service "$COMPARE_BIN" --store "redis://127.0.0.1:$leases_redis_port/"
  compare_leases_port=$port
  start_service "$COMPARE_BIN" --store memory
  compare_memory_port=$port
fi
# FULL_BUCKETS live buckets (a day-long window) twice: a store full with
# them, and one with room for as many again, the reference of the full one.
start_service "$bin" --store memory --memory-max-buckets "$FULL_BUCKETS"
full_port=$port
start_service "$bin" --store memory --memory-max-buckets $((2 * FULL_BUCKETS))
room_port=$port

# The RLS call as gRPC frames: one key, like the /v1/check it is compared with.
python3 "$here/rls_body.py" >"$scratch/rls.bin"
printf '{"domain":"bench","descriptors":[[["user","u1"]]],"hits":1}' >"$scratch/check.json"

# One wrk run: label, script, port, connections[, units per request: the
# rate is requests/s times it]. Appends a row to rows.
wrk_row() {
  local out rps p50 p99 errors
  out=$(pin 1 wrk -t1 -c"$4" -d"$DURATION" --latency -s "$here/$2.lua" "http://127.0.0.1:$3")
  rps=$(awk -v per="${5:-1}" '/^Requests\/sec:/ {printf "%.2f", $2 * per}' <<<"$out")
  p50=$(awk '$1 == "50%" {print $2}' <<<"$out")
  p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
  errors=$(awk '/Non-2xx/ {print $NF}' <<<"$out")
  echo "$round|$1|$rps|$p50|$p99|${errors:-0}" >>"$scratch/rows"
  printf '%-34s %12s %10s %10s %8s\n' "$1" "$rps" "$p50" "$p99" "${errors:-0}"
}

# The full (or roomy) store's existing buckets checked while a second wrk
# sends checks of new buckets (8 connections; refused as full by the full
# store, added by the one with room).
existing_row() {
  (pin 1 wrk -t1 -c8 -d"$DURATION" -s "$here/new.lua" "http://127.0.0.1:$2" >"$scratch/new.out") &
  local flood=$!
  pids+=($flood)
  wrk_row "$1" existing "$2" "$CONNECTIONS"
  wait "$flood"
  local rps refused total
  rps=$(awk '/^Requests\/sec:/ {print $2}' "$scratch/new.out")
  refused=$(awk '/Non-2xx/ {print $NF}' "$scratch/new.out")
  total=$(awk '/requests in/ {print $1}' "$scratch/new.out")
  printf '%-34s %12s %21s %8s\n' "  beside it: new keys" "$rps" "" "${refused:-0}/$total"
}

# One h2load run: label, URL, body file, then h2load's own flags. The
# per-request log gives the percentiles.
h2load_row() {
  local label=$1 url=$2 body=$3
  shift 3
  local out
  out=$(pin 1 h2load -D "${DURATION%s}" -c "$CONNECTIONS" -t 1 -d "$body" --log-file="$scratch/h2.log" "$@" "$url")
  local rps errors
  rps=$(awk '/^finished in/ {gsub(",", "", $4); print $4}' <<<"$out")
  errors=$(awk '/^status codes:/ {print $5 + $7 + $9}' <<<"$out")
  read -r p50 p99 < <(python3 - "$scratch/h2.log" <<'PY'
import sys
latencies = sorted(int(line.split("\t")[2]) for line in open(sys.argv[1]) if line.strip())
pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] / 1000 if latencies else float("nan")
print(f"{pick(0.50):.2f}ms {pick(0.99):.2f}ms")
PY
)
  echo "$round|$label|$rps|$p50|$p99|${errors:-0}" >>"$scratch/rows"
  printf '%-34s %12s %10s %10s %8s\n' "$label" "$rps" "$p50" "$p99" "${errors:-0}"
}

# Leases per second with LEASES per call: label, port, leases per call.
# About as many leases in flight for every size (at most 640, and at least
# two calls): 32 connections of 1 or 10 leases, 3 of 200 (32 calls of 200
# would queue 6,400 leases behind each other, past --store-timeout).
leases_row() {
  local connections=$((640 / $3))
  ((connections > CONNECTIONS)) && connections=$CONNECTIONS
  ((connections < 2)) && connections=2
  LEASES=$3 wrk_row "$1" leases "$2" "$connections" "$3"
}

# RLQS reports per second: label, gRPC port. The rate is bucket reports
# answered a second; p50/p99 those of a stream's answer to its whole report;
# the last column (non-2xx elsewhere) the bucket reports left unanswered
# (the store did not decide them in time: the Envoy keeps its assignment).
rlqs_row() {
  local out rate p50 p99 unanswered
  out=$(pin 1 "$rlqs_load" --target "127.0.0.1:$2" --streams "$RLQS_STREAMS" --buckets "$RLQS_BUCKETS" \
    --duration "${DURATION%s}")
  read -r rate p50 p99 unanswered <<<"$out"
  echo "$round|$1|$rate|$p50|$p99|${unanswered:-0}" >>"$scratch/rows"
  printf '%-34s %12s %10s %10s %8s\n' "$1" "$rate" "$p50" "$p99" "${unanswered:-0}"
}

# The fairness probe alone, then while the hot key is flooded: store label,
# port. The flood outlasts the probe.
fairness_rows() {
  wrk_row "$1 fairness probe, alone" probe "$2" 4
  (pin 1 wrk -t1 -c24 -d"$((${DURATION%s} + 1))s" -s "$here/hot.lua" "http://127.0.0.1:$2" >/dev/null) &
  local flood=$!
  pids+=($flood)
  sleep 0.3
  wrk_row "$1 fairness probe, hot key flooded" probe "$2" 4
  wait "$flood" || true
}

# The big-call fairness probe alone, then while calls of 512 leases flood
# the service: store label, port (memory: `-`, its service is made for the
# round). The flood outlasts the probe. Each round
# starts from an idle store: a fresh memory service, an emptied Redis (the
# last round's flood left over a million entries expiring, and dropping
# them, on the service's core or in Redis, took the probe "alone" from a
# p99 of 0.7 ms to 6-12 ms).
big_call_rows() {
  local target=$2 service=""
  if [ "$1" = memory ]; then
    start_service "$bin" --store memory --memory-max-buckets 4000000
    target=$port
    service=${pids[-1]}
  else
    redis-cli -p "$big_redis_port" flushall >/dev/null
  fi
  wrk_row "$1 big calls: probe, alone" probe1 "$target" 2
  (pin 1 wrk -t1 -c8 -d"$((${DURATION%s} + 1))s" -s "$here/big.lua" "http://127.0.0.1:$target" >/dev/null) &
  local flood=$!
  pids+=($flood)
  sleep 0.3
  wrk_row "$1 big calls: probe, 512-lease calls" probe1 "$target" 2
  wait "$flood" || true
  if [ -n "$service" ]; then
    kill "$service" 2>/dev/null || true
    wait "$service" 2>/dev/null || true
  fi
}

rls_ok() { curl -s "http://127.0.0.1:$memory_port/metrics" | awk -F' ' '/^floodgate_quota_requests_total\{endpoint="rls",status="OK"\}/ {print $2}'; }

rows=(
  "wrk_row 'memory check' check $memory_port $CONNECTIONS"
  "wrk_row 'memory healthz (HTTP, no store)' healthz $memory_port $CONNECTIONS"
  "wrk_row 'redis check' check $redis_service_port $CONNECTIONS"
  "wrk_row 'redis-cluster check' check $cluster_port $CONNECTIONS"
  "wrk_row 'memory lease' lease $memory_port $CONNECTIONS"
  "wrk_row 'redis lease' lease $redis_service_port $CONNECTIONS"
  "wrk_row 'redis-cluster lease' lease $cluster_port $CONNECTIONS"
  "existing_row 'memory 10^6 room, existing' $room_port"
  "existing_row 'memory 10^6 full, existing' $full_port"
  "h2load_row 'memory check, one key (h2load)' http://127.0.0.1:$memory_port/v1/check $scratch/check.json --h1 -H 'content-type: application/json'"
  "h2load_row 'memory RLS gRPC, one key (h2load)' http://127.0.0.1:$grpc_port/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit $scratch/rls.bin -H 'content-type: application/grpc' -H 'te: trailers'"
  "rlqs_row 'memory RLQS reports, $RLQS_STREAMS streams x $RLQS_BUCKETS buckets' $grpc_port"
  "rlqs_row 'redis RLQS reports, $RLQS_STREAMS streams x $RLQS_BUCKETS buckets' $redis_grpc_port"
  "leases_row 'memory leases, 1 per call' $leases_memory_port 1"
  "leases_row 'memory leases, 10 per call' $leases_memory_port 10"
  "leases_row 'memory leases, 200 per call' $leases_memory_port 200"
  "leases_row 'redis leases, 1 per call' $redis_leases_service_port 1"
  "leases_row 'redis leases, 10 per call' $redis_leases_service_port 10"
  "leases_row 'redis leases, 200 per call' $redis_leases_service_port 200"
  "fairness_rows memory $fairness_memory_port"
  "fairness_rows redis $redis_service_port"
  "big_call_rows memory -"
  "big_call_rows redis $big_redis_service_port"
)
if [ -n "$compare_port" ]; then
  rows+=("wrk_row 'memory ($COMPARE_LABEL) check' check $compare_memory_port $CONNECTIONS")
  rows+=("wrk_row 'memory ($COMPARE_LABEL) healthz (HTTP, no store)' healthz $compare_memory_port $CONNECTIONS")
  rows+=("wrk_row 'redis ($COMPARE_LABEL) check' check $compare_port $CONNECTIONS")
  rows+=("wrk_row 'redis ($COMPARE_LABEL) lease' lease $compare_port $CONNECTIONS")
  rows+=("leases_row 'redis ($COMPARE_LABEL) leases, 10 per call' $compare_leases_port 10")
  rows+=("leases_row 'redis ($COMPARE_LABEL) leases, 200 per call' $compare_leases_port 200")
  rows+=("fairness_rows 'redis ($COMPARE_LABEL)' $compare_port")
fi
if [ -n "$ONLY" ]; then
  kept=()
  for row in "${rows[@]}"; do
    if [[ $row =~ $ONLY ]]; then kept+=("$row"); fi
  done
  rows=("${kept[@]}")
fi
# The 10⁶-bucket stores are filled only for the rows that use them.
if [[ "${rows[*]}" == *existing_row* ]]; then
  python3 "$here/fill.py" "$full_port" "$FULL_BUCKETS" full
  python3 "$here/fill.py" "$room_port" "$FULL_BUCKETS" room
fi

rls_before=$(rls_ok)
for round in $(seq 1 "$ROUNDS"); do
  printf '\nround %s of %s, load average %s\n' "$round" "$ROUNDS" "$(cut -d' ' -f1 /proc/loadavg)"
  printf '%-34s %12s %10s %10s %8s\n' row "decisions/s" p50 p99 non-2xx
  count=${#rows[@]}
  for i in $(seq 0 $((count - 1))); do
    eval "${rows[$(((i + round - 1) % count))]}"
  done
done
rls_after=$(rls_ok)

echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$ROUNDS rounds, $DURATION per row, $CONNECTIONS connections; each service on CPU 0 (1 worker thread), wrk/h2load and Redis on CPU 1"
echo "gRPC calls answered OK during the RLS rows: $((${rls_after%.*} - ${rls_before%.*})) (every one a decision)"
echo
python3 "$here/table.py" "$scratch/rows"
if [ -n "$RLQS_SIDE" ]; then
  echo
  BIN=$bin "$here/side_by_side.sh"
fi
