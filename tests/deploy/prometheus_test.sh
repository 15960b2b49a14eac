#!/usr/bin/env bash
# A real Prometheus (Debian package) scrapes a running moelora (controller + 1 worker) on loopback,
# with deploy/prometheus/alerts.yml loaded. Asserts through Prometheus' HTTP API that every metric
# named by the alert rules and the Grafana dashboard exists, that moelora_adapter_load_seconds
# has observations after a LoadAdapter, and that every alert rule evaluates without error.
# Usage: prometheus_test.sh CONTROLLER_BIN WORKER_BIN. Exit 77 (skipped) without prometheus or
# without the Python client packages (no network for pip).
set -euo pipefail
CONTROLLER="$1"
WORKER="$2"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
command -v prometheus >/dev/null || exit 77
if ! "$VENV/bin/python" -c "import grpc_reflection" 2>/dev/null; then
  python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
  "$VENV/bin/pip" install -q grpcio grpcio-reflection protobuf >/dev/null 2>&1 || exit 77
fi
PY="$VENV/bin/python"
TMP="$(mktemp -d)"
cleanup() {
  [ -n "${PROM:-}" ] && kill "$PROM" 2>/dev/null
  [ -n "${CTL:-}" ] && kill "$CTL" 2>/dev/null
  wait 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT
# The Qwen3.5 fixture with an MTP head, drafting: the speculative-decoding panels have series.
"$CONTROLLER" --model "$ROOT/tests/data/qwen3_5_moe_mtp/model" --adapter-root "$ROOT/tests/data" \
  --state-dir "$TMP/state" --port 0 --metrics-port 0 --port-file "$TMP/port.json" \
  --worker-bin "$WORKER" --enable-mixed-moe-lora-format \
  --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}' >"$TMP/controller.log" 2>&1 &
CTL=$!
for _ in $(seq 1 300); do [ -f "$TMP/port.json" ] && [ -f "$TMP/state/run/group.1/port.0" ] && break; sleep 0.1; done
json() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
PORT="$(json "$TMP/port.json" port)"
CMETRICS="$(json "$TMP/port.json" metrics_port)"
WMETRICS="$(json "$TMP/state/run/group.1/port.0" metrics_port)"
PPORT="$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")"
cat >"$TMP/prometheus.yml" <<YML
global: {scrape_interval: 1s, evaluation_interval: 1s}
rule_files: ["$ROOT/deploy/prometheus/alerts.yml"]
scrape_configs:
  - job_name: moelora-controller
    static_configs: [{targets: ["127.0.0.1:$CMETRICS"]}]
  - job_name: moelora-worker
    static_configs: [{targets: ["127.0.0.1:$WMETRICS"]}]
YML
prometheus --config.file="$TMP/prometheus.yml" --storage.tsdb.path="$TMP/tsdb" \
  --web.listen-address="127.0.0.1:$PPORT" >"$TMP/prometheus.log" 2>&1 &
PROM=$!
CLIENT=("$PY" "$ROOT/tools/reflection_client.py" "127.0.0.1:$PORT")
for _ in $(seq 1 100); do
  if "${CLIENT[@]}" call moelora.v1.Controller/LoadAdapter '{"name": "a3d", "path": "qwen3_5_moe/adapter_3d"}' >/dev/null 2>&1; then break; fi
  sleep 0.2
done
# A refused load and a request, so the failure counter and the request families have series.
"${CLIENT[@]}" call moelora.v1.Controller/LoadAdapter '{"name": "nope", "path": "qwen3_5_moe/missing"}' >/dev/null 2>&1 || true
"${CLIENT[@]}" call moelora.v1.Controller/Generate '{"adapter": "a3d", "prompt_token_ids": [1, 2, 3], "max_tokens": 8}' >/dev/null
"$PY" - "$ROOT" "$PPORT" <<'PYEOF'
import json, re, sys, time, urllib.parse, urllib.request
root, port = sys.argv[1], sys.argv[2]
api = f"http://127.0.0.1:{port}/api/v1"
def get(path):
    with urllib.request.urlopen(api + path, timeout=5) as r:
        return json.load(r)["data"]
used = set(re.findall(r"moelora_[a-z_]+", open(f"{root}/deploy/prometheus/alerts.yml").read()))
dash = json.load(open(f"{root}/deploy/grafana/moelora.json"))
for p in dash["panels"]:
    for t in p.get("targets", []):
        used |= set(re.findall(r"moelora_[a-z_]+", t["expr"]))
deadline = time.time() + 60
missing, loads, rules = used, 0.0, []
while time.time() < deadline:
    try:
        names = set(get("/label/__name__/values"))
        missing = {n for n in used if n not in names}
        r = get("/query?query=" + urllib.parse.quote("sum(moelora_adapter_load_seconds_count)"))["result"]
        loads = float(r[0]["value"][1]) if r else 0.0
        rules = [rule for g in get("/rules")["groups"] for rule in g["rules"]]
        if not missing and loads > 0 and rules and all(x.get("lastEvaluation", "").startswith("20") for x in rules):
            break
    except Exception as e:  # Prometheus still starting
        pass
    time.sleep(0.5)
print(f"{len(used)} metric names used by rules and dashboard; missing: {sorted(missing)}")
print(f"moelora_adapter_load_seconds observations: {loads:g}")
bad = [r["name"] for r in rules if r.get("health") != "ok"]
print(f"{len(rules)} alert rules, unhealthy: {bad}")
sys.exit(0 if not missing and loads > 0 and len(rules) == 5 and not bad else 1)
PYEOF
echo "prometheus test: OK"
