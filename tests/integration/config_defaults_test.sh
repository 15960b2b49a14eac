#!/usr/bin/env bash
# The worker's config.json defaults (moelora-worker --print-config-defaults) against each
# architecture's own configuration class: transformers' classes as installed (tools/
# requirements-tokenizer.txt pins transformers 5.24.0, no torch), and for the two classes no
# package ships (the hub's Step3p5Config, vLLM's Step3TextConfig) the defaults written down below
# from their source files. Usage: config_defaults_test.sh MOELORA_WORKER_BIN. Exit 77 (skipped)
# without network for pip.
set -euo pipefail
WORKER="$1"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MOELORA_PY_VENV:-$ROOT/.cache/pyvenv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >/dev/null 2>&1 || exit 77
if ! "$VENV/bin/python" -c "import transformers" 2>/dev/null; then
  "$VENV/bin/pip" install -q -r "$ROOT/tools/requirements-tokenizer.txt" >/dev/null 2>&1 || {
    echo "pip install failed (no network?): skipped"; exit 77; }
fi
"$WORKER" --print-config-defaults > "${TMPDIR:-/tmp}/moelora_config_defaults.$$.json"
trap 'rm -f "${TMPDIR:-/tmp}/moelora_config_defaults.$$.json"' EXIT
"$VENV/bin/python" - "${TMPDIR:-/tmp}/moelora_config_defaults.$$.json" <<'PY'
import json, math, sys, warnings
warnings.filterwarnings("ignore")
import transformers as T

ours = json.load(open(sys.argv[1]))

# Classes no package ships, as their source files define them.
# stepfun-ai/Step-3.5-Flash configuration_step3p5.py (Step3p5Config.__init__ keyword defaults;
# share_expert_dims is its keyword for share_expert_dim).
STEP3P5 = dict(hidden_size=4096, intermediate_size=11264, num_attention_heads=64,
               num_attention_groups=8, num_hidden_layers=45, max_seq_len=128000, vocab_size=128815,
               rms_norm_eps=1e-5, moe_intermediate_size=1280, moe_num_experts=288, moe_top_k=8,
               rope_theta=10000, max_position_embeddings=128000, share_expert_dim=1280,
               head_dim=128, norm_expert_weight=True, sliding_window=None)
# vLLM vllm/transformers_utils/configs/step3_vl.py Step3TextConfig.
STEP3 = dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=64,
             num_attention_groups=1, num_hidden_layers=61, max_seq_len=65536, vocab_size=128815,
             rms_norm_eps=1e-5, moe_intermediate_size=5120, moe_num_experts=48, moe_top_k=3,
             rope_theta=500000, max_position_embedding=65536, share_expert_dim=5120,
             share_q_dim=2048, head_dim=256, norm_expert_weight=False,
             moe_layers_enum=list(range(4, 60)))

def from_class(cls):
    c = cls()
    def get(key):
        rp = getattr(c, "rope_parameters", None) or {}
        if key == "rope_theta":
            return rp["rope_theta"]
        if key == "partial_rotary_factor":
            return rp.get("partial_rotary_factor", 1.0)
        if key == "rope_scaling":
            return {k: v for k, v in rp.items() if k != "rope_theta"}
        if not hasattr(c, key):
            raise KeyError(f"{cls.__name__} has no attribute {key}")
        return getattr(c, key)
    return get

classes = {
    "Qwen3MoeForCausalLM": (from_class(T.Qwen3MoeConfig), None),
    "Qwen3VLMoeForConditionalGeneration": (from_class(T.Qwen3VLMoeTextConfig),
                                           from_class(T.Qwen3VLMoeConfig)),
    "Qwen3_5MoeForConditionalGeneration": (from_class(T.Qwen3_5MoeTextConfig),
                                           from_class(T.Qwen3_5MoeConfig)),
    # A text-only checkpoint: the text class is the top level.
    "Qwen3_5MoeForCausalLM": (from_class(T.Qwen3_5MoeTextConfig),
                              from_class(T.Qwen3_5MoeTextConfig)),
    "GptOssForCausalLM": (from_class(T.GptOssConfig), None),
    "Step3p5ForCausalLM": (STEP3P5.__getitem__, None),
    "Step3TextForCausalLM": (STEP3.__getitem__, None),
}

def same(a, b):
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b

bad, checked = [], 0
assert set(ours) == set(classes), f"architectures differ: {sorted(set(ours) ^ set(classes))}"
for arch, entry in ours.items():
    text, top = classes[arch]
    for key, value in entry["defaults"].items():
        if key == "@top":
            for k, v in value.items():
                checked += 1
                if not same(v, top(k)):
                    bad.append(f"{arch} (top level) {k}: ours {v!r}, class {top(k)!r}")
            continue
        checked += 1
        try:
            theirs = text(key)
        except KeyError as e:
            bad.append(f"{arch} {key}: {e}")
            continue
        if not same(value, theirs):
            bad.append(f"{arch} {key}: ours {value!r}, class {theirs!r}")
print(f"{checked} defaults checked against transformers {T.__version__} and the hub/vLLM classes")
if bad:
    print("\n".join(bad))
    sys.exit(1)
PY
