#!/usr/bin/env python3
"""The transformers + PEFT side of bench/peer (the product never runs this).

  peer_bench.py make --out DIR [--layers N]
      writes DIR/model (a medium Qwen3-MoE by transformers: H=1024, 32 experts top-4, expert
      intermediate 512, 16/4 heads of 64, vocab 4096, f32), DIR/adapter_2d (per-expert, rank 16,
      attention + experts), DIR/adapter_3d (written by PEFT: target_parameters on the fused experts,
      rank 16) and DIR/prompts.json (32 prompts of 16 token ids, seeded).
  peer_bench.py run --dir DIR --dtype float32|bfloat16 --batches 1,8,32 --new-tokens N
                    --threads T --out FILE [--cases base,mixed]
      greedy generate() for each case and batch on `threads` intra-op threads; writes FILE (JSON):
      {"cases": {"base/8": {"tok_s":..., "seconds":..., "prefill_tok_s":..., "outputs": [[ids]..]}}}
      The mixed case: half the batch on adapter_2d, half on adapter_3d. PEFT cannot put both in
      one batch (the 3D adapter wraps parameters, and adapter_names= covers LoRA layers only), so
      it runs one generate() per adapter, one after the other, as a PEFT user must.

Set up by tools/peer_venv.sh (torch, transformers, peft in a venv).
"""
import argparse
import json
import os
import time

import torch
from safetensors.torch import save_file

from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

H, I, E, TOPK, HEADS, KV, HD, VOCAB, RANK = 1024, 512, 32, 4, 16, 4, 64, 4096, 16
PROMPTS, PROMPT_LEN = 32, 16


def make(out, layers):
    mdir = os.path.join(out, "model")
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=2048,
                         moe_intermediate_size=I, num_hidden_layers=layers, num_attention_heads=HEADS,
                         num_key_value_heads=KV, head_dim=HD, num_experts=E, num_experts_per_tok=TOPK,
                         max_position_embeddings=4096, decoder_sparse_step=1, mlp_only_layers=[],
                         norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).eval().save_pretrained(mdir)
    # 3D adapter by PEFT itself (random B too: init_lora_weights=False), small scaling.
    torch.manual_seed(1)
    base = Qwen3MoeForCausalLM.from_pretrained(mdir, dtype=torch.float32)
    lc = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                    init_lora_weights=False)
    get_peft_model(base, lc).save_pretrained(os.path.join(out, "adapter_3d"))
    # 2D adapter (docs/formats.md §2: per-expert modules), random A and B of std 0.02.
    g = torch.Generator().manual_seed(2)
    sd = {}
    for layer in range(layers):
        p = f"base_model.model.model.layers.{layer}"
        mods = {f"self_attn.{m}": s for m, s in (("q_proj", (HEADS * HD, H)), ("k_proj", (KV * HD, H)),
                                                 ("v_proj", (KV * HD, H)), ("o_proj", (H, HEADS * HD)))}
        for e in range(E):
            mods.update({f"mlp.experts.{e}.gate_proj": (I, H), f"mlp.experts.{e}.up_proj": (I, H),
                         f"mlp.experts.{e}.down_proj": (H, I)})
        for m, (o, i) in mods.items():
            sd[f"{p}.{m}.lora_A.weight"] = torch.randn(RANK, i, generator=g) * 0.02
            sd[f"{p}.{m}.lora_B.weight"] = torch.randn(o, RANK, generator=g) * 0.02
    a2d = os.path.join(out, "adapter_2d")
    os.makedirs(a2d, exist_ok=True)
    save_file(sd, os.path.join(a2d, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a2d, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": RANK,
                   "use_rslora": False, "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False,
                   "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                      "down_proj"], "base_model_name_or_path": mdir}, f, indent=2)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(16, VOCAB, (PROMPTS, PROMPT_LEN), generator=g).tolist()
    with open(os.path.join(out, "prompts.json"), "w") as f:
        json.dump(prompts, f)


def timed_generate(model, ids, new_tokens):
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        dt = time.perf_counter() - t0
    return out[:, ids.shape[1]:].tolist(), dt


def timed_prefill(model, ids, repeat):
    with torch.no_grad():
        model(input_ids=ids)  # warm
        best = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            model(input_ids=ids)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        return best


def run(args):
    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    prompts = json.load(open(os.path.join(args.dir, "prompts.json")))
    mdir = os.path.join(args.dir, "model")
    batches = [int(b) for b in args.batches.split(",")]
    cases = args.cases.split(",")
    result = {"torch": torch.__version__, "threads": args.threads, "dtype": args.dtype, "cases": {}}
    warm = torch.tensor([prompts[0]])
    if "base" in cases:
        model = Qwen3MoeForCausalLM.from_pretrained(mdir, dtype=dtype).eval()
        timed_generate(model, warm, 2)
        for b in batches:
            ids = torch.tensor(prompts[:b])
            # The fastest of --repeat generate calls (the outputs are the same each time).
            outs, dt = timed_generate(model, ids, args.new_tokens)
            for _ in range(args.repeat - 1):
                dt = min(dt, timed_generate(model, ids, args.new_tokens)[1])
            pf = timed_prefill(model, ids, args.repeat)
            result["cases"][f"base/{b}"] = {"seconds": dt, "tok_s": b * args.new_tokens / dt,
                                            "prefill_tok_s": b * ids.shape[1] / pf, "outputs": outs}
        del model
    if "mixed" in cases:
        models = {}
        for name in ("adapter_2d", "adapter_3d"):
            base = Qwen3MoeForCausalLM.from_pretrained(mdir, dtype=dtype)
            models[name] = PeftModel.from_pretrained(base, os.path.join(args.dir, name)).eval()
            timed_generate(models[name], warm, 2)
        for b in batches:
            # Rows alternate 2D, 3D (row i: adapter_2d when i is even), as bench/peer sends them.
            outs, total = [None] * b, 0.0
            for parity, name in ((0, "adapter_2d"), (1, "adapter_3d")):
                rows = [i for i in range(b) if i % 2 == parity]
                if not rows:
                    continue
                o, dt = timed_generate(models[name], torch.tensor([prompts[i] for i in rows]),
                                       args.new_tokens)
                total += dt
                for i, seq in zip(rows, o):
                    outs[i] = seq
            result["cases"][f"mixed/{b}"] = {"seconds": total, "tok_s": b * args.new_tokens / total,
                                             "outputs": outs}
    with open(args.out, "w") as f:
        json.dump(result, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, default=4)
    r = sub.add_parser("run")
    r.add_argument("--dir", required=True)
    r.add_argument("--dtype", default="float32")
    r.add_argument("--batches", default="1,8,32")
    r.add_argument("--new-tokens", type=int, default=32)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--cases", default="base,mixed")
    r.add_argument("--repeat", type=int, default=1)
    r.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "make":
        make(args.out, args.layers)
    else:
        run(args)


if __name__ == "__main__":
    main()
