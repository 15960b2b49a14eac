#!/usr/bin/env bash
# The run command: builds moelora and starts the service on the embedded tiny Qwen3-MoE model
# (tests/data/qwen3_moe): moelora-controller with 2 tensor-parallel worker processes, mixed 2D/3D
# mode, and two adapters pre-loaded from tests/data: "a2d" (2D, per-expert) and "a3d" (3D, PEFT
# target_parameters; converted to 2D in place at load). Prints the grpcurl calls to try, then runs
# in the foreground until Ctrl-C (SIGINT drains and stops the workers).
# The OpenAI-compatible HTTP API is on MOELORA_HTTP_PORT.
#   MOELORA_PORT (50051), MOELORA_METRICS_PORT (9400), MOELORA_HTTP_PORT (8000),
#   MOELORA_STATE_DIR (.cache/run-state)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh >/dev/null
B="${MOELORA_BUILD_DIR:-build}"
export CCACHE_DIR="${CCACHE_DIR:-$PWD/.cache/ccache}"
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$B" -j"$(nproc)" --target moelora-controller moelora-worker >/dev/null
PORT="${MOELORA_PORT:-50051}"
METRICS="${MOELORA_METRICS_PORT:-9400}"
HTTP="${MOELORA_HTTP_PORT:-8000}"
STATE="${MOELORA_STATE_DIR:-.cache/run-state}"
cat <<MSG
moelora: starting on localhost:$PORT (metrics: http://localhost:$METRICS/metrics)
  model: tests/data/qwen3_moe/model (Qwen3MoeForCausalLM, tiny), 2 worker ranks, mixed 2D/3D mode
  adapters: a2d = qwen3_moe/adapter_2d (2D), a3d = qwen3_moe/adapter_3d (3D, converted to 2D)
Try (grpcurl needs no proto files: reflection is on):
  grpcurl -plaintext localhost:$PORT list
  grpcurl -plaintext localhost:$PORT describe moelora.v1.Controller
  grpcurl -plaintext localhost:$PORT grpc.health.v1.Health/Check
  grpcurl -plaintext localhost:$PORT moelora.v1.Controller/ListAdapters
  grpcurl -plaintext -d '{"adapter": "a3d", "prompt": "The quick brown fox", "max_tokens": 8}' localhost:$PORT moelora.v1.Controller/Generate
  grpcurl -plaintext -d '{"adapter": "a2d", "prompt": "Hello, world", "max_tokens": 12, "stop": ["\n"]}' localhost:$PORT moelora.v1.Controller/GenerateStream
  grpcurl -plaintext -d '{"prompt_token_ids": [1, 17, 42, 5], "max_tokens": 4, "return_logprobs": true}' localhost:$PORT moelora.v1.Controller/Generate
  grpcurl -plaintext -d '{"name": "shared", "path": "qwen3_moe/adapter_2d_shared_a"}' localhost:$PORT moelora.v1.Controller/LoadAdapter
  curl -s localhost:$METRICS/metrics | grep moelora_adapter_load_seconds
The OpenAI-compatible HTTP API (model: a2d, a3d or qwen3-moe-tiny):
  curl -s localhost:$HTTP/v1/models
  curl -s localhost:$HTTP/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "a2d", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 12}'
(without grpcurl: python3 tools/reflection_client.py localhost:$PORT list, after pip install grpcio grpcio-reflection)
MSG
exec "$B/controller/moelora-controller" \
  --model tests/data/qwen3_moe/model --adapter-root tests/data --state-dir "$STATE" \
  --tensor-parallel-size 2 --enable-mixed-moe-lora-format \
  --port "$PORT" --metrics-port "$METRICS" --http-port "$HTTP" --served-model-name qwen3-moe-tiny \
  --preload a2d=qwen3_moe/adapter_2d,a3d=qwen3_moe/adapter_3d \
  "$@"
