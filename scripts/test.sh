#!/usr/bin/env bash
# The test command: installs dependencies, builds, runs every test.
#   1. Release build with gcc (CUDA code compiled and linked when nvcc is in /usr/local/cuda),
#      ctest labels unit, integration (real worker processes on loopback) and gpu (gpu tests
#      skip without a device);
#   2. clang build with ASan+UBSan and libFuzzer: the fuzzers run MOELORA_FUZZ_SECONDS each
#      (default 30), seeded from tests/data;
#   3. short runs of the benchmarks (figures only, never pass/fail).
# Set MOELORA_SKIP_FUZZ=1 to skip step 2, MOELORA_BUILD_DIR to move the build trees.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
JOBS="${JOBS:-$(nproc)}"
B="${MOELORA_BUILD_DIR:-build}"
export CCACHE_DIR="${CCACHE_DIR:-$PWD/.cache/ccache}"

echo "== configure + build ($B)"
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release
cmake --build "$B" -j"$JOBS"
echo "== tests: unit + integration + gpu"
(cd "$B" && ctest --output-on-failure -j"$JOBS" -L 'unit|integration|gpu')
echo "== format check"
cmake --build "$B" --target check-format || { echo "format check failed (run: cmake --build $B --target format)"; exit 1; }

if [ "${MOELORA_SKIP_FUZZ:-0}" != "1" ]; then
  echo "== fuzz (clang, ASan+UBSan, libFuzzer)"
  CC=clang CXX=clang++ cmake -S . -B "$B-fuzz" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOELORA_ENABLE_CUDA=OFF \
    -DMOELORA_BUILD_FUZZERS=ON -DMOELORA_FUZZ_SECONDS="${MOELORA_FUZZ_SECONDS:-30}"
  cmake --build "$B-fuzz" -j"$JOBS" --target safetensors_fuzz adapter_fuzz
  (cd "$B-fuzz" && ctest --output-on-failure -L fuzz)
fi

echo "== bench (figures only)"
"$B/bench/adapter_load" --layers 8 --repeat 2
"$B/bench/decode_step" --steps 5 --repeat 2
