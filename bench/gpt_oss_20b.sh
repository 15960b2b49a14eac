#!/usr/bin/env bash
# bench/gpt_oss_20b.sh: gpt-oss-20b at its real size beside llama.cpp, in one run. The checkpoint
# has the release's config, shapes and storage (MXFP4 experts, bf16 elsewhere) with random weights
# (tools/synthetic_gpt_oss.py: the release itself is not fetched here); llama.cpp is built from the
# source vendored in the PyPI llama-cpp-python sdist and reads the same checkpoint converted by its
# own convert_hf_to_gguf.py (MXFP4 repacked losslessly) (tools/llama_cpp_peer.sh). Both decode one
# sequence on the same threads after a 16-token prompt: llama-bench's tg and pp, moelora's engine
# through bench/decode_step --only model. Prints tokens/s of both and moelora / llama.cpp.
#   bench/gpt_oss_20b.sh [--threads 2] [--tokens 32] [--layers N] [--dir .cache/gpt-oss-20b]
# --layers N: the first N layers only (a quick check of the pipeline). Needs about 28 GB of disk
# (the checkpoint and its GGUF) and 16 GB of memory; the build tree build/ (bench/decode_step).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=2 TOKENS=32 LAYERS=0 DIR=.cache/gpt-oss-20b
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) THREADS="$2"; shift 2 ;;
    --tokens) TOKENS="$2"; shift 2 ;;
    --layers) LAYERS="$2"; shift 2 ;;
    --dir) DIR="$2"; shift 2 ;;
    -h|--help) sed -n 2,12p "$0"; exit 0 ;;
    *) echo "unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done
[ "$LAYERS" != 0 ] && DIR="$DIR-$LAYERS"
PY="$(bash tools/peer_venv.sh)"
if [ ! -f "$DIR/model/model.safetensors.index.json" ]; then
  ARGS=()
  [ "$LAYERS" != 0 ] && ARGS=(--layers "$LAYERS")
  "$PY" tools/synthetic_gpt_oss.py "$DIR/model" "${ARGS[@]}" >&2
fi
LLAMA_BENCH="$(bash tools/llama_cpp_peer.sh build)"
[ -f "$DIR/model.gguf" ] || bash tools/llama_cpp_peer.sh convert "$DIR/model" "$DIR/model.gguf" bf16 >&2
LLAMA_JSON="$("$LLAMA_BENCH" -m "$DIR/model.gguf" -t "$THREADS" -p 16 -n "$TOKENS" -r 3 -o json)"
OURS="$(OMP_NUM_THREADS="$THREADS" build/bench/decode_step --only model --model "$DIR/model" \
  --dtype bfloat16 --batches 1 --steps "$TOKENS" --repeat 3 2>/dev/null)"
echo "$OURS"
"$PY" - "$LLAMA_JSON" "$OURS" <<'PYEOF'
import json, re, sys
runs = json.loads(sys.argv[1])
tg = next(r["avg_ts"] for r in runs if r["n_gen"] > 0)
pp = next(r["avg_ts"] for r in runs if r["n_prompt"] > 0)
ours = float(re.search(r"batch 1: decode step [0-9.]+ ms, ([0-9.]+) tokens/s", sys.argv[2]).group(1))
print(f"llama.cpp: decode {tg:.2f} tokens/s, prompt {pp:.1f} tokens/s ({runs[0]['n_threads']} threads)")
print(f"moelora: decode {ours:.2f} tokens/s; moelora / llama.cpp = {ours / tg:.2f}x")
PYEOF
