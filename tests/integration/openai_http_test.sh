#!/usr/bin/env bash
# The OpenAI-compatible HTTP API with the real openai client (PyPI) against the run command's
# service (the tiny Qwen3-MoE, 2 worker ranks, mixed mode, a2d and a3d preloaded) on free ports:
# tests/integration/openai_client_test.py. Usage: openai_http_test.sh CONTROLLER_BIN WORKER_BIN.
# Exit 77 (skipped) without network for pip.
set -euo pipefail
CONTROLLER="$1"
WORKER="$2"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
if ! "$VENV/bin/python" -c "import openai, transformers, tokenizers" 2>/dev/null ||
   [ ! -x "$VENV/bin/grpcurl" ]; then
  "$VENV/bin/pip" install -q -r "$ROOT/tools/requirements-http-test.txt" \
    -r "$ROOT/tools/requirements-tokenizer.txt" >/dev/null 2>&1 || {
    echo "pip install failed (no network?): skipped"; exit 77; }
fi
export PATH="$VENV/bin:$PATH"
grep -q -- "--preload a2d=qwen3_moe/adapter_2d,a3d=qwen3_moe/adapter_3d" "$ROOT/scripts/run.sh"
TMP="$(mktemp -d)"
cleanup() { [ -n "${PID:-}" ] && kill "$PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$TMP"; }
trap cleanup EXIT
cd "$ROOT"
"$CONTROLLER" --model tests/data/qwen3_moe/model --adapter-root tests/data \
  --state-dir "$TMP/state" --tensor-parallel-size 2 --enable-mixed-moe-lora-format \
  --port 0 --metrics-port 0 --http-port 0 --port-file "$TMP/ports" --worker-bin "$WORKER" \
  --preload a2d=qwen3_moe/adapter_2d,a3d=qwen3_moe/adapter_3d \
  --reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes \
  >"$TMP/controller.log" 2>&1 &
PID=$!
for _ in $(seq 1 300); do
  if [ -s "$TMP/ports" ]; then
    HTTP="$("$VENV/bin/python" -c "import json,sys; print(json.load(open(sys.argv[1]))['http_port'])" "$TMP/ports")"
    curl -sf "localhost:$HTTP/health" >/dev/null 2>&1 && break
  fi
  sleep 0.2
done
GRPC="$("$VENV/bin/python" -c "import json,sys; print(json.load(open(sys.argv[1]))['port'])" "$TMP/ports")"
curl -sf "localhost:$HTTP/health" >/dev/null || { echo "not serving"; cat "$TMP/controller.log"; exit 1; }
PORT_FILE="$TMP/ports" "$VENV/bin/python" "$ROOT/tests/integration/openai_client_test.py" \
  "$HTTP" "$GRPC" tests/data/qwen3_moe/model "$PID" 2>&1 | grep -v 'PyTorch was not found' ||
  { echo "controller log:"; tail -30 "$TMP/controller.log"; exit 1; }
