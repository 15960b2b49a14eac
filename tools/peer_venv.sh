#!/usr/bin/env bash
# The venv bench/peer and bench/vision_encoder run their peer in: torch, transformers, peft and
# Pillow from PyPI (CPU use only; the PyPI torch wheel is the CUDA build, about 5.6 GB installed,
# 4 minutes here). Test-only: the product never runs Python.
#   tools/peer_venv.sh [DIR]    (default .cache/peer-venv; prints the python to pass to --python)
set -euo pipefail
cd "$(dirname "$0")/.."
V="${1:-.cache/peer-venv}"
if ! "$V/bin/python" -c "import torch, transformers, peft, PIL" 2>/dev/null; then
  python3 -m venv "$V"
  "$V/bin/pip" install -q --disable-pip-version-check -r tools/requirements-peer.txt
fi
echo "$(cd "$V" && pwd)/bin/python"
