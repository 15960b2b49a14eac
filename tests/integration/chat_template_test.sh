#!/usr/bin/env bash
# Chat templates: moelora-tokenizer chat (the controller's Jinja engine) against transformers'
# apply_chat_template on the real Qwen3, Qwen3.5, Step-3.5-Flash and GPT-OSS templates (llama.cpp
# keeps copies under models/templates in the PyPI llama-cpp-python sdist: fetched here, never
# committed) over a corpus of conversations and flags, and on short templates that exercise the
# Jinja features one by one (tools/chat_template_reference.py). Every prompt must be
# byte-identical; where transformers raises, moelora must refuse too, with raise_exception's
# message. Usage: chat_template_test.sh MOELORA_TOKENIZER_BIN. Exit 77 (skipped) without network
# for pip.
set -euo pipefail
CLI="$1"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
VERSION=0.3.36  # tools/llama_cpp_peer.sh's
LLAMA="${LLAMA_CPP_DIR:-$ROOT/.cache/llama-cpp}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
if ! "$VENV/bin/python" -c "import transformers, tokenizers, jinja2" 2>/dev/null; then
  "$VENV/bin/pip" install -q -r "$ROOT/tools/requirements-tokenizer.txt" >/dev/null 2>&1 || {
    echo "pip install failed (no network?): skipped"; exit 77; }
fi
TEMPLATES="$LLAMA/llama_cpp_python-$VERSION/vendor/llama.cpp/models/templates"
if [ ! -d "$TEMPLATES" ]; then
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$TMP" >/dev/null 2>&1 || { echo "pip download failed: skipped"; exit 77; }
  tar xzf "$TMP/llama_cpp_python-$VERSION.tar.gz" -C "$TMP" --wildcards '*/models/templates/*'
  TEMPLATES="$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp/models/templates"
fi
# The tiny model's tokenizer and chat template, with a BOS token so that templates printing
# bos_token show it.
mkdir -p "$TMP/model"
cp "$ROOT/tests/data/qwen3_moe/model/tokenizer.json" "$ROOT/tests/data/qwen3_moe/model/chat_template.jinja" \
  "$TMP/model/"
"$VENV/bin/python" - "$ROOT/tests/data/qwen3_moe/model/tokenizer_config.json" "$TMP/model" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["bos_token"] = "<|endoftext|>"
json.dump(config, open(f"{sys.argv[2]}/tokenizer_config.json", "w"))
PY
"$VENV/bin/python" "$ROOT/tools/chat_template_reference.py" "$TEMPLATES" "$TMP/model" "$TMP" 2>&1 \
  | grep -v 'PyTorch was not found'
"$CLI" chat "$TMP/model" <"$TMP/cases.jsonl" >"$TMP/got.jsonl"
"$VENV/bin/python" - "$TMP" <<'PY'
import json, sys
d = sys.argv[1]
load = lambda n: [json.loads(l) for l in open(f"{d}/{n}", encoding="utf-8")]
cases, expected, got = load("cases.jsonl"), load("expected.jsonl"), load("got.jsonl")
assert len(got) == len(cases), f"{len(got)} answers for {len(cases)} cases"
bad = []
for case, e, g in zip(cases, expected, got):
    if isinstance(e, dict):
        # transformers raised: moelora must refuse too; a template's own message must come through.
        ok = isinstance(g, dict) and (not e["error"].startswith("TemplateError: ")
                                      or e["error"][len("TemplateError: "):] in g["error"])
    else:
        ok = e == g
    if not ok:
        bad.append(case["id"])
        if len(bad) <= 5:
            if isinstance(e, str) and isinstance(g, str):
                i = next((k for k in range(min(len(e), len(g))) if e[k] != g[k]), min(len(e), len(g)))
                print(f"{case['id']}: differs at {i}:\n  transformers {e[max(0, i - 80):i + 80]!r}\n"
                      f"  moelora      {g[max(0, i - 80):i + 80]!r}")
            else:
                print(f"{case['id']}:\n  transformers {str(e)[:300]!r}\n  moelora      {str(g)[:300]!r}")
errors = sum(isinstance(e, dict) for e in expected)
templates = sorted({c["id"].split("/")[0] for c in cases} - {"snippet"})
print(f"{len(cases)} cases ({', '.join(templates)} and snippets; {errors} refused by both): "
      f"{len(cases) - len(bad)} identical")
sys.exit(1 if bad else 0)
PY
echo "chat templates: OK"
