#!/usr/bin/env bash
# The one device check of the CUDA path: build (or take a prebuilt bundle), run the GPU tests,
# TP=1 vs TP=2 over NCCL when two GPUs exist, the benchmarks, and print a short table last.
# Fits in 10 minutes on an H200 (the build dominates when building here).
#
#   kernels/gpu_check.sh                 build here: needs the project's Debian packages
#                                        (scripts/install_deps.sh), nvcc, and a PyTorch whose
#                                        libtorch has CUDA (python3 -c 'import torch')
#   kernels/gpu_check.sh --bundle DIR    run binaries that kernels/make_gpu_bundle.sh built on
#                                        another machine (for GPU machines without the Debian
#                                        packages, such as the device tool's); libtorch, NCCL
#                                        and the CUDA runtime come from this machine's PyTorch
#
# The full log goes to ${OUT:-build-gpu}/gpu_check.log; exit status 0 only when every test
# passed (benchmarks report, they do not fail the check).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
BUNDLE=""
if [ "${1:-}" = "--bundle" ]; then BUNDLE="$(cd "$2" && pwd)"; fi
LOGDIR="${OUT:-$ROOT/build-gpu}"
mkdir -p "$LOGDIR"
LOG="$LOGDIR/gpu_check.log"
: >"$LOG"
say() { echo "$@" | tee -a "$LOG"; }
run() { say "+ $*"; "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }

say "== gpu_check $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
TORCH_DIR=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null || true)
[ -n "$TORCH_DIR" ] && say "PyTorch: $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')"

if [ -n "$BUNDLE" ]; then
  BIN="$BUNDLE/bin"
  # Bundled libraries first, then PyTorch's libtorch and the NVIDIA wheels (NCCL, cudart).
  LIBS="$BUNDLE/lib"
  [ -n "$TORCH_DIR" ] && LIBS="$LIBS:$TORCH_DIR/lib"
  for d in "$TORCH_DIR"/../nvidia/*/lib "$TORCH_DIR"/../nvidia/cu13/lib /usr/local/cuda/lib64; do
    [ -d "$d" ] && LIBS="$LIBS:$(cd "$d" && pwd)"
  done
  export LD_LIBRARY_PATH="$LIBS:${LD_LIBRARY_PATH:-}"
  export MOELORA_WORKER_BIN="$BIN/moelora-worker"
else
  B="$ROOT/build-gpu"
  [ -z "$TORCH_DIR" ] && { say "no PyTorch: cannot find a CUDA libtorch"; exit 1; }
  T0=$(date +%s)
  run env TORCH_CUDA_ARCH_LIST=9.0 cmake -S "$ROOT" -B "$B" -DCMAKE_BUILD_TYPE=Release \
    -DMOELORA_ENABLE_CUDA=ON -DCMAKE_PREFIX_PATH="$TORCH_DIR" \
    -DTorch_DIR="$TORCH_DIR/share/cmake/Torch" -DTORCH_CUDA_ARCH_LIST=9.0 >/dev/null || exit 1
  run cmake --build "$B" -j"$(nproc)" --target kernels_gpu_test kernels_test worker_engine_test \
    worker_process_test moelora-worker gpu_kernels >/dev/null || { say "build failed"; exit 1; }
  say "build: $(($(date +%s) - T0)) s"
  BIN="$B/bin"
  mkdir -p "$BIN"
  for t in tests/kernels_gpu_test tests/kernels_test tests/worker_engine_test \
    tests/worker_process_test worker/moelora-worker bench/gpu_kernels; do
    ln -sf "$B/$t" "$BIN/"
  done
  export MOELORA_WORKER_BIN="$BIN/moelora-worker"
fi
export MOELORA_TEST_DATA_DIR="$ROOT/tests/data"

declare -A RESULT
gtest() {  # name binary [filter]
  local name=$1 bin=$2 filter=${3:-*}
  local out
  out=$(timeout 300 "$BIN/$bin" --gtest_filter="$filter" --gtest_brief=0 2>&1)
  local rc=$?
  echo "$out" >>"$LOG"
  echo "$out" | grep -E '^\[(ref|tp)\]|FAILED|SKIPPED \]|Failure|error while loading' | head -40
  local passed skipped
  passed=$(echo "$out" | grep -oP '\[  PASSED  \] \K[0-9]+' | tail -1)
  skipped=$(echo "$out" | grep -oP '\[  SKIPPED \] \K[0-9]+(?= test)' | tail -1)
  RESULT[$name]="rc=$rc passed=${passed:-0} skipped=${skipped:-0}"
  [ "$rc" -eq 0 ]
}

FAIL=0
say "== kernels: CUDA vs CPU twins"
gtest kernels_gpu kernels_gpu_test || FAIL=1
say "== kernels: CPU twins and device API"
gtest kernels_unit kernels_test || FAIL=1
say "== worker on the GPU (--device cuda) against transformers + PEFT"
gtest worker_cuda worker_engine_test 'Cuda*:*Cuda*:KernelTwins*' || FAIL=1
if [ "$NGPU" -ge 2 ]; then
  say "== TP=2 vs TP=1 over NCCL (worker processes, --device cuda)"
  MOELORA_TEST_WORKER_FLAGS="--device cuda" gtest tp_nccl worker_process_test 'Fixtures/WorkerTpTest.*' || FAIL=1
else
  RESULT[tp_nccl]="skipped: $NGPU GPU(s)"
fi
say "== benchmarks"
BENCH=$(timeout 300 "$BIN/gpu_kernels" 2>&1)
echo "$BENCH" | tee -a "$LOG"

say ""
say "== gpu_check summary"
printf '%-14s %s\n' check result | tee -a "$LOG"
for k in kernels_gpu kernels_unit worker_cuda tp_nccl; do
  printf '%-14s %s\n' "$k" "${RESULT[$k]:-not run}" | tee -a "$LOG"
done
echo "$BENCH" | grep -E '^summary|^d2d|^device' | tee -a "$LOG"
say "overall: $([ $FAIL -eq 0 ] && echo PASS || echo FAIL)"
exit $FAIL
