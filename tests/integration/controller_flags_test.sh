#!/usr/bin/env bash
# moelora-controller refuses bad values of the flags it forwards to its workers at startup, with
# exit status 1 and a message naming the flag, before it opens its state directory or spawns a
# worker (a worker that refused one exited, and the controller restarted the group with it
# forever). A good set of the same flags still starts.
# Usage: controller_flags_test.sh CONTROLLER_BIN WORKER_BIN
set -uo pipefail
CONTROLLER="$1"
WORKER="$2"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
MODEL="$ROOT/tests/data/qwen3_moe/model"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fails=0
while IFS='|' read -r flags want; do
  [ -z "$flags" ] && continue
  flags="${flags//@DATA@/$ROOT/tests/data}"  # a later --model replaces the one above
  # shellcheck disable=SC2086
  out="$(timeout 20 "$CONTROLLER" --model "$MODEL" --worker-bin "$WORKER" --port 0 \
    --metrics-port -1 --state-dir "$TMP/state" $flags 2>&1)"
  rc=$?
  if [ "$rc" -ne 1 ] || [[ "$out" != *"$want"* ]] || [ -e "$TMP/state" ]; then
    echo "FAIL: $flags: exit $rc, state dir $( [ -e "$TMP/state" ] && echo created || echo absent)," \
      "want exit 1 and \"$want\"; output:"
    echo "$out" | tail -3
    fails=$((fails + 1))
    rm -rf "$TMP/state"
  else
    echo "ok: $flags: $(echo "$out" | tail -1)"
  fi
done <<'CASES'
--max-num-seqs 0|--max-num-seqs must be >= 1
--max-lora-rank 0|--max-lora-rank must be in 1..512
--max-lora-rank 513|--max-lora-rank must be in 1..512
--dtype float16|--dtype float16: expected float32 or bfloat16
--max-model-len -1|--max-model-len must be >= 0
--step-timeout-s 0|--step-timeout-s must be >= 1
--drain-timeout-s -1|--drain-timeout-s must be >= 0
--dist-timeout-s 0|--dist-timeout-s must be >= 1
--decode-steps 17|--decode-steps must be in 1..16
--tool-call-parser hermes|--tool-call-parser needs --enable-auto-tool-choice
--enable-auto-tool-choice|--enable-auto-tool-choice needs --tool-call-parser (hermes, qwen3_coder)
--enable-auto-tool-choice --tool-call-parser mistral|unknown tool-call parser "mistral" (known: hermes, qwen3_coder)
--reasoning-parser deepseek_r1|unknown reasoning parser "deepseek_r1" (known: qwen3)
--tensor-parallel-size 0|--tensor-parallel-size must be >= 1
--speculative-config {"method":"eagle","num_speculative_tokens":2}|"method" must be "mtp"
--speculative-config {"method":"mtp","num_speculative_tokens":0}|must be an integer in 1..16
--speculative-config {"method":"mtp","num_speculative_tokens":2}|declares no MTP head
--model @DATA@/step3p5_mtp/model --speculative-config {"method":"mtp","num_speculative_tokens":4}|declares num_nextn_predict_layers 3 (one MTP layer per draft token)
--model @DATA@/step3p5/model --speculative-config {"method":"mtp","num_speculative_tokens":2}|declares num_nextn_predict_layers 1 (one MTP layer per draft token)
CASES
# The boundary values start: the port file appears, then SIGTERM stops it with status 0.
"$CONTROLLER" --model "$MODEL" --worker-bin "$WORKER" --port 0 --metrics-port -1 \
  --state-dir "$TMP/ok" --port-file "$TMP/ok.port" --max-num-seqs 1 --max-lora-rank 512 \
  --dtype bfloat16 --max-model-len 0 --step-timeout-s 1 --drain-timeout-s 0 \
  >"$TMP/ok.log" 2>&1 &
pid=$!
for _ in $(seq 1 200); do [ -s "$TMP/ok.port" ] && break; sleep 0.1; done
if [ ! -s "$TMP/ok.port" ]; then
  echo "FAIL: boundary values did not start:"; tail -3 "$TMP/ok.log"; fails=$((fails + 1))
fi
kill -TERM "$pid" 2>/dev/null
wait "$pid"
rc=$?
if [ "$rc" -ne 0 ]; then echo "FAIL: boundary values: exit $rc after SIGTERM"; fails=$((fails + 1)); fi
[ "$fails" -eq 0 ] && echo "all passed"
exit $((fails > 0))
