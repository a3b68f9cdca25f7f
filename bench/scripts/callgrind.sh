#!/bin/bash
# Instructions a request, counted by callgrind in one process of a bench
# variant's set-up while the bench's latency part loads it (sequential
# requests on one connection):
#
#   bench/scripts/callgrind.sh envoy|upstream|quota VARIANT [OUT_DIR]
#
# `envoy` is the Envoy under test (its filters, the wasm VM, its callouts),
# `upstream` the Envoy a proxied variant routes to, `quota` floodgate-quota.
# That process runs under `valgrind --tool=callgrind`, the others at full
# speed. Once the load is steady (its first timed round), the counts are
# zeroed, and 20 s later dumped, with the Envoy under test's request count
# read at both ends: the instructions of that window over its requests,
# all threads (timers and ticks included, at the rate the load runs at).
# Deterministic to about 1 %, where the clock on a shared 2-core machine
# moves by tens. Needs the bench's build (`make -f bench/bench.mk
# filter-bench-build`) and valgrind; FLOODGATE_WASM picks the module.
set -euo pipefail
what=$1 variant=$2 out=${3:-$(mktemp -d)}
root=$(cd "$(dirname "$0")/../.." && pwd)
wasm_dir=$root/target/wasm32-wasip1/release native_dir=$root/target/native
envoy_bin=${ENVOY_BIN:-$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/envoy}
command -v valgrind >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null; }
mkdir -p "$out"
pid_file=$out/$what.pid
rm -f "$pid_file"

# The process measured starts under callgrind (following the exec of pip's
# `envoy` launcher into Envoy), in the background of a
# wrapper that records its pid: the harness stops the wrapper, and the
# process is then stopped with SIGTERM, so that callgrind writes its counts.
wrap() { # wrap NAME REAL MATCH
  cat > "$out/$1" <<WRAP
#!/bin/bash
case "\$*" in
  *validate*) exec "$2" "\$@";;
  *$3*) valgrind --tool=callgrind --trace-children=yes --callgrind-out-file="$out/$what.%p.out" "$2" "\$@" &
        echo \$! > "$pid_file"; wait;;
  *) exec "$2" "\$@";;
esac
WRAP
  chmod +x "$out/$1"
}
envoy=$envoy_bin quota=$root/target/release/floodgate-quota
case $what in
  envoy) wrap envoy "$envoy_bin" "-$variant.json"; envoy=$out/envoy;;
  upstream) wrap envoy "$envoy_bin" "-upstream.json"; envoy=$out/envoy;;
  quota) wrap quota "$root/target/release/floodgate-quota" ""; quota=$out/quota;;
  *) echo "measure envoy, upstream or quota, not $what" >&2; exit 2;;
esac

# Enough requests to outlast the window (it starts with the first of 5
# timed rounds), at the pace of the process under callgrind: ~100 a second
# when it is the Envoy under test, ~700 when another.
load=${REQUESTS:-$([ "$what" = envoy ] && echo 1000 || echo 10000)}
ENVOY_BIN=$envoy FLOODGATE_ENVOY_READY_SECS=600 \
  FLOODGATE_WASM=${FLOODGATE_WASM:-$wasm_dir/floodgate.wasm} \
  FLOODGATE_NATIVE=$native_dir/libfloodgate_native.so NOOP_WASM=$wasm_dir/floodgate_bench_noop.wasm \
  NOOP_NATIVE=$native_dir/libfloodgate_bench_noop_native.so PROBE_WASM=$wasm_dir/floodgate_bench_probe.wasm \
  QUOTA_BIN=$quota BENCH_PARTS=latency BENCH_VARIANTS=$variant BENCH_LATENCY_REQUESTS=$load \
  BENCH_RESULTS_DIR=$out "$root/target/release/floodgate-bench" > "$out/bench.log" 2>&1 &
bench=$!
# The bench ending first means it never loaded the variant: only the rows
# in its latency part (`latency: true` in bench/src/variants.rs) can be measured.
running() { kill -0 $bench 2>/dev/null || { cat "$out/bench.log" >&2; echo "($variant is not in the latency part?)" >&2; exit 1; }; }
until [ -s "$pid_file" ]; do running; sleep 1; done
measured=$(cat "$pid_file")
until grep -q "round 1/" "$out/bench.log"; do running; sleep 1; done
# The Envoy under test is the one of the variant's processes that listens.
for pid in $(pgrep -f -- "-$variant.json"); do
  ss -ltnp | grep "pid=$pid," > /dev/null && under_test=$pid
done
# Its request count, from whichever of its ports is the admin one.
requests() {
  for port in $(ss -ltnp | grep "pid=$under_test," | awk '{print $4}' | sed 's/.*://' | sort -u); do
    # (Its listener answers too, through the route, without a newline.)
    curl -s "http://127.0.0.1:$port/stats?filter=^http.bench.downstream_rq_total$" || true
    echo
  done | awk '/^http.bench.downstream_rq_total:/ {n = $2} END {print n}'
}
callgrind_control -z "$measured" > /dev/null 2>&1
first=$(requests)
sleep 20
last=$(requests)
callgrind_control -d "$measured" > /dev/null 2>&1
wait $bench || true
kill -TERM "$measured" 2>/dev/null || true
while kill -0 "$measured" 2>/dev/null; do sleep 1; done
dump=$(ls -t "$out/$what.$measured.out."* | head -1)
total=$(awk '/^(summary|totals):/ {print $2; exit}' "$dump")
echo "$what of ($variant): $total instructions over $((last - first)) requests:" \
  "$(( total / (last - first) )) a request (counts: $dump)"
