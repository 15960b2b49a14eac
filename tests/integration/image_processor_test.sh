#!/usr/bin/env bash
# Image preprocessing: moelora-image (the controller's decoding, smart_resize, Pillow resampling,
# rescale, normalisation and patch order) against transformers' Qwen2-VL image processor
# (Pillow backend) on generated PNG / JPEG / WebP images of many sizes, aspect ratios and modes,
# under three processor configs (Qwen3-VL's, small bounds that shrink most images, the class
# defaults with bilinear resampling). pixel_values must be equal bit for bit, the grids equal,
# and every image transformers refuses refused too. Usage: image_processor_test.sh
# MOELORA_IMAGE_BIN. Exit 77 (skipped) without network for pip.
set -euo pipefail
CLI="$1"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
if ! "$VENV/bin/python" -c "import PIL, transformers, safetensors, numpy, sys
sys.exit(PIL.__version__ != '12.3.0')" 2>/dev/null; then
  "$VENV/bin/pip" install -q -r "$ROOT/tools/requirements-image.txt" >/dev/null 2>&1 || {
    echo "pip install failed (no network?): skipped"; exit 77; }
fi
REF="$ROOT/tools/image_processor_reference.py"
"$VENV/bin/python" "$REF" make "$TMP/images"
IMAGES=("$TMP"/images/*.*)
status=0
for config in "$TMP"/images/configs/*; do
  name="$(basename "$config")"
  echo "== $name"
  "$VENV/bin/python" "$REF" expect "$config" "${IMAGES[@]}" --out "$TMP/expected.safetensors" \
    > "$TMP/expected.jsonl" 2>/dev/null
  "$CLI" --pixel-values-out "$TMP/ours.safetensors" "$config" "${IMAGES[@]}" > "$TMP/ours.jsonl" || true
  "$VENV/bin/python" "$REF" compare "$TMP/expected.jsonl" "$TMP/expected.safetensors" \
    "$TMP/ours.jsonl" "$TMP/ours.safetensors" || status=1
done
# moelora-image's own contract: exit 2 when an image was refused, 1 without a config.
set +e
"$CLI" "$TMP/images/configs/qwen3_vl" "$TMP/images/bad_random.bin" > /dev/null; rc=$?
[ "$rc" = 2 ] || { echo "a refused image: exit $rc, want 2"; status=1; }
"$CLI" "$TMP" "$TMP/images/rgb_1x1.png" > /dev/null 2>&1; rc=$?
[ "$rc" = 1 ] || { echo "no preprocessor_config.json: exit $rc, want 1"; status=1; }
exit $status
