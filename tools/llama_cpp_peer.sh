#!/usr/bin/env bash
# llama.cpp as a peer for bench/long_context: built from the source vendored in the PyPI
# `llama-cpp-python` sdist (pinned below), in a cached directory, and a model converted to GGUF by
# llama.cpp's own convert_hf_to_gguf.py. Test-only: the product never runs llama.cpp or Python.
#   tools/llama_cpp_peer.sh build [DIR]             builds llama-bench, llama-batched-bench and
#                                                   tools/llama_greedy.cc; prints llama-bench's path
#                                                   (the others lie beside it)
#   tools/llama_cpp_peer.sh convert MODEL OUT TYPE  writes OUT (.gguf, TYPE f32|bf16); prints it
# DIR defaults to .cache/llama-cpp. Needs cmake and a C++ compiler; convert needs the peer venv
# (tools/peer_venv.sh: torch, transformers, numpy).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
D="${LLAMA_CPP_DIR:-.cache/llama-cpp}"
SRC="$D/llama_cpp_python-$VERSION/vendor/llama.cpp"
fetch() {
  if [ ! -d "$SRC" ]; then
    mkdir -p "$D"
    PY="$(bash tools/peer_venv.sh)"
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
      "llama-cpp-python==$VERSION" -d "$D" >&2
    tar xzf "$D/llama_cpp_python-$VERSION.tar.gz" -C "$D"
  fi
}
case "${1:-}" in
  build)
    [ -n "${2:-}" ] && D="$2" && SRC="$D/llama_cpp_python-$VERSION/vendor/llama.cpp"
    fetch
    if [ ! -x "$D/build/bin/llama-bench" ]; then
      # Native build (the peer uses every instruction set this CPU has, as a user's would).
      cmake -S "$SRC" -B "$D/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON >&2
      cmake --build "$D/build" -j"$(nproc)" --target llama-bench >&2
    fi
    if [ ! -x "$D/build/bin/llama-batched-bench" ]; then
      cmake --build "$D/build" -j"$(nproc)" --target llama-batched-bench >&2
    fi
    if [ ! -x "$D/build/bin/llama_greedy" ] || [ tools/llama_greedy.cc -nt "$D/build/bin/llama_greedy" ]; then
      BIN="$(cd "$D/build/bin" && pwd)"
      c++ -O2 -std=c++17 tools/llama_greedy.cc -I"$SRC/include" -I"$SRC/ggml/include" \
        -L"$BIN" -lllama -lggml -lggml-base -Wl,-rpath,"$BIN" -o "$D/build/bin/llama_greedy" >&2
    fi
    echo "$(cd "$D/build/bin" && pwd)/llama-bench"
    ;;
  convert)
    fetch
    MODEL="$2" OUT="$3" TYPE="${4:-bf16}"
    PY="$(bash tools/peer_venv.sh)"
    # Our bench models carry no tokenizer (llama-bench feeds token ids): the converter is told the
    # Qwen2 pre-tokenizer instead of identifying one from tokenizer files, and gets a byte-level
    # vocabulary of the model's size.
    PYTHONPATH="$SRC/gguf-py:$SRC" "$PY" - "$MODEL" "$OUT" "$TYPE" <<'PYEOF' >&2
import sys
import convert_hf_to_gguf as c
import gguf
model, out, outtype = sys.argv[1:4]

def byte_chars():
    # GPT-2's byte-level alphabet: every byte as one printable character.
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]

def vocab(self):
    n = self.hparams["vocab_size"]
    tokens = byte_chars() + [f"<t{i}>" for i in range(256, n)]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("qwen2")
    self.gguf_writer.add_token_list(tokens[:n])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_token_merges([tokens[71] + " " + tokens[72]])
    self.gguf_writer.add_bos_token_id(0)
    self.gguf_writer.add_eos_token_id(1)

from conversion.base import TextModel
find = c.get_model_class

def model_class(name, mmproj=False):
    cls = find(name, mmproj)
    for k in cls.__mro__:
        if "set_vocab" in k.__dict__ and issubclass(k, TextModel):
            k.set_vocab = vocab
    return cls

c.get_model_class = model_class
sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype]
c.main()
PYEOF
    echo "$OUT"
    ;;
  *)
    sed -n 2,8p "$0"
    exit 2
    ;;
esac
