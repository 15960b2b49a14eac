#!/usr/bin/env bash
# deploy/ checked by real tools: promtool (Debian package prometheus) on the scrape config and the
# alert rules, then check_deploy.py (Kubernetes schemas through PyPI kubernetes-validate, offline;
# Dockerfile rules; flags, ports and probes against the built binaries; metric names).
# Usage: check_deploy.sh CONTROLLER_BIN WORKER_BIN. Exit 77 (skipped) when promtool or the Python
# packages are unavailable.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
command -v promtool >/dev/null || exit 77
if ! "$VENV/bin/python" -c "import kubernetes_validate, yaml" 2>/dev/null; then
  python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
  "$VENV/bin/pip" install -q kubernetes-validate pyyaml >/dev/null 2>&1 || exit 77
fi
promtool check config "$ROOT/deploy/prometheus/prometheus.yml"
promtool check rules "$ROOT/deploy/prometheus/alerts.yml"
"$VENV/bin/python" "$ROOT/tests/deploy/check_deploy.py" "$ROOT" "$1" "$2"
