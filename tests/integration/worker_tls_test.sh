#!/usr/bin/env bash
# Mutual TLS between the controller and a worker (--workers mode), certificates made here by
# openssl: a worker with --tls-cert-file/--tls-key-file/--tls-ca-file serves only a controller
# that trusts its CA and presents a certificate that CA signed. A plaintext controller, one
# without a client certificate and one whose certificate another CA signed never serve; the one
# with the right files serves both adapter layouts. Half-given flags are refused at startup.
# Usage: worker_tls_test.sh CONTROLLER WORKER CHAOS_CLIENT. Exit 77 (skipped) without openssl.
set -euo pipefail
CONTROLLER="$1"
WORKER="$2"
CLIENT="$3"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
command -v openssl >/dev/null || exit 77
TMP="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$TMP"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -15 "$f"; }; done
  exit 1
}
port_of() { sed -E 's/.*"port": *([0-9]+).*/\1/' "$1"; }
wait_file() {
  for _ in $(seq 1 300); do [ -s "$1" ] && return 0; sleep 0.1; done
  fail "no $1"
}

# ca NAME: a CA; cert CA NAME CN [SAN]: a certificate that CA signs.
ca() {
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=$1" -keyout "$TMP/$1.key" \
    -out "$TMP/$1.pem" 2>/dev/null
}
cert() {
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$3" -keyout "$TMP/$2.key" -out "$TMP/$2.csr" \
    2>/dev/null
  printf "%s\n" "${4:-subjectAltName=DNS:$3}" >"$TMP/$2.ext"
  openssl x509 -req -in "$TMP/$2.csr" -CA "$TMP/$1.pem" -CAkey "$TMP/$1.key" -CAcreateserial \
    -days 2 -extfile "$TMP/$2.ext" -out "$TMP/$2.pem" 2>/dev/null
}
ca cluster-ca
ca other-ca
cert cluster-ca worker moelora-worker "subjectAltName=DNS:localhost,IP:127.0.0.1"
cert cluster-ca controller moelora-controller
cert other-ca intruder moelora-controller

# Half-given flags: refused at startup, naming the flag.
out="$("$WORKER" --model "$ROOT/tests/data/qwen3_moe/model" --tls-ca-file "$TMP/cluster-ca.pem" \
  --port 0 2>&1 || true)"
grep -q -- "--tls-ca-file needs --tls-cert-file and --tls-key-file" <<<"$out" ||
  fail "worker with --tls-ca-file alone: $out"
out="$("$CONTROLLER" --model "$ROOT/tests/data/qwen3_moe/model" --workers 127.0.0.1:1 \
  --worker-tls-cert-file "$TMP/controller.pem" --port 0 --metrics-port 0 2>&1 || true)"
grep -q -- "--worker-tls-cert-file and --worker-tls-key-file go together" <<<"$out" ||
  fail "controller with --worker-tls-cert-file alone: $out"

"$WORKER" --model "$ROOT/tests/data/qwen3_moe/model" --adapter-root "$ROOT/tests/data" \
  --enable-mixed-moe-lora-format --tls-cert-file "$TMP/worker.pem" --tls-key-file "$TMP/worker.key" \
  --tls-ca-file "$TMP/cluster-ca.pem" --host 127.0.0.1 --port 0 --metrics-port 0 \
  --health-port 0 --port-file "$TMP/worker.json" >"$TMP/worker.log" 2>&1 &
PIDS+=("$!")
wait_file "$TMP/worker.json"
W="127.0.0.1:$(port_of "$TMP/worker.json")"
# The plaintext health port (the kubelet's probe) says SERVING once the model is loaded.
HP="$(sed -nE 's/.*health \(plaintext\) on port ([0-9]+).*/\1/p' "$TMP/worker.log")"
[ -n "$HP" ] || fail "no health port in the worker's log"
"$CLIENT" check --target "127.0.0.1:$HP" --within_s 30 >/dev/null || fail "health port"
echo "worker health port: SERVING in plaintext"

# controller NAME FLAGS...: starts one against the worker; sets PORT and CPID.
controller() {
  local name="$1"
  shift
  "$CONTROLLER" --model "$ROOT/tests/data/qwen3_moe/model" --adapter-root "$ROOT/tests/data" \
    --state-dir "$TMP/state-$name" --enable-mixed-moe-lora-format --workers "$W" \
    --preload a2d=qwen3_moe/adapter_2d,a3d=qwen3_moe/adapter_3d --port 0 --metrics-port 0 \
    --port-file "$TMP/$name.json" "$@" >"$TMP/$name.log" 2>&1 &
  CPID=$!
  PIDS+=("$CPID")
  wait_file "$TMP/$name.json"
  PORT="$(port_of "$TMP/$name.json")"
}
never_serves() {  # never_serves NAME FLAGS...
  local name="$1"
  controller "$@"
  if "$CLIENT" check --target "127.0.0.1:$PORT" --within_s 4 >/dev/null; then
    fail "$name: served a worker that asks for mutual TLS"
  fi
  kill "$CPID"
  echo "$name: never serves"
}
never_serves plaintext
never_serves no-client-cert --worker-tls-ca-file "$TMP/cluster-ca.pem"
never_serves other-ca --worker-tls-ca-file "$TMP/cluster-ca.pem" \
  --worker-tls-cert-file "$TMP/intruder.pem" --worker-tls-key-file "$TMP/intruder.key"
controller mtls --worker-tls-ca-file "$TMP/cluster-ca.pem" \
  --worker-tls-cert-file "$TMP/controller.pem" --worker-tls-key-file "$TMP/controller.key"
"$CLIENT" check --target "127.0.0.1:$PORT" --within_s 30 --expect_adapters a2d,a3d ||
  fail "mutual TLS: not serving"
"$CLIENT" flood --target "127.0.0.1:$PORT" --streams 6 --max_tokens 8 --adapters a2d,a3d, \
  --forbid DEADLINE_EXCEEDED,UNAVAILABLE,INTERNAL,NOT_FOUND,CANCELLED || fail "mutual TLS: generate"
echo "mutual TLS: serving"
