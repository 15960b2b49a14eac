#!/usr/bin/env bash
# The test command: installs dependencies, builds, runs every test.
#   1. Release build with gcc (CUDA code compiled and linked when nvcc is in /usr/local/cuda),
#      ctest labels unit, integration (real worker processes on loopback) and gpu (gpu tests
#      skip without a device);
#   2. clang build with ASan+UBSan and libFuzzer: the fuzzers run MOELORA_FUZZ_SECONDS each
#      (default 30), seeded from tests/data;
#   3. ThreadSanitizer (clang, with -Wthread-safety as an error): the controller (which has no
#      libtorch) and its unit and integration tests, driving release-build workers; then
#      ASan+UBSan: every unit and integration test;
#   4. the Docker image: deploy/docker/Dockerfile built with a real engine (dockerd started here
#      when none runs; the Debian base image from debootstrap) and run single-node and multi-node
#      (tests/deploy/docker_test.sh);
#   5. with MOELORA_BENCH=1 only: bench/peer --quick against transformers + PEFT (a 5.6 GB venv)
#      and short runs of the benchmarks (figures, not regression checks: the reference-logits
#      tests compare with transformers + PEFT in step 1).
# MOELORA_SKIP_FUZZ=1 skips step 2, MOELORA_SKIP_SANITIZERS=1 step 3, MOELORA_SKIP_DOCKER=1 step 4;
# MOELORA_BUILD_DIR moves the build trees. Each step prints the seconds since the start.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
phase() { echo "== $* [at ${SECONDS}s]"; }
bash scripts/install_deps.sh
JOBS="${JOBS:-$(nproc)}"
B="${MOELORA_BUILD_DIR:-build}"
export CCACHE_DIR="${CCACHE_DIR:-$PWD/.cache/ccache}"
# Paths relative to the checkout, compiler by content: the Docker build stage (sources in /src, the
# same Debian compiler) then hits the release build's entries (docker_test.sh seeds its cache).
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}" CCACHE_COMPILERCHECK="${CCACHE_COMPILERCHECK:-content}"
# ccache hashes LANG and LC_ALL/LC_CTYPE/LC_MESSAGES: one fixed locale here and in the Docker build
# stage (also what the tests run under, whatever the machine's default).
export LANG=C.UTF-8
unset LC_ALL LC_CTYPE LC_MESSAGES

phase "configure + build ($B)"
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release
cmake --build "$B" -j"$JOBS"
phase "Python packages for the reflection and deploy tests (pip into .cache/pyvenv)"
if ! { python3 -m venv .cache/pyvenv && .cache/pyvenv/bin/pip install -q grpcio grpcio-reflection \
      protobuf kubernetes-validate pyyaml; }; then
  echo "pip unavailable: the reflection and deploy tests will report themselves skipped"
fi
phase "tests: unit + integration + gpu"
(cd "$B" && ctest --output-on-failure -j"$JOBS" -L 'unit|integration|gpu')
phase "controller tests beside two busy loops (short form of scripts/stress_controller_tests.sh)"
bash scripts/stress_controller_tests.sh "$B" 3 1
phase "format check"
cmake --build "$B" --target check-format || { echo "format check failed (run: cmake --build $B --target format)"; exit 1; }

if [ "${MOELORA_SKIP_FUZZ:-0}" != "1" ]; then
  phase "fuzz (clang, ASan+UBSan, libFuzzer)"
  CC=clang CXX=clang++ cmake -S . -B "$B-fuzz" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOELORA_ENABLE_CUDA=OFF \
    -DMOELORA_BUILD_FUZZERS=ON -DMOELORA_FUZZ_SECONDS="${MOELORA_FUZZ_SECONDS:-30}"
  cmake --build "$B-fuzz" -j"$JOBS" --target safetensors_fuzz adapter_fuzz tokenizer_fuzz chat_template_fuzz image_fuzz http_fuzz \
    chat_output_fuzz
  (cd "$B-fuzz" && ctest --output-on-failure -j"$JOBS" -L fuzz)
fi

