#!/usr/bin/env bash
# The controller's tests with the machine busy: two busy loops on the same cores as the tests
# (as a loaded CI runner), the controller unit tests RUNS times and its integration tests
# (ControllerTest.*) INTEGRATION_RUNS times; exits 1 on the first failure. Timing assumptions
# show up here as failures that a quiet machine hides.
#   scripts/stress_controller_tests.sh BUILD_DIR [RUNS] [INTEGRATION_RUNS]
# CI runs a short form (scripts/test.sh: 3 and 1); the README gives the full one.
set -euo pipefail
B="${1:?build directory}"
RUNS="${2:-20}"
INTEGRATION_RUNS="${3:-20}"
cd "$B"
busy=()
for _ in 1 2; do
  sh -c 'while :; do :; done' &
  busy+=("$!")
done
trap 'kill "${busy[@]}" 2>/dev/null || true' EXIT
for i in $(seq 1 "$RUNS"); do
  if ! ./tests/controller_unit_test --gtest_brief=1 > "controller_unit_stress.log" 2>&1; then
    echo "controller_unit_test failed under load (run $i of $RUNS):"
    tail -60 controller_unit_stress.log
    exit 1
  fi
done
echo "controller_unit_test: $RUNS of $RUNS passed under load"
for i in $(seq 1 "$INTEGRATION_RUNS"); do
  if ! ctest --output-on-failure -j2 -R '^ControllerTest\.' > "controller_integration_stress.log" 2>&1; then
    echo "ControllerTest.* failed under load (run $i of $INTEGRATION_RUNS):"
    grep -E "Failure|FAILED|Failed" controller_integration_stress.log | head -40
    exit 1
  fi
done
if [ "$INTEGRATION_RUNS" -gt 0 ]; then
  echo "ControllerTest.*: $INTEGRATION_RUNS of $INTEGRATION_RUNS passed under load"
fi
