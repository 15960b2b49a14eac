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
    worker_process_test moelora-worker gpu_kernels decode_step >/dev/null || { say "build failed"; exit 1; }
  say "build: $(($(date +%s) - T0)) s"
  BIN="$B/bin"
  mkdir -p "$BIN"
  for t in tests/kernels_gpu_test tests/kernels_test tests/worker_engine_test \
    tests/worker_process_test worker/moelora-worker bench/gpu_kernels bench/decode_step; do
    ln -sf "$B/$t" "$BIN/"
  done
  export MOELORA_WORKER_BIN="$BIN/moelora-worker"
fi
export MOELORA_TEST_DATA_DIR="$ROOT/tests/data"

export MOELORA_REQUIRE_CUDA=1  # a test that would skip for want of a device fails instead
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)

# Each gtest suite of a binary runs as its own process, so one kernel fault (a sticky CUDA
# error) fails that suite only; a failing suite is rerun under compute-sanitizer (memcheck)
# when the machine has it. RESULT[name] sums the suites: passed / skipped / failed tests.
declare -A RESULT
gtest() {  # name binary [filter]
  local name=$1 bin=$2 filter=${3:-*}
  local suites rc_all=0 p_all=0 s_all=0 f_all=0 bad=""
  # --gtest_list_tests: "Suite." lines, then "  test" lines (parameterised ones with a comment).
  suites=$("$BIN/$bin" --gtest_filter="$filter" --gtest_list_tests 2>>"$LOG" |
    awk '/^[^ ]/ {s=$1} /^  / {t[s]=t[s] (t[s]==""?"":":") s $1} END {for (k in t) print t[k]}')
  if [ -z "$suites" ]; then
    say "$name: no tests match '$filter' in $bin"
    RESULT[$name]="rc=1 no tests"
    return 1
  fi
  while read -r tests; do
    local suite=${tests%%.*} out rc passed skipped failed
    out=$(timeout 300 "$BIN/$bin" --gtest_filter="$tests" --gtest_brief=0 2>&1)
    rc=$?
    { echo "---- $name: $suite (rc=$rc)"; echo "$out"; } >>"$LOG"
    echo "$out" | grep -E '^\[(ref|tp|shape)\]|FAILED|SKIPPED \]|Failure|error while loading' | head -20
    passed=$(echo "$out" | grep -oP '\[  PASSED  \] \K[0-9]+' | tail -1)
    skipped=$(echo "$out" | grep -oP '\[  SKIPPED \] \K[0-9]+(?= test)' | tail -1)
    failed=$(echo "$out" | grep -oP '\[  FAILED  \] \K[0-9]+(?= test)' | tail -1)
    [ "$rc" -ne 0 ] && [ -z "$failed" ] && failed=1  # crashed or timed out: counts as a failure
    p_all=$((p_all + ${passed:-0})); s_all=$((s_all + ${skipped:-0})); f_all=$((f_all + ${failed:-0}))
    say "  $suite: passed=${passed:-0} skipped=${skipped:-0} failed=${failed:-0} rc=$rc"
    if [ "$rc" -ne 0 ]; then
      rc_all=1
      bad="$bad $suite"
      if [ -n "$SANITIZER" ]; then
        local slog="$LOGDIR/sanitizer-$name-${suite//\//_}.log"
        say "  rerunning $suite under compute-sanitizer (log: $slog)"
        timeout 300 "$SANITIZER" --tool memcheck --print-limit 20 "$BIN/$bin" \
          --gtest_filter="$tests" >"$slog" 2>&1
        grep -E '^========= (Invalid|Program hit|ERROR SUMMARY)|^=========     at' \
          "$slog" | head -12 | tee -a "$LOG"
      fi
    fi
  done <<<"$suites"
  RESULT[$name]="rc=$rc_all passed=$p_all skipped=$s_all failed=$f_all${bad:+ (failing:$bad)}"
  [ "$rc_all" -eq 0 ] && [ "$s_all" -eq 0 ]
}

FAIL=0
say "== kernels: CUDA vs CPU twins"
gtest kernels_gpu kernels_gpu_test || FAIL=1
say "== kernels: CPU twins and device API"
gtest kernels_unit kernels_test '-Device.NoDeviceMeansCleanErrors' || FAIL=1
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
say "== end to end: decode steps on a Qwen3-30B-A3B-shaped model (4 layers), --device cuda bf16"
# (MOELORA_GPU_CHECK_SKIP_E2E=1 skips it: dry runs of this script without a device.)
E2E=$(${MOELORA_GPU_CHECK_SKIP_E2E:+true} timeout 420 "$BIN/decode_step" --only a3b --device cuda --dtype bfloat16 --batches 1,16,64 \
  --steps 10 --repeat 2 2>&1)
echo "$E2E" | tee -a "$LOG"
say ""
say "== gpu_check summary"
printf '%-14s %s\n' check result | tee -a "$LOG"
for k in kernels_gpu kernels_unit worker_cuda tp_nccl; do
  printf '%-14s %s\n' "$k" "${RESULT[$k]:-not run}" | tee -a "$LOG"
done
echo "$BENCH" | grep -E '^summary|^d2d|^device' | tee -a "$LOG"
echo "$E2E" | grep -E '^a3b' | tee -a "$LOG"
say "overall: $([ $FAIL -eq 0 ] && echo PASS || echo FAIL)"
exit $FAIL