if [ "${MOELORA_SKIP_SANITIZERS:-0}" != "1" ]; then
  WORKER_BIN="$(cd "$B" && pwd)/worker/moelora-worker"
  # clang: -Wthread-safety checks the lock annotations (ABSL_GUARDED_BY, ...) as -Werror.
  phase "ThreadSanitizer + clang -Wthread-safety: controller (unit + integration; release workers)"
  CC=clang CXX=clang++ cmake -S . -B "$B-tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DMOELORA_ENABLE_CUDA=OFF -DMOELORA_SANITIZE_THREAD=ON
  cmake --build "$B-tsan" -j"$JOBS" --target moelora-controller controller_unit_test controller_test
  (cd "$B-tsan" && MOELORA_WORKER_BIN="$WORKER_BIN" \
    TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1 suppressions=$ROOT/tests/tsan.supp" \
    ctest --output-on-failure -j"$JOBS" -R '^(RegistryTest|PathPolicyTest|SlotPoolTest|ControllerUnitTest|RequestValidationTest|ControllerTest|HttpServerTest)\.')
  phase "ASan+UBSan: unit + integration"
  # -O1 -g1: about twice as fast to compile as RelWithDebInfo, still with file:line in reports.
  # A unity build for the libraries that allow it (the worker's, which include ATen, most of all;
  # tests, proto, tokenizer, lora and controller opt out): 12.6 min against 14.3 here.
  cmake -S . -B "$B-asan" -DCMAKE_BUILD_TYPE=None "-DCMAKE_CXX_FLAGS=-O1 -g1" -DMOELORA_ENABLE_CUDA=OFF \
    -DMOELORA_SANITIZE=ON -DMOELORA_BUILD_BENCH=OFF -DCMAKE_UNITY_BUILD=ON
  cmake --build "$B-asan" -j"$JOBS"
  # allocator_may_return_null: an impossible allocation fails as it would without ASan (the
  # exception-boundary test asks libtorch for 4 PiB and expects RESOURCE_EXHAUSTED).
  (cd "$B-asan" && ASAN_OPTIONS="detect_leaks=0 abort_on_error=1 allocator_may_return_null=1" UBSAN_OPTIONS="print_stacktrace=1" \
    ctest --output-on-failure -j"$JOBS" -L 'unit|integration')
  ASAN_OPTIONS="detect_leaks=0 abort_on_error=1" bash scripts/stress_controller_tests.sh "$B-asan" 3 0
fi

if [ "${MOELORA_SKIP_DOCKER:-0}" != "1" ]; then
  phase "Docker image: build and run (tests/deploy/docker_test.sh)"
  rc=0; bash tests/deploy/docker_test.sh || rc=$?
  if [ "$rc" -eq 77 ]; then echo "docker test skipped (no engine here)"; elif [ "$rc" -ne 0 ]; then exit "$rc"; fi
fi

if [ "${MOELORA_BENCH:-0}" = "1" ]; then
  # Against transformers + PEFT on a medium Qwen3-MoE: f32 greedy outputs must be identical
  # (exit 1 otherwise); the tokens/s ratios are figures. Needs torch, transformers and peft from
  # PyPI (tools/peer_venv.sh: 5.6 GB, about 4 minutes).
  phase "bench/peer --quick: moelora vs transformers + PEFT (venv .cache/peer-venv)"
  if PY="$(bash tools/peer_venv.sh)"; then
    "$B/bench/peer" --python "$PY" --dir "$ROOT/.cache/peer-model" --quick
  else
    echo "pip could not install torch/transformers/peft: bench/peer skipped"
  fi
  phase "bench (figures only)"
  "$B/bench/adapter_load" --layers 8 --repeat 2
  "$B/bench/decode_step" --steps 5 --repeat 2 --prefill 128
  "$B/bench/serving" --clients 8 --requests 10 --loads 6
  "$B/bench/http_api" --requests 8 --rounds 3
  # The tokenizer corpus exists when the tokenizer_corpus test could pip-install its generator.
  if [ -s "$B/tokenizer_corpus/corpus.jsonl" ]; then
    "$B/bench/tokenizer_encode" "$B/tokenizer_corpus" --repeat 5
  fi
fi
phase "done"
