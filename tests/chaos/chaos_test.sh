#!/usr/bin/env bash
# The chaos suite: faults injected into the real controller and workers (tiny Qwen3-MoE, TP=2,
# both adapter layouts loaded, steps slowed to 20 ms so that requests are mid-flight when a fault
# strikes). After each fault, chaos_client checks: every request got a final status within its
# deadline (none hangs), the service is SERVING again within 30 s, the workers hold zero
# sequences, their committed adapters equal the controller's resident ones, and the registry
# still lists every adapter.
#   flood       2,000 concurrent streams: bounded controller threads, health within 1 s,
#               refusals beyond --max-queued-requests at once
#   disconnect  500 clients that go away mid-stream
#   kill        SIGKILL a worker mid-step
#   stop        SIGSTOP a worker past the step timeout, then SIGCONT
#   alloc       an allocation failure in one prompt's chunk (TP=1: a real libtorch allocation
#               failure the worker's --debug-fail-prompt-chunk-tokens asks for): that request
#               alone ends RESOURCE_EXHAUSTED, the sequences decoding beside it finish
#   truncated   an adapter whose weights file is cut short after its header; one cut short after
#               it was loaded, read again by a restarted group
#   full_disk   LoadAdapter with --state-dir on a full file system (root only: a 4 MiB tmpfs)
#   restart     --workers mode: SIGKILL the controller mid-step, start it again, workers kept
# Usage: chaos_test.sh CONTROLLER WORKER CHAOS_CLIENT [SCENARIO...] (default: all)
set -euo pipefail
CONTROLLER="$1"
WORKER="$2"
CLIENT="$3"
shift 3
SCENARIOS=("$@")
[ ${#SCENARIOS[@]} -gt 0 ] || SCENARIOS=(flood disconnect kill stop alloc truncated full_disk restart)
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
TMP="$(mktemp -d)"
PIDS=()
MOUNTED=""
cleanup() {
  for p in "${PIDS[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "$MOUNTED" ] && umount "$MOUNTED" 2>/dev/null || true
  if [ -n "${MOELORA_CHAOS_KEEP:-}" ]; then echo "kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$TMP"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -25 "$f"; }; done
  exit 1
}

# The adapters live in a root of their own (the truncated one is made there).
mkdir -p "$TMP/adapters"
cp -r "$ROOT/tests/data/qwen3_moe/adapter_2d" "$TMP/adapters/a2d"
cp -r "$ROOT/tests/data/qwen3_moe/adapter_3d" "$TMP/adapters/a3d"
MODEL="$ROOT/tests/data/qwen3_moe/model"
COMMON=(--model "$MODEL" --adapter-root "$TMP/adapters" --enable-mixed-moe-lora-format
        --step-timeout-s 3 --port 0 --metrics-port 0)

port_of() { sed -E 's/.*"port": *([0-9]+).*/\1/' "$1"; }
metrics_port_of() { sed -E 's/.*"metrics_port": *([0-9]+).*/\1/' "$1"; }
wait_file() {
  for _ in $(seq 1 300); do [ -s "$1" ] && return 0; sleep 0.1; done
  fail "no $1"
}

# start_spawned NAME STATE_DIR [TP [WORKER_ARGS [FLAGS...]]]: a controller that spawns its
# workers (TP=2 by default); sets CP, PORT, MPORT.
start_spawned() {
  local name="$1" state="$2" tp="${3:-2}" wargs="${4:-}"
  shift 2
  shift $(( $# < 2 ? $# : 2 ))
  rm -f "$TMP/$name.json"
  rm -rf "$state/run"  # worker groups of an earlier controller (their numbers start again)
  "$CONTROLLER" "${COMMON[@]}" --state-dir "$state" --tensor-parallel-size "$tp" \
    --worker-bin "$WORKER" --worker-args "--debug_step_delay_ms=20 $wargs" \
    --preload a2d=a2d,a3d=a3d --port-file "$TMP/$name.json" "$@" >"$TMP/$name.log" 2>&1 &
  CP=$!
  PIDS+=("$CP")
  wait_file "$TMP/$name.json"
  PORT="$(port_of "$TMP/$name.json")"
  MPORT="$(metrics_port_of "$TMP/$name.json")"
}
# The addresses of the newest spawned worker group under STATE_DIR, once it serves.
spawned_workers() {
  local state="$1" g f out=""
  "$CLIENT" check --target "127.0.0.1:$PORT" --metrics_port "$MPORT" --within_s 30 \
    --expect_adapters a2d,a3d >/dev/null || fail "not serving again within 30 s"
  g="$(newest_group "$state")"
  for f in "$g"/port.*; do out="${out:+$out,}127.0.0.1:$(port_of "$f")"; done
  echo "$out"
}
newest_group() { ls -d "$1"/run/group.* 2>/dev/null | sort -t. -k2 -n | tail -1; }
# kill_worker STATE R: SIGKILL rank R and wait until the controller has spawned a new group.
kill_worker() {
  local before
  before="$(newest_group "$1")"
  kill -9 "$(worker_pid "$2")"
  for _ in $(seq 1 300); do [ "$(newest_group "$1")" != "$before" ] && return 0; sleep 0.1; done
  fail "no new worker group 30 s after a worker was killed"
}
# The pid of the spawned worker of rank R (a child of the controller).
worker_pid() {
  local r="$1" p
  for p in $(pgrep -P "$CP"); do
    tr '\0' ' ' <"/proc/$p/cmdline" | grep -q -- "--rank=$r\b\|--rank $r\b" && { echo "$p"; return; }
  done
  fail "no worker of rank $r"
}
check_all() {  # check_all STATE_DIR
  local w
  w="$(spawned_workers "$1")"
  "$CLIENT" check --target "127.0.0.1:$PORT" --metrics_port "$MPORT" --workers "$w" --within_s 30 \
    --worker_secret_file "$1/run/secret" --expect_adapters a2d,a3d || fail "after $SCENARIO"
}
# Requests in flight while the fault strikes: 32 streams of 100 tokens (about 2 s at 20 ms a
# step), of which none may end by its own deadline (the service must end them first). Health
# must answer throughout; NOT_SERVING while the fault has the worker group down is that answer.
background_load() {
  "$CLIENT" check --target "127.0.0.1:$PORT" --metrics_port "$MPORT" --within_s 30 >/dev/null ||
    fail "not serving before $SCENARIO"
  "$CLIENT" flood --target "127.0.0.1:$PORT" --streams 32 --max_tokens 100 --adapters a2d,a3d, \
    --deadline_s 60 --forbid DEADLINE_EXCEEDED --health_may_be_down >"$TMP/load.out" 2>&1 &
  LOAD=$!
  sleep 0.7
}
finish_load() {
  wait "$LOAD" || { cat "$TMP/load.out"; fail "$SCENARIO: requests in flight"; }
  echo "  in flight: $(cat "$TMP/load.out")"
}

STATE="$TMP/state"
start_spawned main "$STATE"
for SCENARIO in "${SCENARIOS[@]}"; do
  echo "== $SCENARIO"
  "$CLIENT" check --target "127.0.0.1:$PORT" --metrics_port "$MPORT" --within_s 30 \
    --expect_adapters a2d,a3d >/dev/null || fail "not serving before $SCENARIO"
  case "$SCENARIO" in
    flood)
      check_all "$STATE"
      "$CLIENT" flood --target "127.0.0.1:$PORT" --streams 2000 --max_tokens 16 \
        --adapters a2d,a3d, --controller_pid "$CP" --max_threads 64 --health_max_ms 1000 \
        --refusal_max_ms 1000 --deadline_s 120 --forbid DEADLINE_EXCEEDED,UNAVAILABLE,INTERNAL ||
        fail "flood"
      check_all "$STATE"
      ;;
    disconnect)
      "$CLIENT" flood --target "127.0.0.1:$PORT" --streams 500 --max_tokens 100 \
        --adapters a2d,a3d, --disconnect_after 2 --deadline_s 60 \
        --forbid DEADLINE_EXCEEDED,UNAVAILABLE,INTERNAL,OK || fail "disconnect"
      check_all "$STATE"
      ;;
    kill)
      background_load
      kill_worker "$STATE" 1
      finish_load
      check_all "$STATE"
      ;;
    stop)
      background_load
      W0="$(worker_pid 0)"
      kill -STOP "$W0"
      sleep 5  # past --step-timeout-s 3
      kill -CONT "$W0"
      finish_load
      check_all "$STATE"
      ;;
    alloc)
      kill "$CP"; wait "$CP" 2>/dev/null || true
      # Prompts read whole (not 16 tokens a step beside the decodes): the 80-token one fails.
      start_spawned alloc "$TMP/alloc-state" 1 "--debug_fail_prompt_chunk_tokens=64" \
        --prefill-tokens-beside-decodes 0
      background_load
      # This refusal comes from a step that ran (not from a full queue): bound it loosely.
      "$CLIENT" flood --target "127.0.0.1:$PORT" --streams 1 --prompt_tokens 80 --max_tokens 8 \
        --expect RESOURCE_EXHAUSTED --refusal_max_ms 10000 >"$TMP/alloc.out" ||
        { cat "$TMP/alloc.out"; fail "alloc"; }
      grep -q "out of memory computing 80 tokens of this prompt" "$TMP/alloc.out" ||
        { cat "$TMP/alloc.out"; fail "alloc: the message"; }
      echo "  $(grep RESOURCE_EXHAUSTED: "$TMP/alloc.out")"
      wait "$LOAD" || { cat "$TMP/load.out"; fail "alloc: the requests beside it"; }
      grep -q "OK=32;" "$TMP/load.out" || { cat "$TMP/load.out"; fail "alloc: the requests beside it"; }
      echo "  beside it: $(head -1 "$TMP/load.out")"
      check_all "$TMP/alloc-state"
      kill "$CP"; wait "$CP" 2>/dev/null || true
      start_spawned main "$STATE"
      ;;
    truncated)
      cp -r "$TMP/adapters/a2d" "$TMP/adapters/cut"
      f="$TMP/adapters/cut/adapter_model.safetensors"
      # Keep the header (8-byte length + JSON) and a few bytes of the weights.
      hdr=$(( $(od -An -t u8 -N 8 "$f" | tr -d ' ') + 8 ))
      truncate -s $((hdr + 100)) "$f"
      out="$("$CLIENT" load --target "127.0.0.1:$PORT" --name cut --path cut)"
      echo "  $out"
      grep -q "load cut: INVALID_ARGUMENT: .*adapter_model.safetensors" <<<"$out" ||
        fail "a truncated adapter: $out"
      check_all "$STATE"
      out="$("$CLIENT" load --target "127.0.0.1:$PORT" --name cut --path cut)"
      grep -q "INVALID_ARGUMENT" <<<"$out" || fail "the truncated adapter again: $out"
      # Cut short after it was validated and loaded: the workers read it again from disk when a
      # restarted group reloads the registry. It alone fails; its requests get the reason.
      cp -r "$TMP/adapters/a2d" "$TMP/adapters/late"
      out="$("$CLIENT" load --target "127.0.0.1:$PORT" --name late --path late)"
      grep -q "load late: OK" <<<"$out" || fail "loading late: $out"
      f="$TMP/adapters/late/adapter_model.safetensors"
      truncate -s $(( $(od -An -t u8 -N 8 "$f" | tr -d ' ') + 108 )) "$f"
      kill_worker "$STATE" 0
      check_all "$STATE"
      "$CLIENT" flood --target "127.0.0.1:$PORT" --streams 2 --max_tokens 4 --adapters late \
        --expect FAILED_PRECONDITION >"$TMP/late.out" || { cat "$TMP/late.out"; fail "late"; }
      grep -q "late/adapter_model.safetensors" "$TMP/late.out" ||
        { cat "$TMP/late.out"; fail "late: the message names no file"; }
      echo "  $(grep FAILED_PRECONDITION: "$TMP/late.out")"
      "$CLIENT" flood --target "127.0.0.1:$PORT" --streams 4 --max_tokens 4 --adapters a2d,a3d \
        --expect OK >/dev/null || fail "the other adapters after late failed"
      ;;
    full_disk)
      if [ "$(id -u)" -ne 0 ] || ! mkdir -p "$TMP/small" ||
         ! mount -t tmpfs -o size=4m tmpfs "$TMP/small" 2>/dev/null; then
        echo "  skipped: mounting a small tmpfs needs root"
        continue
      fi
      MOUNTED="$TMP/small"
      kill "$CP"; wait "$CP" 2>/dev/null || true
      start_spawned small "$TMP/small/state"
      SMALL_STATE="$TMP/small/state"
      check_all "$SMALL_STATE"
      dd if=/dev/zero of="$TMP/small/filler" bs=64k 2>/dev/null || true  # until the disk is full
      cp -r "$TMP/adapters/a2d" "$TMP/adapters/more"
      out="$("$CLIENT" load --target "127.0.0.1:$PORT" --name more --path more)"
      echo "  full: $out"
      grep -q "load more: OK" <<<"$out" && fail "a load persisted on a full disk: $out"
      "$CLIENT" flood --target "127.0.0.1:$PORT" --streams 8 --max_tokens 8 --adapters a2d,a3d \
        --forbid DEADLINE_EXCEEDED,UNAVAILABLE,INTERNAL,NOT_FOUND >/dev/null ||
        fail "generation on a full disk"
      check_all "$SMALL_STATE"
      rm -f "$TMP/small/filler"
      out="$("$CLIENT" load --target "127.0.0.1:$PORT" --name more --path more)"
      echo "  space again: $out"
      grep -q "load more: OK" <<<"$out" || fail "load after the disk has space: $out"
      # Restarted, the registry has everything it acknowledged.
      kill "$CP"; wait "$CP" 2>/dev/null || true
      start_spawned small2 "$SMALL_STATE"
      w="$(spawned_workers "$SMALL_STATE")"
      "$CLIENT" check --target "127.0.0.1:$PORT" --metrics_port "$MPORT" --workers "$w" \
        --worker_secret_file "$SMALL_STATE/run/secret" --expect_adapters a2d,a3d,more ||
        fail "registry after the full disk"
      kill "$CP"; wait "$CP" 2>/dev/null || true
      umount "$TMP/small"; MOUNTED=""
      start_spawned main "$STATE"
      ;;
    restart)
      kill "$CP"; wait "$CP" 2>/dev/null || true
      mkdir -p "$TMP/rdv"
      WP=()
      for r in 0 1; do
        "$WORKER" --model "$MODEL" --adapter-root "$TMP/adapters" --enable-mixed-moe-lora-format \
          --tensor-parallel-size 2 --rank "$r" --dist-init-dir "$TMP/rdv" --dist-host 127.0.0.1 \
          --debug_step_delay_ms 20 --host 127.0.0.1 --port 0 --metrics-port 0 \
          --port-file "$TMP/w$r.json" >"$TMP/worker$r.log" 2>&1 &
        WP+=("$!")
        PIDS+=("$!")
      done
      wait_file "$TMP/w0.json"
      wait_file "$TMP/w1.json"
      WADDR="127.0.0.1:$(port_of "$TMP/w0.json"),127.0.0.1:$(port_of "$TMP/w1.json")"
      start_workers_mode() {
        rm -f "$TMP/$1.json"
        "$CONTROLLER" "${COMMON[@]}" --state-dir "$TMP/wstate" --workers "$WADDR" \
          --preload a2d=a2d,a3d=a3d --port-file "$TMP/$1.json" >"$TMP/$1.log" 2>&1 &
        CP=$!
        PIDS+=("$CP")
        wait_file "$TMP/$1.json"
        PORT="$(port_of "$TMP/$1.json")"
        MPORT="$(metrics_port_of "$TMP/$1.json")"
      }
      start_workers_mode wmode
      "$CLIENT" check --target "127.0.0.1:$PORT" --metrics_port "$MPORT" --workers "$WADDR" \
        --expect_adapters a2d,a3d || fail "--workers mode before the restart"
      background_load
      kill -9 "$CP"
      wait "$LOAD" 2>/dev/null || true  # the controller is gone: the calls end UNAVAILABLE
      echo "  in flight: $(cat "$TMP/load.out")"
      grep -q "never ended" "$TMP/load.out" && fail "calls hung on a dead controller"
      start_workers_mode wmode2
      "$CLIENT" check --target "127.0.0.1:$PORT" --metrics_port "$MPORT" --workers "$WADDR" \
        --within_s 30 --expect_adapters a2d,a3d || fail "after the controller's restart"
      "$CLIENT" flood --target "127.0.0.1:$PORT" --streams 16 --max_tokens 16 \
        --adapters a2d,a3d, --forbid DEADLINE_EXCEEDED,UNAVAILABLE,INTERNAL,NOT_FOUND ||
        fail "requests after the controller's restart"
      ;;
    *) fail "unknown scenario $SCENARIO" ;;
  esac
done
echo "chaos: ${SCENARIOS[*]}: passed"
