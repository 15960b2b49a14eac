#!/usr/bin/env python3
"""An independent reference for Step3 text (Step3TextForCausalLM), and its fixture.

transformers has no class for Step3 (its modeling code is remote code on the Hub, which cannot
be reached here; docs/models.md §1), so this file is the reference: a plain torch forward written
from docs/models.md §5 (vLLM's step3_text.py semantics), not from moelora's C++:

  h += o_proj(attn(rope(wq(inter_norm(q_proj(x)))), rope(k_proj(x)), v_proj(x)))   x = norm(h)
      MQA: every query head attends to the one KV head; neox RoPE over the whole head_dim
  h += mlp(norm(h))                   layers outside moe_layers_enum: SwiGLU
  h += moe(norm(h)) + share(norm(h))  softmax over all experts, top-k, renormalised iff
                                      norm_expert_weight; the ungated shared expert
  logits = lm_head(norm(h))           plain RMSNorm everywhere

LoRA is applied by merging W += scaling · B · A into the base weights (per expert for the 2D
layout; for the 3D layout through PEFT's own einsum of docs/formats.md §3), so the reference
shares nothing with the engine's batched LoRA.

Run by hand (needs torch and safetensors):

    /opt/fixvenv/bin/python tools/step3_reference.py --out tests/data

writes tests/data/step3/{model, adapter_2d, adapter_3d, expected_logits.safetensors}.
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

H, VOCAB, LAYERS = 24, 96, 3
HEADS, HD, SHARE_Q = 4, 8, 12       # query heads, head_dim, the shared low-rank query's size
E, TOPK, I, SHARE_I, DENSE_I = 4, 2, 10, 12, 16
CONFIG = dict(
    architectures=["Step3TextForCausalLM"], model_type="step3_text", hidden_size=H,
    intermediate_size=DENSE_I, num_attention_heads=HEADS, num_attention_groups=1, head_dim=HD,
    share_q_dim=SHARE_Q, num_hidden_layers=LAYERS, vocab_size=VOCAB, rms_norm_eps=1e-5,
    moe_num_experts=E, moe_top_k=TOPK, moe_intermediate_size=I, share_expert_dim=SHARE_I,
    norm_expert_weight=True, moe_layers_enum="1,2", rope_theta=50000.0,
    max_position_embedding=256, tie_word_embeddings=False)
PROMPTS = [[1, 17, 42, 5, 88, 13, 70, 2, 9, 33, 61, 4], [3, 9, 27, 81, 50, 11, 60], [7, 2, 95]]


def rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x, pos, theta):
    """Neox pairs (i, i + d/2) over the whole head. x [T, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :], torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


