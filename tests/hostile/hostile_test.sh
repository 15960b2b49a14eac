#!/usr/bin/env bash
# The hostile-client suite (tests/hostile/hostile_test.py) against the real controller and a
# worker on loopback: the tiny Qwen3-VL-MoE (text and images), tokens on, small bounds so that
# long requests are easy to make. Ends with the controller stopped by SIGTERM while clients keep
# sending: it must exit 0. Usage: hostile_test.sh CONTROLLER_BIN WORKER_BIN.
# Exit 77 (skipped) without network for pip.
set -euo pipefail
CONTROLLER="$1"
WORKER="$2"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
if ! "$VENV/bin/python" -c "import openai" 2>/dev/null || [ ! -x "$VENV/bin/grpcurl" ]; then
  "$VENV/bin/pip" install -q -r "$ROOT/tools/requirements-http-test.txt" >/dev/null 2>&1 || {
    echo "pip install failed (no network?): skipped"; exit 77; }
fi
export PATH="$VENV/bin:$PATH"
TMP="$(mktemp -d)"
cleanup() { [ -n "${PID:-}" ] && kill -9 "$PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$TMP"; }
trap cleanup EXIT
# The adapters are copied: the suite writes hostile ones beside them.
mkdir -p "$TMP/adapters"
cp -r "$ROOT/tests/data/qwen3_vl_moe_mm/adapter_2d" "$TMP/adapters/vl2d"
cp -r "$ROOT/tests/data/qwen3_vl_moe_mm/adapter_3d" "$TMP/adapters/vl3d"
printf 'admin-token admin\ninference-token inference\n' >"$TMP/tokens"
# Under AddressSanitizer (the sanitizer tree's run), freed memory waits in a quarantine of 256 MiB
# by default, which the memory bound would count: a small one here.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}quarantine_size_mb=16"
"$CONTROLLER" --model "$ROOT/tests/data/qwen3_vl_moe_mm/model" --adapter-root "$TMP/adapters" \
  --state-dir "$TMP/state" --tensor-parallel-size 1 --enable-mixed-moe-lora-format --enable-tower-connector-lora \
  --max-lora-rank 3 --max-num-seqs 4 --request-timeout-s 3 --auth-tokens-file "$TMP/tokens" \
  --port 0 --metrics-port 0 --http-port 0 --port-file "$TMP/ports" --worker-bin "$WORKER" \
  --worker-args "--cpu-threads 1" --preload vl2d=vl2d >"$TMP/controller.log" 2>&1 &
PID=$!
port() { "$VENV/bin/python" -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$TMP/ports" "$1"; }
for _ in $(seq 1 300); do
  if [ -s "$TMP/ports" ] && curl -sf "localhost:$(port http_port)/health" >/dev/null 2>&1; then break; fi
  sleep 0.2
done
curl -sf "localhost:$(port http_port)/health" >/dev/null || { echo "not serving"; cat "$TMP/controller.log"; exit 1; }
rc=0
WORKER_PORT_FILE="$TMP/state/run/group.1/port.0" "$VENV/bin/python" "$ROOT/tests/hostile/hostile_test.py" "$(port http_port)" "$(port port)" "$PID" \
  "$TMP/adapters" admin-token inference-token || rc=$?
if [ "$rc" -ne 0 ]; then echo "controller log:"; tail -40 "$TMP/controller.log"; exit "$rc"; fi
# The suite sent SIGTERM: the controller drains and exits 0 (an abort would be 134).
for _ in $(seq 1 300); do kill -0 "$PID" 2>/dev/null || break; sleep 0.2; done
wait "$PID" && status=0 || status=$?
PID=""
if [ "$status" -ne 0 ]; then echo "the controller exited $status on SIGTERM"; tail -40 "$TMP/controller.log"; exit 1; fi
echo "the controller stopped cleanly (exit 0) while clients kept sending"
