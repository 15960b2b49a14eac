#!/usr/bin/env bash
# Images through the public API (tests/integration/vision_api_test.py) against real controllers
# and worker processes: Qwen3-VL-MoE at TP=2 with expert parallelism, Qwen3.5-MoE at TP=2 with
# fully sharded LoRAs, each with a 2D and a 3D adapter that adapt the vision tower preloaded.
# Usage: vision_api_test.sh CONTROLLER_BIN WORKER_BIN TOKENIZER_BIN. Exit 77 (skipped) without
# network for pip.
set -euo pipefail
CONTROLLER="$1"
WORKER="$2"
export MOELORA_TOKENIZER_BIN="$3"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
if ! "$VENV/bin/python" -c "import safetensors, numpy" 2>/dev/null || [ ! -x "$VENV/bin/grpcurl" ]; then
  "$VENV/bin/pip" install -q -r "$ROOT/tools/requirements-http-test.txt" \
    -r "$ROOT/tools/requirements-image.txt" >/dev/null 2>&1 || {
    echo "pip install failed (no network?): skipped"; exit 77; }
fi
export PATH="$VENV/bin:$PATH"
TMP="$(mktemp -d)"
cleanup() { [ -n "${PID:-}" ] && kill "$PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$TMP"; }
trap cleanup EXIT
cd "$ROOT"
port() { "$VENV/bin/python" -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$TMP/ports" "$1"; }
status=0
for setup in "qwen3_vl_moe_mm --enable-expert-parallel" "qwen3_5_moe_mm --fully-sharded-loras"; do
  set -- $setup
  FX="$1"
  echo "== $FX at TP=2 $2"
  rm -rf "$TMP/state" "$TMP/ports"
  "$CONTROLLER" --model "tests/data/$FX/model" --adapter-root tests/data \
    --state-dir "$TMP/state" --tensor-parallel-size 2 --enable-mixed-moe-lora-format \
    --enable-tower-connector-lora "$2" --limit-mm-per-prompt '{"image": 3}' \
    --port 0 --metrics-port 0 --http-port 0 --port-file "$TMP/ports" --worker-bin "$WORKER" \
    --preload "a2d=$FX/adapter_2d,a3d=$FX/adapter_3d" >"$TMP/controller.log" 2>&1 &
  PID=$!
  for _ in $(seq 1 300); do
    if [ -s "$TMP/ports" ] && curl -sf "localhost:$(port http_port)/health" >/dev/null 2>&1; then
      break
    fi
    sleep 0.2
  done
  curl -sf "localhost:$(port http_port)/health" >/dev/null || { echo "not serving"; cat "$TMP/controller.log"; exit 1; }
  "$VENV/bin/python" tests/integration/vision_api_test.py "$(port port)" "$(port http_port)" \
    "$(port metrics_port)" "tests/data/$FX" 3 2>&1 | grep -v 'PyTorch was not found' || {
    status=1; echo "controller log:"; tail -30 "$TMP/controller.log"; }
  kill "$PID"; wait "$PID" 2>/dev/null || true; PID=
done
exit $status