def swiglu(x, g, u, d):
    return (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T


def forward(w, ids, cfg=CONFIG):
    """w: parameter name -> tensor (the hub checkpoint's names). Logits [T, V]."""
    eps, n = cfg["rms_norm_eps"], cfg["num_hidden_layers"]
    moe_layers = {int(i) for i in cfg["moe_layers_enum"].split(",")}
    T = len(ids)
    pos = torch.arange(T)
    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    mask = torch.full((T, T), float("-inf"), dtype=h.dtype).triu(1)
    for l in range(n):
        p = f"model.layers.{l}."
        x = rms(h, w[p + "input_layernorm.weight"], eps)
        a = p + "self_attn."
        q_lat = rms(x @ w[a + "q_proj.weight"].T, w[a + "inter_norm.weight"], eps)
        q = (q_lat @ w[a + "wq.weight"].T).view(T, HEADS, HD)
        k = (x @ w[a + "k_proj.weight"].T).view(T, 1, HD)
        v = (x @ w[a + "v_proj.weight"].T).view(T, 1, HD)
        q, k = rope(q, pos, cfg["rope_theta"]), rope(k, pos, cfg["rope_theta"])
        s = torch.einsum("qhd,khd->hqk", q, k.expand(T, HEADS, HD)) * HD ** -0.5 + mask
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v.expand(T, HEADS, HD)).reshape(T, HEADS * HD)
        h = h + o @ w[a + "o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"], eps)
        if l not in moe_layers:
            m = p + "mlp."
            h = h + swiglu(x, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
            continue
        probs = (x @ w[p + "moe.gate.weight"].T).float().softmax(-1)
        top, idx = probs.topk(TOPK, -1)
        if cfg["norm_expert_weight"]:
            top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for t in range(T):
            for j in range(TOPK):
                e = int(idx[t, j])
                y = swiglu(x[t:t + 1], w[p + "moe.gate_proj.weight"][e], w[p + "moe.up_proj.weight"][e],
                           w[p + "moe.down_proj.weight"][e])
                out[t] += top[t, j] * y[0]
        se = p + "share_expert."
        h = h + out + swiglu(x, w[se + "gate_proj.weight"], w[se + "up_proj.weight"], w[se + "down_proj.weight"])
    return rms(h, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


def merge(w, adapter_dir):
    """The base weights with an adapter merged (W += s·B·A); 2D per expert, 3D by PEFT's einsum."""
    w = {k: v.clone() for k, v in w.items()}
    sd = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    cfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    s = cfg["lora_alpha"] / cfg["r"]
    for k, a in sd.items():
        if not k.endswith(".lora_A.weight"):
            continue
        b = sd[k.replace(".lora_A.", ".lora_B.")]
        mod = k[len("base_model.model."):-len(".lora_A.weight")]
        if mod.endswith(".moe.experts.base_layer"):  # 3D gate_up: [E*r, H], [2I, r*E]
            layer = mod[:-len(".experts.base_layer")]
            delta = torch.einsum("ore,eri->eoi", b.reshape(2 * I, -1, E), a.reshape(E, -1, H)) * s
            w[layer + ".gate_proj.weight"] += delta[:, :I]
            w[layer + ".up_proj.weight"] += delta[:, I:]
        elif mod.endswith(".moe.experts"):  # 3D down: [E*r, I], [H, r*E]
            layer = mod[:-len(".experts")]
            w[layer + ".down_proj.weight"] += torch.einsum(
                "ore,eri->eoi", b.reshape(H, -1, E), a.reshape(E, -1, I)) * s
        elif ".moe.experts." in mod:  # 2D: moe.experts.<e>.<proj>
            head, e, proj = mod.rsplit(".", 2)
            w[head.replace(".experts", "") + "." + proj + ".weight"][int(e)] += s * (b @ a)
        else:
            w[mod + ".weight"] += s * (b @ a)
    return w


def write_adapter(path, tensors, r, alpha, targets, base):
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": False, "bias": "none",
                   "target_modules": targets, "base_model_name_or_path": base, "task_type": "CAUSAL_LM",
                   "lora_dropout": 0.0, "modules_to_save": None, "use_dora": False,
                   "fan_in_fan_out": False}, f, indent=2, sort_keys=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data")
    args = ap.parse_args()
    root = os.path.join(args.out, "step3")
    shutil.rmtree(root, ignore_errors=True)
    g = torch.Generator().manual_seed(3)
    rnd = lambda *shape, scale=0.3: torch.randn(*shape, generator=g) * scale
    w = {"model.embed_tokens.weight": rnd(VOCAB, H, scale=1.0), "model.norm.weight": 1 + rnd(H, scale=0.2),
         "lm_head.weight": rnd(VOCAB, H)}
    for l in range(LAYERS):
        p = f"model.layers.{l}."
        a = p + "self_attn."
        w.update({p + "input_layernorm.weight": 1 + rnd(H, scale=0.2),
                  p + "post_attention_layernorm.weight": 1 + rnd(H, scale=0.2),
                  a + "q_proj.weight": rnd(SHARE_Q, H), a + "inter_norm.weight": 1 + rnd(SHARE_Q, scale=0.2),
                  a + "wq.weight": rnd(HEADS * HD, SHARE_Q), a + "k_proj.weight": rnd(HD, H),
                  a + "v_proj.weight": rnd(HD, H), a + "o_proj.weight": rnd(H, HEADS * HD)})
        if l == 0:
            w.update({p + "mlp.gate_proj.weight": rnd(DENSE_I, H), p + "mlp.up_proj.weight": rnd(DENSE_I, H),
                      p + "mlp.down_proj.weight": rnd(H, DENSE_I)})
        else:
            w.update({p + "moe.gate.weight": rnd(E, H, scale=0.5), p + "moe.gate_proj.weight": rnd(E, I, H),
                      p + "moe.up_proj.weight": rnd(E, I, H), p + "moe.down_proj.weight": rnd(E, H, I),
                      p + "share_expert.gate_proj.weight": rnd(SHARE_I, H),
                      p + "share_expert.up_proj.weight": rnd(SHARE_I, H),
                      p + "share_expert.down_proj.weight": rnd(H, SHARE_I)})
    mdir = os.path.join(root, "model")
    os.makedirs(mdir)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(mdir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    # 2D adapter: every linear module (q_proj, wq, k/v/o, the dense MLP, the shared expert) and
    # the experts one by one, in the checkpoint's module names.
    r2, sd2 = 3, {}
    for l in range(LAYERS):
        p = f"base_model.model.model.layers.{l}."
        mods = {"self_attn.q_proj": (SHARE_Q, H), "self_attn.wq": (HEADS * HD, SHARE_Q),
                "self_attn.k_proj": (HD, H), "self_attn.v_proj": (HD, H), "self_attn.o_proj": (H, HEADS * HD)}
        if l == 0:
            mods.update({"mlp.gate_proj": (DENSE_I, H), "mlp.down_proj": (H, DENSE_I)})
        else:
            mods.update({"share_expert.up_proj": (SHARE_I, H), "share_expert.down_proj": (H, SHARE_I)})
            for e in range(E):
                for proj, (o, i) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                    mods[f"moe.experts.{e}.{proj}"] = (o, i)
        for m, (o, i) in mods.items():
            sd2[p + m + ".lora_A.weight"] = rnd(r2, i)
            sd2[p + m + ".lora_B.weight"] = rnd(o, r2)
    write_adapter(os.path.join(root, "adapter_2d"), sd2, r2, 6,
                  ["q_proj", "wq", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], mdir)
    # 3D adapter (PEFT's target_parameters layout) on the experts, plus wq and o_proj.
    r3, sd3 = 2, {}
    for l in range(1, LAYERS):
        p = f"base_model.model.model.layers.{l}."
        sd3[p + "moe.experts.base_layer.lora_A.weight"] = rnd(E * r3, H)
        sd3[p + "moe.experts.base_layer.lora_B.weight"] = rnd(2 * I, r3 * E)
        sd3[p + "moe.experts.lora_A.weight"] = rnd(E * r3, I)
        sd3[p + "moe.experts.lora_B.weight"] = rnd(H, r3 * E)
    for l in range(LAYERS):
        p = f"base_model.model.model.layers.{l}.self_attn."
        sd3[p + "wq.lora_A.weight"] = rnd(r3, SHARE_Q)
        sd3[p + "wq.lora_B.weight"] = rnd(HEADS * HD, r3)
        sd3[p + "o_proj.lora_A.weight"] = rnd(r3, HEADS * HD)
        sd3[p + "o_proj.lora_B.weight"] = rnd(H, r3)
    write_adapter(os.path.join(root, "adapter_3d"), sd3, r3, 4, ["wq", "o_proj"], mdir)

    res = {f"prompt.{k}": torch.tensor(p, dtype=torch.int32) for k, p in enumerate(PROMPTS)}
    variants = {"base": w, "adapter_2d": merge(w, os.path.join(root, "adapter_2d")),
                "adapter_3d": merge(w, os.path.join(root, "adapter_3d"))}
    with torch.no_grad():
        for name, wv in variants.items():
            for k, p in enumerate(PROMPTS):
                res[f"logits.{name}.{k}"] = forward(wv, p).contiguous()
    for name in ("adapter_2d", "adapter_3d"):
        assert (res[f"logits.{name}.0"] - res["logits.base.0"]).abs().max() > 1e-3, name
    save_file(res, os.path.join(root, "expected_logits.safetensors"))


if __name__ == "__main__":
    main()
