"""A gpt-oss checkpoint at a release's real size with random weights, stored as OpenAI stores it
(experts as MXFP4 `*_blocks` / `*_scales`, everything else bf16, one shard per layer): for
benchmarks that need the real shapes and bytes (bench/gpt_oss_20b.sh), never for numerics.

  synthetic_gpt_oss.py OUT [--config tests/data/release_configs/gpt-oss-20b.json] [--layers N]

--layers N keeps the first N layers (a quick check of the pipeline). Weights: N(0, 0.02) for the
dense ones, uniform random E2M1 codes with E8M0 scales 2^-8 .. 2^-5 for the experts (values of
the same order), biases and sinks small. Needs torch and safetensors (the peer venv).
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--config", default="tests/data/release_configs/gpt-oss-20b.json")
    ap.add_argument("--layers", type=int, default=0)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
        cfg["layer_types"] = cfg["layer_types"][:args.layers]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    h, inter, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    heads, kv, d, vocab = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                           cfg["vocab_size"])
    g = torch.Generator().manual_seed(7)
    dense = lambda *shape: (torch.empty(*shape).normal_(0, 0.02, generator=g)).to(torch.bfloat16)
    small = lambda *shape: (torch.empty(*shape).normal_(0, 0.1, generator=g)).to(torch.bfloat16)

    def mxfp4(rows, cols):
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(119, 123, (e, rows, cols // 32), dtype=torch.uint8, generator=g)
        return blocks, scales

    weight_map, n = {}, cfg["num_hidden_layers"]
    shards = [f"model-{i:05d}-of-{n + 1:05d}.safetensors" for i in range(n + 1)]
    for layer in range(n):
        p = f"model.layers.{layer}."
        t = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": dense(heads * d, h), p + "self_attn.q_proj.bias": small(heads * d),
             p + "self_attn.k_proj.weight": dense(kv * d, h), p + "self_attn.k_proj.bias": small(kv * d),
             p + "self_attn.v_proj.weight": dense(kv * d, h), p + "self_attn.v_proj.bias": small(kv * d),
             p + "self_attn.o_proj.weight": dense(h, heads * d), p + "self_attn.o_proj.bias": small(h),
             p + "self_attn.sinks": small(heads),
             p + "mlp.router.weight": dense(e, h), p + "mlp.router.bias": small(e),
             p + "mlp.experts.gate_up_proj_bias": small(e, 2 * inter),
             p + "mlp.experts.down_proj_bias": small(e, h)}
        t[p + "mlp.experts.gate_up_proj_blocks"], t[p + "mlp.experts.gate_up_proj_scales"] = mxfp4(2 * inter, h)
        t[p + "mlp.experts.down_proj_blocks"], t[p + "mlp.experts.down_proj_scales"] = mxfp4(h, inter)
        save_file(t, os.path.join(args.out, shards[layer]), metadata={"format": "pt"})
        weight_map.update({k: shards[layer] for k in t})
        print(f"layer {layer + 1}/{n}", flush=True)
    t = {"model.embed_tokens.weight": dense(vocab, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
         "lm_head.weight": dense(vocab, h)}
    save_file(t, os.path.join(args.out, shards[n]), metadata={"format": "pt"})
    weight_map.update({k: shards[n] for k in t})
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


if __name__ == "__main__":
    main()
