#!/usr/bin/env bash
# The run command, for now: builds moelora-adapter and shows it on the committed fixtures — a 2D
# adapter (per-expert) and a 3D adapter (PEFT target_parameters) of a tiny Qwen3-MoE model —
# inspecting both, converting the 3D one to 2D and back, and validating against the model.
# (The controller/worker service replaces this in a later release.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh >/dev/null
B="${MOELORA_BUILD_DIR:-build}"
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$B" -j"$(nproc)" --target moelora-adapter >/dev/null
CLI="$B/lora/moelora-adapter"
D=tests/data/qwen3_moe
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
set -x
"$CLI" inspect "$D/adapter_2d"
"$CLI" inspect "$D/adapter_3d" --json
"$CLI" validate "$D/adapter_3d" --model "$D/model"
"$CLI" convert "$D/adapter_3d" --to 2d --out "$OUT/as_2d"
"$CLI" inspect "$OUT/as_2d"
"$CLI" convert "$OUT/as_2d" --to 3d --out "$OUT/back_3d"
"$CLI" inspect "$OUT/back_3d" --json
"$CLI" validate tests/data/gpt_oss/adapter_3d --model tests/data/gpt_oss/model
