#!/usr/bin/env python3
"""Builds the committed test fixtures under tests/data/ with Hugging Face transformers + PEFT.

Run by hand, never in CI (the product does not depend on Python):

    python3 -m venv /opt/fixvenv
    /opt/fixvenv/bin/pip install torch transformers peft safetensors numpy
    /opt/fixvenv/bin/python tools/make_fixtures.py --out tests/data

What it writes (all float32, tiny, random weights with fixed seeds):

  qwen3_moe/model/          Qwen3MoeForCausalLM, per-expert checkpoint (as transformers saves it)
  qwen3_vl_moe/model/       Qwen3VLMoeForConditionalGeneration; text experts stored fused and
                            transposed ([E,H,2I] / [E,I,H]) as the released checkpoints are; the
                            script checks that transformers reloads it to the same logits
  qwen3_vl_moe/model_hf5/   the same checkpoint re-saved by transformers 5's save_pretrained (the
                            experts in its runtime layout [E,2I,H] / [E,H,I]); same weights
  gpt_oss/model/            GptOssForCausalLM config.json only (for the interleaved gate/up case)
  <model>/adapter_3d/       written by PEFT itself: target_parameters on experts.gate_up_proj /
                            experts.down_proj (+ q_proj, o_proj) — the PEFT >= 0.19.1 3D layout
  <model>/adapter_2d/       per-expert gate/up/down_proj (+ q_proj, v_proj): PEFT under transformers
                            v5 cannot write this layout (the experts are fused), so the script writes
                            it by docs/formats.md §2 and then loads it back through PEFT, whose own
                            v4->v5 conversion must accept it; every expected number below comes from
                            the PEFT-loaded model, never from this script's own arithmetic
  qwen3_moe/adapter_3d_as_2d/  the 3D adapter rewritten per expert by docs/formats.md §4 (Python);
                            PEFT must give the same logits for it as for adapter_3d
  gpt_oss/adapter_3d/       PEFT 3D adapter on the interleaved GPT-OSS experts
  */expected_deltas.safetensors  PEFT get_delta_weight() per expert and projection:
                            key "layers.L.experts.E.{gate,up,down}_proj" -> [out, in] (scaling applied),
                            dense modules "layers.L.<module>" -> [out, in]
  */expected_logits.safetensors  "prompt.K" (int32 token ids) and "logits.<variant>.K" [T, V] for
                            the base model and each adapter (variant = base | adapter_2d | adapter_3d ...)
  versions.json             the pip packages and versions used
"""
import argparse
import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import peft
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (Qwen3_5MoeConfig,
                                                                       Qwen3_5MoeTextConfig)

# Distinct sizes so that a swapped or transposed tensor can never pass a shape check by accident.
H, I, E, LAYERS, VOCAB = 24, 10, 4, 2, 96
# The run command's model (qwen3_moe) has a real byte-level BPE tokenizer (tools/make_tokenizers.py
# tiny), which needs the 256 byte tokens plus merges and special tokens.
QWEN3_MOE_VOCAB = 384
# The reference forward: plain eager attention and the eager per-expert loop.
EAGER = dict(attn_implementation="eager", experts_implementation="eager")
PROMPTS = [[1, 17, 42, 5, 88], [3, 9, 27, 81, 50, 11, 60], [7, 2, 95]]


def text_kwargs(vocab=VOCAB):
    return dict(vocab_size=vocab, hidden_size=H, intermediate_size=32, moe_intermediate_size=I,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_experts=E, num_experts_per_tok=2, max_position_embeddings=128,
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6)


def logits_of(model, prompt):
    with torch.no_grad():
        ids = torch.tensor([prompt], dtype=torch.long)
        return model(input_ids=ids).logits[0].float().contiguous()


def save_logits(path, variants):
    """variants: name -> model. Writes prompts and logits for each."""
    out = {f"prompt.{k}": torch.tensor(p, dtype=torch.int32) for k, p in enumerate(PROMPTS)}
    for name, model in variants.items():
        model.eval()
        for k, p in enumerate(PROMPTS):
            out[f"logits.{name}.{k}"] = logits_of(model, p)
    save_file(out, path)


def expert_deltas(peft_model, layer_prefix_fmt, interleaved=False):
    """PEFT's own per-expert delta weights, split into gate/up/down [out, in] per expert."""
    out = {}
    for name, mod in peft_model.named_modules():
        if type(mod).__name__ != "ParamWrapper":
            continue
        d = mod.get_delta_weight("default").float()  # [E, out, in] or [E, in, out] (transposed params)
        param = mod.parameter_name
        layer = int(name.split(".layers.")[1].split(".")[0])
        if getattr(mod.get_base_layer() if hasattr(mod, "get_base_layer") else mod, "is_transposed", False) or \
                getattr(mod, "is_transposed", False):
            d = d.transpose(1, 2)
        for e in range(d.shape[0]):
            if param == "gate_up_proj":
                if interleaved:
                    gate, up = d[e][0::2], d[e][1::2]
                else:
                    gate, up = d[e].chunk(2, dim=0)
                out[f"layers.{layer}.experts.{e}.gate_proj"] = gate.contiguous()
                out[f"layers.{layer}.experts.{e}.up_proj"] = up.contiguous()
            else:
                out[f"layers.{layer}.experts.{e}.down_proj"] = d[e].contiguous()
    for name, mod in peft_model.named_modules():
        if type(mod).__name__ == "Linear" and hasattr(mod, "lora_A") and "default" in mod.lora_A:
            layer = int(name.split(".layers.")[1].split(".")[0])
            short = name.split(".")[-1]
            out[f"layers.{layer}.{short}"] = mod.get_delta_weight("default").float().contiguous()
    return out


def write_2d_adapter(path, prefix, r, alpha, dense, seed, base_model_path, share_gate_up_a=False):
    """A per-expert (2D) adapter by docs/formats.md §2; dense: {module_suffix: (out, in)}."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(LAYERS):
        for e in range(E):
            shared_a = torch.randn(r, H, generator=g) * 0.3
            for proj, (o, i) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                k = f"base_model.model.{prefix}.layers.{layer}.mlp.experts.{e}.{proj}"
                a = shared_a.clone() if (share_gate_up_a and proj != "down_proj") else torch.randn(r, i, generator=g) * 0.3
                sd[k + ".lora_A.weight"] = a
                sd[k + ".lora_B.weight"] = torch.randn(o, r, generator=g) * 0.3
        for mod, (o, i) in dense.items():
            k = f"base_model.model.{prefix}.layers.{layer}.self_attn.{mod}"
            sd[k + ".lora_A.weight"] = torch.randn(r, i, generator=g) * 0.3
            sd[k + ".lora_B.weight"] = torch.randn(o, r, generator=g) * 0.3
    os.makedirs(path, exist_ok=True)
    save_file(sd, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": False, "bias": "none",
           "target_modules": list(dense) + ["gate_proj", "up_proj", "down_proj"],
           "base_model_name_or_path": base_model_path, "task_type": "CAUSAL_LM", "lora_dropout": 0.0,
           "modules_to_save": None, "use_dora": False, "fan_in_fan_out": False}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def make_3d_adapter(model_fn, path, r, alpha, seed, dense=("q_proj", "o_proj"), rslora=False):
    torch.manual_seed(seed)
    model = model_fn()
    lc = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=list(dense),
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                    init_lora_weights=False)
    pm = get_peft_model(model, lc)
    pm.save_pretrained(path)
    return pm


def convert_3d_to_2d_python(src, dst, prefix, interleaved=False):
    """docs/formats.md §4 in numpy, for an independent 2D twin of a 3D adapter."""
    sd = load_file(os.path.join(src, "adapter_model.safetensors"))
    cfg = json.load(open(os.path.join(src, "adapter_config.json")))
    out = {}
    for k, v in sd.items():
        if ".mlp.experts." not in k:
            out[k] = v
            continue
    layers = sorted({int(k.split(".layers.")[1].split(".")[0]) for k in sd if ".mlp.experts." in k})
    for layer in layers:
        base = f"base_model.model.{prefix}.layers.{layer}.mlp.experts"
        gu_a, gu_b = sd[base + ".base_layer.lora_A.weight"], sd[base + ".base_layer.lora_B.weight"]
        d_a, d_b = sd[base + ".lora_A.weight"], sd[base + ".lora_B.weight"]
        r_gu, r_d = gu_a.shape[0] // E, d_a.shape[0] // E
        for e in range(E):
            a_gu = gu_a[e * r_gu:(e + 1) * r_gu]
            b_gu = gu_b[:, e::E]
            half = b_gu.shape[0] // 2
            b1, b3 = (b_gu[0::2], b_gu[1::2]) if interleaved else (b_gu[:half], b_gu[half:])
            out[f"{base}.{e}.gate_proj.lora_A.weight"] = a_gu.clone()
            out[f"{base}.{e}.gate_proj.lora_B.weight"] = b1.contiguous()
            out[f"{base}.{e}.up_proj.lora_A.weight"] = a_gu.clone()
            out[f"{base}.{e}.up_proj.lora_B.weight"] = b3.contiguous()
            out[f"{base}.{e}.down_proj.lora_A.weight"] = d_a[e * r_d:(e + 1) * r_d].contiguous()
            out[f"{base}.{e}.down_proj.lora_B.weight"] = d_b[:, e::E].contiguous()
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg2 = {k: cfg[k] for k in ("r", "lora_alpha", "use_rslora", "bias", "base_model_name_or_path",
                                "modules_to_save", "use_dora", "fan_in_fan_out") if k in cfg}
    cfg2.update({"peft_type": "LORA", "task_type": "CAUSAL_LM", "lora_dropout": 0.0,
                 "target_modules": sorted(set(cfg["target_modules"]) | {"gate_proj", "up_proj", "down_proj"})})
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg2, f, indent=2, sort_keys=True)


def peft_load(model_cls, model_dir, adapter_dir):
    base = model_cls.from_pretrained(model_dir, dtype=torch.float32, **EAGER)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def qwen3_moe(out):
    root = os.path.join(out, "qwen3_moe")
    mdir = os.path.join(root, "model")
    cfg = Qwen3MoeConfig(tie_word_embeddings=False, **text_kwargs(QWEN3_MOE_VOCAB), **EAGER)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(1234)
    base = Qwen3MoeForCausalLM(cfg).eval()
    base.save_pretrained(mdir)
    # transformers writes the per-expert checkpoint (experts.E.gate_proj.weight); check it.
    keys = load_file(os.path.join(mdir, "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys, sorted(keys)[:8]

    make_3d_adapter(lambda: Qwen3MoeForCausalLM.from_pretrained(mdir, dtype=torch.float32, **EAGER),
                    os.path.join(root, "adapter_3d"), r=4, alpha=8, seed=11)
    write_2d_adapter(os.path.join(root, "adapter_2d"), "model", r=3, alpha=6,
                     dense={"q_proj": (32, H), "v_proj": (16, H)}, seed=12, base_model_path=mdir)
    write_2d_adapter(os.path.join(root, "adapter_2d_shared_a"), "model", r=2, alpha=4, dense={},
                     seed=13, base_model_path=mdir, share_gate_up_a=True)
    convert_3d_to_2d_python(os.path.join(root, "adapter_3d"), os.path.join(root, "adapter_3d_as_2d"), "model")

    variants = {"base": Qwen3MoeForCausalLM.from_pretrained(mdir, dtype=torch.float32, **EAGER).eval()}
    for ad in ("adapter_2d", "adapter_3d", "adapter_3d_as_2d", "adapter_2d_shared_a"):
        pm = peft_load(Qwen3MoeForCausalLM, mdir, os.path.join(root, ad))
        variants[ad] = pm
        save_file(expert_deltas(pm, "model.layers.{}"), os.path.join(root, ad, "expected_deltas.safetensors"))
    save_logits(os.path.join(root, "expected_logits.safetensors"), variants)
    l3 = load_file(os.path.join(root, "expected_logits.safetensors"))
    for k in range(len(PROMPTS)):
        diff = (l3[f"logits.adapter_3d.{k}"] - l3[f"logits.adapter_3d_as_2d.{k}"]).abs().max().item()
        assert diff < 1e-5, f"3D and its §7.4 2D twin disagree in PEFT: {diff}"
        assert (l3[f"logits.adapter_3d.{k}"] - l3[f"logits.base.{k}"]).abs().max().item() > 1e-3
    return cfg


def rename_adapter(src, dst, old, new):
    """Copies an adapter, moving its keys from one layer prefix to another (text-only -> VL wrapper)."""
    os.makedirs(dst, exist_ok=True)
    sd = load_file(os.path.join(src, "adapter_model.safetensors"))
    sd = {k.replace(old, new, 1): v for k, v in sd.items()}
    save_file(sd, os.path.join(dst, "adapter_model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(src, "adapter_config.json"), dst)
    shutil.copy(os.path.join(src, "expected_deltas.safetensors"), dst)


def qwen3_vl_moe(out):
    """The Qwen3-MoE fixture's text weights inside a Qwen3-VL-MoE wrapper (tiny vision tower)."""
    root = os.path.join(out, "qwen3_vl_moe")
    src = os.path.join(out, "qwen3_moe")
    mdir = os.path.join(root, "model")
    tc = text_kwargs(QWEN3_MOE_VOCAB)
    tc["rope_scaling"] = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
    vc = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=H, patch_size=2,
              spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16,
              deepstack_visual_indexes=[0])
    cfg = Qwen3VLMoeConfig(text_config=tc, vision_config=vc, tie_word_embeddings=False, **EAGER)
    cfg.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    torch.manual_seed(4321)
    model = Qwen3VLMoeForConditionalGeneration(cfg).eval()
    # Same text weights as qwen3_moe/model, fused by transformers' own per-expert -> fused load path.
    text = Qwen3MoeForCausalLM.from_pretrained(os.path.join(src, "model"), dtype=torch.float32, **EAGER)
    tsd = text.state_dict()
    vsd = model.state_dict()
    for k in vsd:
        if k.startswith("model.language_model."):
            vsd[k] = tsd["model." + k[len("model.language_model."):]].clone()
        elif k == "lm_head.weight":
            vsd[k] = tsd[k].clone()
    model.load_state_dict(vsd)
    model.save_pretrained(mdir)
    # The released Qwen3-VL-MoE checkpoints store the text experts transposed: gate_up_proj [E,H,2I],
    # down_proj [E,I,H] (docs/formats.md §6). transformers v5 writes its runtime layout [E,2I,H] here, so
    # rewrite those two tensors in the on-disk layout and prove below that transformers reads it back.
    path = os.path.join(mdir, "model.safetensors")
    sd = load_file(path)
    for k in list(sd):
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            sd[k] = sd[k].transpose(1, 2).contiguous()
    save_file(sd, path, metadata={"format": "pt"})
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(mdir, dtype=torch.float32, **EAGER).eval()
    for p in PROMPTS:
        d = (logits_of(model, p) - logits_of(reloaded, p)).abs().max().item()
        assert d == 0.0, f"transformers did not read the transposed expert layout back: {d}"

    # Same adapters, keys under model.language_model. (as adapters trained on the VL class are).
    for ad in ("adapter_2d", "adapter_3d"):
        rename_adapter(os.path.join(src, ad), os.path.join(root, ad), "base_model.model.model.layers.",
                       "base_model.model.model.language_model.layers.")
    ref = load_file(os.path.join(src, "expected_logits.safetensors"))
    variants = {"base": reloaded,
                "adapter_3d": peft_load(Qwen3VLMoeForConditionalGeneration, mdir, os.path.join(root, "adapter_3d"))}
    save_logits(os.path.join(root, "expected_logits.safetensors"), variants)
    got = load_file(os.path.join(root, "expected_logits.safetensors"))
    for k in range(len(PROMPTS)):
        for v in ("base", "adapter_3d"):
            d = (got[f"logits.{v}.{k}"] - ref[f"logits.{v}.{k}"]).abs().max().item()
            assert d < 1e-5, f"VL wrapper and Qwen3-MoE disagree for {v}: {d}"
        # PEFT has no per-expert -> fused conversion for the VL class (it would silently drop the expert
        # LoRA), so the 2D adapter's expected logits are the Qwen3-MoE ones: same weights, same adapter.
        got[f"logits.adapter_2d.{k}"] = ref[f"logits.adapter_2d.{k}"]
    save_file(got, os.path.join(root, "expected_logits.safetensors"))


def qwen3_vl_moe_hf5(out):
    """qwen3_vl_moe/model_hf5: the same checkpoint as transformers 5's save_pretrained writes it, the
    text experts in its runtime layout (gate_up_proj [E,2I,H], down_proj [E,H,I]); the engine must
    read both layouts (expected logits: the fixture's own)."""
    root = os.path.join(out, "qwen3_vl_moe")
    src, dst = os.path.join(root, "model"), os.path.join(root, "model_hf5")
    shutil.rmtree(dst, ignore_errors=True)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(src, dtype=torch.float32, **EAGER).eval()
    model.save_pretrained(dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    gu = [v for k, v in sd.items() if k.endswith("mlp.experts.gate_up_proj")]
    assert gu and all(t.shape[1] == 2 * I and t.shape[2] == H for t in gu), "not transformers' layout"
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(dst, dtype=torch.float32, **EAGER).eval()
    a, b = model.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "weights differ"
    for p in PROMPTS:  # the same weights; the matmuls' memory layout may move the last bit
        d = (logits_of(model, p) - logits_of(reloaded, p)).abs().max().item()
        assert d < 1e-6, f"the re-saved checkpoint gives other logits: {d}"


def gpt_oss(out):
    root = os.path.join(out, "gpt_oss")
    mdir = os.path.join(root, "model")
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=E,
                       num_experts_per_tok=2, max_position_embeddings=128, layer_types=["full_attention"] * LAYERS, **EAGER)
    cfg.architectures = ["GptOssForCausalLM"]
    os.makedirs(mdir, exist_ok=True)
    cfg.to_json_file(os.path.join(mdir, "config.json"))
    torch.manual_seed(99)
    pm = make_3d_adapter(lambda: GptOssForCausalLM(cfg), os.path.join(root, "adapter_3d"), r=2, alpha=2,
                         seed=31, dense=("q_proj",))
    save_file(expert_deltas(pm, "", interleaved=True), os.path.join(root, "adapter_3d", "expected_deltas.safetensors"))
    for sub in os.listdir(out):
        for dirpath, _, files in os.walk(os.path.join(out, sub)):
            if "README.md" in files and "adapter_config.json" in files:
                os.remove(os.path.join(dirpath, "README.md"))  # PEFT's generated model card


def gpt_oss_lm(out):
    """gpt_oss_lm/: a tiny GptOssForCausalLM with weights (bf16-release layout: fused, transposed,
    interleaved gate/up experts with biases), sinks, attention biases, alternating sliding (4)
    and full layers, YaRN with truncate false; a PEFT 3D adapter on the experts and q/k/v/o;
    expected logits (eager) for base and the adapter. Sinks, biases and norms are randomised."""
    root = os.path.join(out, "gpt_oss_lm")
    shutil.rmtree(root, ignore_errors=True)
    mdir = os.path.join(root, "model")
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=E,
                       num_experts_per_tok=2, max_position_embeddings=128, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"],
                       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                        "beta_fast": 32.0, "beta_slow": 1.0,
                                        "original_max_position_embeddings": 4096, "truncate": False},
                       **EAGER)
    cfg.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(77)
    model = GptOssForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(78)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks") or "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
            elif "experts" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, H, 2 * I)
    os.makedirs(mdir)
    cfg.save_pretrained(mdir)
    save_file(sd, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
    load = lambda: GptOssForCausalLM.from_pretrained(mdir, dtype=torch.float32, **EAGER).eval()
    prompts = VARIANT_PROMPTS  # the 12-token one is longer than the window
    base = load()
    for p in prompts:
        assert (logits_of(model, p) - logits_of(base, p)).abs().max().item() < 1e-6
    torch.manual_seed(79)
    lc = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                    init_lora_weights=False)
    pm = get_peft_model(load(), lc)
    pm.save_pretrained(os.path.join(root, "adapter_3d"))
    readme = os.path.join(root, "adapter_3d", "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    peft = peft_load(GptOssForCausalLM, mdir, os.path.join(root, "adapter_3d"))
    res = {f"prompt.{k}": torch.tensor(p, dtype=torch.int32) for k, p in enumerate(prompts)}
    for k, p in enumerate(prompts):
        res[f"logits.base.{k}"] = logits_of(base, p)
        res[f"logits.adapter_3d.{k}"] = logits_of(peft, p)
        assert (res[f"logits.adapter_3d.{k}"] - res[f"logits.base.{k}"]).abs().max().item() > 1e-3
    save_file(res, os.path.join(root, "expected_logits.safetensors"))
    gpt_oss_lm_2d(out)


def gpt_oss_lm_2d(out):
    """gpt_oss_lm/adapter_2d: the PEFT 3D adapter rewritten per expert by docs/formats.md §4 in
    this script's numpy (de-interleaving gate/up). The conversion is exact, so its expected
    logits are PEFT's for the 3D adapter (PEFT cannot load per-expert LoRA for GPT-OSS)."""
    root = os.path.join(out, "gpt_oss_lm")
    dst = os.path.join(root, "adapter_2d")
    shutil.rmtree(dst, ignore_errors=True)
    convert_3d_to_2d_python(os.path.join(root, "adapter_3d"), dst, "model", interleaved=True)
    path = os.path.join(root, "expected_logits.safetensors")
    res = load_file(path)
    for k in range(len(VARIANT_PROMPTS)):
        res[f"logits.adapter_2d.{k}"] = res[f"logits.adapter_3d.{k}"].clone()
    save_file(res, path)


# E2M1 magnitudes by code (OCP Microscaling Formats v1.0, 5.3.3); codes 8-15 are their negatives.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


def mxfp4_quantize(w):
    """w [.., rows, k] float -> (blocks uint8 [.., rows, k/32, 16], scales uint8 [.., rows, k/32]):
    per block of 32 values the shared exponent floor(log2(amax)) - 2 (E2M1's largest exponent),
    as the OCP spec's conversion sets it, and each value rounded to the nearest E2M1 code (ties to
    the lower magnitude) after division by 2^exponent, clamped to 6."""
    w = np.asarray(w, dtype=np.float64)
    *lead, rows, k = w.shape
    b = w.reshape(*lead, rows, k // 32, 32)
    amax = np.abs(b).max(axis=-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127)
    exp = np.clip(exp, -127, 127)
    x = b / np.exp2(exp)[..., None]
    mag = np.minimum(np.abs(x), 6.0)
    code = np.abs(mag[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)
    code |= np.where(x < 0, 8, 0).astype(np.uint8)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return packed, (exp + 127).astype(np.uint8)


def mxfp4_dequantize(blocks, scales):
    """The inverse, written apart from the engine and from transformers: [.., rows, k]."""
    lo, hi = blocks & 15, blocks >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    vals = vals * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def gpt_oss_mxfp4(out):
    """gpt_oss_mxfp4/: a tiny GptOssForCausalLM stored as OpenAI's release stores gpt-oss: experts
    as MXFP4 `*_blocks` / `*_scales` ([E, rows, k/32, 16] and [E, rows, k/32], rows = the output
    dim, gate/up interleaved), everything else unquantized, quantization_config mxfp4 with the
    release's modules_to_not_convert. H = I = 64 (whole MXFP4 blocks, also per rank at TP 2).
    Expected logits from transformers loading the checkpoint itself (it dequantizes MXFP4 on the
    CPU), checked against this script's own dequantization; a PEFT 3D adapter on the experts and
    q/o over the dequantized model, and its 2D rewrite."""
    root = os.path.join(out, "gpt_oss_mxfp4")
    shutil.rmtree(root, ignore_errors=True)
    mdir = os.path.join(root, "model")
    h, inter = 64, 64
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=h, intermediate_size=inter,
                       num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_local_experts=E, num_experts_per_tok=2,
                       max_position_embeddings=128, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"], **EAGER)
    cfg.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(81)
    model = GptOssForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(82)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks") or "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
            elif "experts" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    deq = {}
    for k in list(sd):
        if not (k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj")):
            continue
        w = sd.pop(k).numpy().transpose(0, 2, 1)  # [E, in, out] -> [E, out, in]
        blocks, scales = mxfp4_quantize(w)
        sd[k + "_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks.reshape(*blocks.shape[:-1], 16)))
        sd[k + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        deq[k] = torch.from_numpy(mxfp4_dequantize(sd[k + "_blocks"].numpy(), scales)
                                  .transpose(0, 2, 1).astype(np.float32)).contiguous()
    assert sd["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (E, 2 * inter, h // 32, 16)
    os.makedirs(mdir)
    cfg.save_pretrained(mdir)
    with open(os.path.join(mdir, "config.json")) as f:
        cj = json.load(f)
    cj["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
    save_file(sd, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
    load = lambda: GptOssForCausalLM.from_pretrained(mdir, dtype=torch.float32, **EAGER).eval()
    base = load()
    # transformers' dequantization equals this script's.
    own = GptOssForCausalLM(cfg).eval()
    own.load_state_dict({**{k: v for k, v in sd.items() if "_blocks" not in k and "_scales" not in k},
                         **deq}, strict=True)
    prompts = VARIANT_PROMPTS
    for p in prompts:
        assert (logits_of(own, p) - logits_of(base, p)).abs().max().item() < 1e-5
    torch.manual_seed(83)
    lc = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                    init_lora_weights=False)
    pm = get_peft_model(own, lc)
    pm.save_pretrained(os.path.join(root, "adapter_3d"))
    readme = os.path.join(root, "adapter_3d", "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    res = {f"prompt.{k}": torch.tensor(p, dtype=torch.int32) for k, p in enumerate(prompts)}
    for k, p in enumerate(prompts):
        res[f"logits.base.{k}"] = logits_of(base, p)
        res[f"logits.adapter_3d.{k}"] = logits_of(pm, p)
        res[f"logits.adapter_2d.{k}"] = res[f"logits.adapter_3d.{k}"].clone()
        assert (res[f"logits.adapter_3d.{k}"] - res[f"logits.base.{k}"]).abs().max().item() > 1e-3
    save_file(res, os.path.join(root, "expected_logits.safetensors"))
    convert_3d_to_2d_python(os.path.join(root, "adapter_3d"), os.path.join(root, "adapter_2d"),
                            "model", interleaved=True)


def fp8_block_quantize(w, bn, bk):
    """w [out, in] f32 -> (codes float8_e4m3fn [out, in], scale_inv f32 [ceil(out/bn), ceil(in/bk)]):
    per block, scale = amax / 448 (E4M3's largest), codes = w / scale rounded by torch's cast."""
    out_, in_ = w.shape
    rb, cb = -(-out_ // bn), -(-in_ // bk)
    scale = torch.zeros(rb, cb, dtype=torch.float32)
    codes = torch.zeros(out_, in_, dtype=torch.float8_e4m3fn)
    for i in range(rb):
        for j in range(cb):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / s).to(torch.float8_e4m3fn)
    return codes, scale


def fp8_block_dequantize(codes, scale, bn, bk):
    full = scale.repeat_interleave(bn, 0)[:codes.shape[0]].repeat_interleave(bk, 1)[:, :codes.shape[1]]
    return codes.to(torch.float32) * full


def qwen3_moe_fp8(out):
    """qwen3_moe_fp8/: a tiny Qwen3MoeForCausalLM stored as the FP8 releases store it: every
    attention projection and expert weight (one per expert) as float8_e4m3fn `.weight` with an f32
    `.weight_scale_inv` per 8x8 block (the releases use 128x128; a small block keeps the fixture
    small and still splits at TP 2), quantization_config fp8 with modules_to_not_convert (the
    router, lm_head, embeddings and one layer's q_proj, which stays f32). Expected logits from the
    model with the weights dequantized by torch (codes.to(float32) times the block's scale), which
    transformers' own loading of the FP8 checkpoint is checked against; PEFT's 3D adapter over it
    and its 2D rewrite."""
    root = os.path.join(out, "qwen3_moe_fp8")
    shutil.rmtree(root, ignore_errors=True)
    mdir, deq_dir = os.path.join(root, "model"), os.path.join(root, "dequantized")
    bn = bk = 8
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_experts=E, num_experts_per_tok=2,
                         max_position_embeddings=128, decoder_sparse_step=1, mlp_only_layers=[],
                         norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False, **EAGER)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(91)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "proj" in name:
                p.copy_(torch.randn(p.shape) * 0.2)
    model.save_pretrained(deq_dir)
    sd = load_file(os.path.join(deq_dir, "model.safetensors"))
    keep = ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate", "model.layers.1.self_attn.q_proj"]
    kept = lambda k: (k.startswith("lm_head") or k.startswith("model.embed_tokens") or ".mlp.gate." in k
                      or k.startswith("model.layers.1.self_attn.q_proj"))
    q, deq = {}, {}
    for k, v in sd.items():
        if k.endswith("proj.weight") and not kept(k):
            codes, scale = fp8_block_quantize(v, bn, bk)
            q[k], q[k + "_scale_inv"] = codes, scale
            deq[k] = fp8_block_dequantize(codes, scale, bn, bk)
        else:
            q[k] = deq[k] = v
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in q
    os.makedirs(mdir)
    save_file(q, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, os.path.join(deq_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(mdir)
    with open(os.path.join(mdir, "config.json")) as f:
        cj = json.load(f)
    cj["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                 "weight_block_size": [bn, bk], "modules_to_not_convert": keep}
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
    load = lambda d: Qwen3MoeForCausalLM.from_pretrained(d, dtype=torch.float32, **EAGER).eval()
    base = load(deq_dir)
    theirs = load(mdir)  # transformers dequantizes FP8 on the CPU itself
    for p in PROMPTS:
        d = (logits_of(theirs, p) - logits_of(base, p)).abs().max().item()
        assert d < 1e-2, d  # transformers dequantizes to bf16: close, not equal
    make_3d_adapter(lambda: load(deq_dir), os.path.join(root, "adapter_3d"), r=4, alpha=8, seed=92)
    os.remove(os.path.join(root, "adapter_3d", "README.md"))
    convert_3d_to_2d_python(os.path.join(root, "adapter_3d"), os.path.join(root, "adapter_2d"), "model")
    variants = {"base": base, "adapter_3d": peft_load(Qwen3MoeForCausalLM, deq_dir, os.path.join(root, "adapter_3d")),
                "adapter_2d": peft_load(Qwen3MoeForCausalLM, deq_dir, os.path.join(root, "adapter_2d"))}
    save_logits(os.path.join(root, "expected_logits.safetensors"), variants)
    res = load_file(os.path.join(root, "expected_logits.safetensors"))
    for k in range(len(PROMPTS)):
        assert (res[f"logits.adapter_3d.{k}"] - res[f"logits.adapter_2d.{k}"]).abs().max().item() < 1e-5
        assert (res[f"logits.adapter_3d.{k}"] - res[f"logits.base.{k}"]).abs().max().item() > 1e-3
    shutil.rmtree(deq_dir)


# Config variants of the Qwen3-MoE fixture (same weights) for settings that change the math:
# RoPE scaling types and the sliding window. Longer prompts so that the window and the scaled
# frequencies matter.
VARIANT_PROMPTS = [[1, 17, 42, 5, 88, 13, 70, 2, 9, 33, 61, 4], [3, 9, 27, 81, 50, 11, 60], [7, 2, 95]]
VARIANT_NEW_TOKENS = 8
QWEN3_VARIANTS = {
    "rope_linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "rope_yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 32}),
    "rope_llama3": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 16}),
    "sliding_window": dict(use_sliding_window=True, sliding_window=4),
}


def qwen3_moe_variants(out):
    """qwen3_moe/variants/<name>/: the base fixture's weights under another config, and
    expected.safetensors: prompt.K, continuation.K (greedy tokens, each the argmax of a full
    no-cache forward of everything before it) and logits.full.K [P + N - 1, V] (the no-cache
    logits of prompt + continuation, so that row P - 1 + i is the logits that chose token i)."""
    mdir = os.path.join(out, "qwen3_moe", "model")
    for name, extra in QWEN3_VARIANTS.items():
        vdir = os.path.join(out, "qwen3_moe", "variants", name)
        shutil.rmtree(vdir, ignore_errors=True)
        kw = text_kwargs(QWEN3_MOE_VOCAB)
        kw.update(extra)
        cfg = Qwen3MoeConfig(tie_word_embeddings=False, **kw, **EAGER)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
        model = Qwen3MoeForCausalLM.from_pretrained(mdir, config=cfg, dtype=torch.float32, **EAGER).eval()
        model.save_pretrained(os.path.join(vdir, "model"))
        res = {}
        base = Qwen3MoeForCausalLM.from_pretrained(mdir, dtype=torch.float32, **EAGER).eval()
        differs = False
        for k, p in enumerate(VARIANT_PROMPTS):
            seq = list(p)
            for _ in range(VARIANT_NEW_TOKENS):
                seq.append(int(logits_of(model, seq)[-1].argmax()))
            full = logits_of(model, seq[:-1])
            res[f"prompt.{k}"] = torch.tensor(p, dtype=torch.int32)
            res[f"continuation.{k}"] = torch.tensor(seq[len(p):], dtype=torch.int32)
            res[f"logits.full.{k}"] = full
            differs |= (full - logits_of(base, seq[:-1])).abs().max().item() > 1e-3
        assert differs, f"variant {name} gives the base model's logits: the fixture would prove nothing"
        save_file(res, os.path.join(vdir, "expected.safetensors"))


# Tiny Qwen3.5-MoE: 3 Gated DeltaNet layers and 1 gated full-attention layer; sizes all different.
Q35 = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=4,
           layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
           linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
           linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=I,
           shared_expert_intermediate_size=12, num_experts=E, num_experts_per_tok=2,
           max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [1, 1, 0], "mrope_interleaved": True})
# Prompts: short ones, and one longer than the 64-token chunk of the chunked delta rule.
Q35_PROMPTS = [[1, 17, 42, 5, 88], [3, 9, 27, 81, 50, 11, 60],
               [(7 * i + 3) % VOCAB for i in range(70)]]
Q35_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
              "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj"]


def q35_randomise(model, seed):
    """transformers initialises the zero-centred norms to 0, dt_bias to 1 and the shared-expert gate
    like any linear: randomise them so that every path of the forward matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight") or \
                    name.endswith("q_norm.weight") or name.endswith("k_norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2.0 - 1.0)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("shared_expert_gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def q35_logits(model, prompts=Q35_PROMPTS):
    return [logits_of(model, p) for p in prompts]


def q35_merged_2d(mdir, adapter_dir, prefix="model"):
    """The base model with a 2D adapter merged by hand (W += scaling · B · A per module and per
    expert, docs/formats.md §1): a reference for the 2D layout that does not go through PEFT."""
    model = Qwen3_5MoeForCausalLM.from_pretrained(mdir, dtype=torch.float32, **EAGER).eval()
    sd = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    cfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    scaling = cfg["lora_alpha"] / cfg["r"]
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, a in sd.items():
            if not k.endswith(".lora_A.weight"):
                continue
            b = sd[k.replace(".lora_A.", ".lora_B.")]
            module = k[len("base_model.model."):-len(".lora_A.weight")]
            delta = scaling * (b @ a)
            if ".mlp.experts." in module:
                head, e, proj = module.rsplit(".", 2)
                e = int(e)
                if proj == "down_proj":
                    params[head + ".down_proj"][e] += delta
                else:
                    half = params[head + ".gate_up_proj"].shape[1] // 2
                    off = 0 if proj == "gate_proj" else half
                    params[head + ".gate_up_proj"][e, off:off + half] += delta
            else:
                params[module + ".weight"] += delta
    return model


def qwen3_5_moe(out):
    root = os.path.join(out, "qwen3_5_moe")
    shutil.rmtree(root, ignore_errors=True)
    mdir = os.path.join(root, "model")
    cfg = Qwen3_5MoeTextConfig(**Q35, **EAGER)
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    torch.manual_seed(4321)
    base = Qwen3_5MoeForCausalLM(cfg).eval()
    q35_randomise(base, 99)
    base.save_pretrained(mdir)
    # transformers saves the experts one by one; the bf16 releases store them fused
    # (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]): write that layout, and
    # check that transformers reads it back to the same logits.
    fused = {k: v.contiguous() for k, v in base.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused, sorted(fused)[:8]
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in fused, sorted(fused)[:8]
    save_file(fused, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
    load = lambda: Qwen3_5MoeForCausalLM.from_pretrained(mdir, dtype=torch.float32, **EAGER).eval()
    want = q35_logits(base)
    for a, b in zip(want, q35_logits(load())):
        assert (a - b).abs().max().item() < 1e-6, (a - b).abs().max().item()

    # The same text weights in the multimodal wrapper (as the released checkpoints are), with a
    # tiny vision tower the worker must skip.
    vl_cfg = Qwen3_5MoeConfig(text_config=dict(Q35), vision_config=dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=H, patch_size=4,
        temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16), **EAGER)
    vl_cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    vl = Qwen3_5MoeForConditionalGeneration(vl_cfg).eval()
    vsd = {k: v for k, v in vl.state_dict().items() if "visual" in k}
    for k, v in fused.items():
        vsd[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v
    vdir = os.path.join(root, "model_vl")
    vl_cfg.save_pretrained(vdir)
    save_file({k: v.contiguous() for k, v in vsd.items()}, os.path.join(vdir, "model.safetensors"),
              metadata={"format": "pt"})
    vl2 = Qwen3_5MoeForConditionalGeneration.from_pretrained(vdir, dtype=torch.float32, **EAGER).eval()
    for a, p in zip(want, Q35_PROMPTS):
        assert (a - logits_of(vl2, p)).abs().max().item() < 1e-6

    # 3D adapter by PEFT: target_parameters on the fused experts, and every linear module.
    torch.manual_seed(21)
    lc = LoraConfig(r=4, lora_alpha=8, target_modules=Q35_LINEAR,
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                    init_lora_weights=False)
    pm = get_peft_model(load(), lc)
    pm.save_pretrained(os.path.join(root, "adapter_3d"))
    # 2D adapter: per expert (independent A for gate and up) + linear modules of both mixers and
    # the shared expert; its reference is the hand-merged base model.
    g = torch.Generator().manual_seed(22)
    r2, sd2 = 3, {}
    dims = {"self_attn.q_proj": (2 * 4 * 8, H), "self_attn.v_proj": (2 * 8, H),
            "linear_attn.in_proj_qkv": (2 * 2 * 8 + 4 * 6, H), "linear_attn.in_proj_z": (4 * 6, H),
            "linear_attn.in_proj_b": (4, H), "linear_attn.out_proj": (H, 4 * 6),
            "mlp.shared_expert.up_proj": (12, H), "mlp.shared_expert.down_proj": (H, 12)}
    for layer, lt in enumerate(Q35["layer_types"]):
        for e in range(E):
            for proj, (o, i) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                k = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}"
                sd2[k + ".lora_A.weight"] = torch.randn(r2, i, generator=g) * 0.3
                sd2[k + ".lora_B.weight"] = torch.randn(o, r2, generator=g) * 0.3
        for mod, (o, i) in dims.items():
            if (mod.startswith("self_attn") and lt != "full_attention") or \
                    (mod.startswith("linear_attn") and lt != "linear_attention"):
                continue
            k = f"base_model.model.model.layers.{layer}.{mod}"
            sd2[k + ".lora_A.weight"] = torch.randn(r2, i, generator=g) * 0.3
            sd2[k + ".lora_B.weight"] = torch.randn(o, r2, generator=g) * 0.3
    a2 = os.path.join(root, "adapter_2d")
    os.makedirs(a2)
    save_file(sd2, os.path.join(a2, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a2, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r2, "lora_alpha": 6, "use_rslora": False, "bias": "none",
                   "target_modules": ["q_proj", "v_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                                      "out_proj", "up_proj", "down_proj", "gate_proj"],
                   "base_model_name_or_path": mdir, "task_type": "CAUSAL_LM", "lora_dropout": 0.0,
                   "modules_to_save": None, "use_dora": False, "fan_in_fan_out": False}, f,
                  indent=2, sort_keys=True)

    variants = {"base": load(), "adapter_3d": peft_load(Qwen3_5MoeForCausalLM, mdir, os.path.join(root, "adapter_3d")),
                "adapter_2d": q35_merged_2d(mdir, a2)}
    res = {f"prompt.{k}": torch.tensor(p, dtype=torch.int32) for k, p in enumerate(Q35_PROMPTS)}
    for name, m in variants.items():
        for k, l in enumerate(q35_logits(m)):
            res[f"logits.{name}.{k}"] = l
    for name in ("adapter_3d", "adapter_2d"):
        assert (res[f"logits.{name}.2"] - res["logits.base.2"]).abs().max().item() > 1e-3, name
    # transformers' own cached paths (chunked prefill with an initial state, recurrent decode)
    # agree with the no-cache forward used above.
    m = variants["base"]
    with torch.no_grad():
        p = torch.tensor([Q35_PROMPTS[2]])
        out = m(input_ids=p[:, :40], use_cache=True)
        out2 = m(input_ids=p[:, 40:69], cache=out.past_key_values, use_cache=True)
        out3 = m(input_ids=p[:, 69:70], cache=out2.past_key_values, use_cache=True)
        ref = res["logits.base.2"]
        assert (out2.logits[0, -1] - ref[68]).abs().max() < 1e-4
        assert (out3.logits[0, -1] - ref[69]).abs().max() < 1e-4
    save_file(res, os.path.join(root, "expected_logits.safetensors"))
    save_file(expert_deltas(variants["adapter_3d"], "model.layers.{}"),
              os.path.join(root, "adapter_3d", "expected_deltas.safetensors"))


# Tiny Step3.5 (Step3p5ForCausalLM, the Step-3.5-Flash hub layout), built through transformers'
# Step3p7 text classes (docs/models.md §1, §6) from the hub config's legacy keys. One dense layer
# (0), three MoE layers; full and sliding layers with different head counts, per-layer θ and
# partial rotary, llama3 scaling on full layers; clamped SwiGLU on one routed-expert layer and
# on the dense and one shared-expert MLP; one trailing MTP layer the main model must skip.
S35_LAYERS = 4
S35 = dict(
    architectures=["Step3p5ForCausalLM"], model_type="step3p5", vocab_size=VOCAB, hidden_size=H,
    num_hidden_layers=S35_LAYERS, num_nextn_predict_layers=1, head_dim=8, num_attention_heads=4,
    num_attention_groups=2,
    attention_other_setting={"attention_type": "sliding_attention", "num_attention_heads": 6,
                             "num_attention_groups": 2, "head_dim": 8},
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention"],
    sliding_window=4, rope_theta=[500000.0, 10000.0, 10000.0, 500000.0, 10000.0],
    partial_rotary_factors=[0.5, 1.0, 1.0, 0.5, 1.0],
    rope_scaling={"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 16,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    yarn_only_types=["full_attention"], use_head_wise_attn_gate=True, att_impl_type="GQA",
    moe_layers_enum="1,2,3", intermediate_size=16, moe_num_experts=E, moe_top_k=2,
    moe_intermediate_size=I, share_expert_dim=12, moe_router_activation="sigmoid",
    use_moe_router_bias=True, need_fp32_gate=True, norm_expert_weight=True,
    moe_router_scaling_factor=3.0, swiglu_limits=[0.0, 0.0, 0.0, 0.5, 0.0],
    swiglu_limits_shared=[0.6, 0.0, 0.0, 0.8, 0.0], rms_norm_eps=1e-5,
    max_position_embeddings=256, tie_word_embeddings=False)
S35_PROMPTS = VARIANT_PROMPTS  # the 12-token one is longer than the window (4)
S35_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "gate_proj", "up_proj", "down_proj"]


class Step35LM(torch.nn.Module):
    """Step3p7TextModel + an LM head: the causal LM transformers has no class for (§1)."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel
        self.config = cfg
        self.model = Step3p7TextModel(cfg)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, **kw):
        h = self.model(input_ids=input_ids, **kw).last_hidden_state
        return transformers.modeling_outputs.CausalLMOutput(logits=self.lm_head(h))


def s35_config():
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
    kw = {k: v for k, v in S35.items() if k not in ("architectures", "model_type")}
    cfg = Step3p7TextConfig(**kw)
    cfg._attn_implementation = "eager"
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"], cfg.mlp_layer_types
    assert cfg.num_sliding_attention_heads == 6
    assert cfg.rope_parameters["full_attention"]["rope_type"] == "llama3", cfg.rope_parameters
    return cfg


def s35_to_hub(sd):
    """transformers' parameter names -> the hub checkpoint's (the reverse of transformers'
    step3p7 conversion mapping): moe.gate / router_bias, stacked moe.{gate,up,down}_proj,
    layer-level share_expert."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            p = k[:-len(".mlp.experts.gate_up_proj")]
            out[p + ".moe.gate_proj.weight"] = v[:, :I].contiguous()
            out[p + ".moe.up_proj.weight"] = v[:, I:].contiguous()
        elif k.endswith(".mlp.experts.down_proj"):
            out[k[:-len(".mlp.experts.down_proj")] + ".moe.down_proj.weight"] = v.contiguous()
        elif k.endswith(".mlp.gate.weight"):
            out[k.replace(".mlp.gate.weight", ".moe.gate.weight")] = v.contiguous()
        elif k.endswith(".mlp.gate.e_score_correction_bias"):
            out[k.replace(".mlp.gate.e_score_correction_bias", ".moe.router_bias")] = v.contiguous()
        elif ".mlp.shared_experts." in k:
            out[k.replace(".mlp.shared_experts.", ".share_expert.")] = v.contiguous()
        else:
            out[k] = v.contiguous()
    return out


def s35_merged_2d(model, adapter_dir):
    """`model` (a Step35LM) with a hub-named 2D adapter merged by hand (W += s·B·A)."""
    sd = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    cfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    scaling = cfg["lora_alpha"] / cfg["r"]
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, a in sd.items():
            if not k.endswith(".lora_A.weight"):
                continue
            b = sd[k.replace(".lora_A.", ".lora_B.")]
            module = k[len("base_model.model."):-len(".lora_A.weight")]
            delta = scaling * (b @ a)
            if ".moe.experts." in module:
                head, e, proj = module.rsplit(".", 2)
                head = head.replace(".moe.experts", ".mlp.experts")
                e = int(e)
                if proj == "down_proj":
                    params[head + ".down_proj"][e] += delta
                else:
                    half = params[head + ".gate_up_proj"].shape[1] // 2
                    off = 0 if proj == "gate_proj" else half
                    params[head + ".gate_up_proj"][e, off:off + half] += delta
            else:
                params[module.replace(".share_expert.", ".mlp.shared_experts.") + ".weight"] += delta
    return model


def s35_randomise(module, g):
    """Zero-centred norms (1 + w), experts, head gates, routers and router biases drawn from `g`
    (transformers initialises the norms to 0)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)  # zero-centred: 1 + w
            elif "experts" in name or name.endswith("g_proj.weight") or name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)


def s35_base():
    """The tiny Step3.5 target of tests/data/step3p5 (also the target of tools/
    step3p5_mtp_reference.py), its config, and the generator its weights were drawn from."""
    cfg = s35_config()
    torch.manual_seed(3535)
    base = Step35LM(cfg).eval()
    g = torch.Generator().manual_seed(3536)
    s35_randomise(base, g)
    return cfg, base, g


def step3p5(out):
    root = os.path.join(out, "step3p5")
    shutil.rmtree(root, ignore_errors=True)
    mdir = os.path.join(root, "model")
    cfg, base, g = s35_base()
    sd = {k: v for k, v in base.state_dict().items() if "inv_freq" not in k}
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in sd, sorted(sd)[:10]
    hub = s35_to_hub(sd)
    # The MTP layer (index num_hidden_layers) the main model must skip.
    hub["model.layers.4.eh_proj.weight"] = torch.randn(H, 2 * H, generator=g)
    hub["model.layers.4.enorm.weight"] = torch.randn(H, generator=g)
    hub["model.layers.4.self_attn.q_proj.weight"] = torch.randn(6 * 8, H, generator=g)
    os.makedirs(mdir)
    save_file(hub, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(S35, f, indent=2)
    prompts = S35_PROMPTS
    want = [logits_of(base, p) for p in prompts]
    # The cached path agrees with the no-cache forward (decode steps past the window).
    with torch.no_grad():
        p = torch.tensor([prompts[0]])
        o1 = base.model(input_ids=p[:, :7], use_cache=True)
        o2 = base.model(input_ids=p[:, 7:12], cache=o1.cache, use_cache=True)
        assert (base.lm_head(o2.last_hidden_state)[0] - want[0][7:]).abs().max() < 1e-5

    def peft_of(seed):
        torch.manual_seed(seed)
        lc = LoraConfig(r=4, lora_alpha=8, target_modules=S35_LINEAR,
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                        init_lora_weights=False)
        m = Step35LM(cfg).eval()
        m.load_state_dict(base.state_dict())
        return get_peft_model(m, lc).eval()

    # 3D adapter by PEFT, in transformers' module names (mlp.experts, mlp.shared_experts).
    pm = peft_of(35)
    a3 = os.path.join(root, "adapter_3d")
    pm.save_pretrained(a3)
    readme = os.path.join(a3, "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    sd3 = load_file(os.path.join(a3, "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in sd3, sorted(sd3)[:6]
    assert "base_model.model.model.layers.1.mlp.shared_experts.gate_proj.lora_A.weight" in sd3
    # 2D adapter in the hub's module names (moe.experts.<e>, share_expert, g_proj, the dense MLP);
    # its reference is the hand-merged model.
    g2 = torch.Generator().manual_seed(36)
    r2, sd2 = 3, {}
    heads = lambda l: 4 if S35["layer_types"][l] == "full_attention" else 6
    for layer in range(S35_LAYERS):
        mods = {"self_attn.q_proj": (heads(layer) * 8, H), "self_attn.g_proj": (heads(layer), H),
                "self_attn.o_proj": (H, heads(layer) * 8), "self_attn.v_proj": (16, H)}
        if layer == 0:
            mods.update({"mlp.gate_proj": (16, H), "mlp.down_proj": (H, 16)})
        else:
            mods.update({"share_expert.up_proj": (12, H), "share_expert.down_proj": (H, 12)})
            for e in range(E):
                for proj, (o, i) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                    mods[f"moe.experts.{e}.{proj}"] = (o, i)
        for mod, (o, i) in mods.items():
            k = f"base_model.model.model.layers.{layer}.{mod}"
            sd2[k + ".lora_A.weight"] = torch.randn(r2, i, generator=g2) * 0.3
            sd2[k + ".lora_B.weight"] = torch.randn(o, r2, generator=g2) * 0.3
    a2 = os.path.join(root, "adapter_2d")
    os.makedirs(a2)
    save_file(sd2, os.path.join(a2, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a2, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r2, "lora_alpha": 6, "use_rslora": False, "bias": "none",
                   "target_modules": ["q_proj", "v_proj", "o_proj", "g_proj", "gate_proj", "up_proj",
                                      "down_proj"],
                   "base_model_name_or_path": mdir, "task_type": "CAUSAL_LM", "lora_dropout": 0.0,
                   "modules_to_save": None, "use_dora": False, "fan_in_fan_out": False}, f,
                  indent=2, sort_keys=True)
    m2 = Step35LM(cfg).eval()
    m2.load_state_dict(base.state_dict())
    variants = {"base": base, "adapter_3d": PeftModel.from_pretrained(
        (lambda m: (m.load_state_dict(base.state_dict()), m)[1])(Step35LM(cfg).eval()), a3).eval(),
        "adapter_2d": s35_merged_2d(m2, a2)}
    res = {f"prompt.{k}": torch.tensor(p, dtype=torch.int32) for k, p in enumerate(prompts)}
    for name, m in variants.items():
        for k, p in enumerate(prompts):
            res[f"logits.{name}.{k}"] = logits_of(m, p)
    for k in range(len(prompts)):
        assert (res[f"logits.base.{k}"] - want[k]).abs().max() == 0
        assert (res[f"logits.adapter_3d.{k}"] - logits_of(pm, prompts[k])).abs().max() < 1e-6
    for name in ("adapter_3d", "adapter_2d"):
        assert (res[f"logits.{name}.0"] - res["logits.base.0"]).abs().max().item() > 1e-3, name
    save_file(res, os.path.join(root, "expected_logits.safetensors"))
def qwen3_5_moe_fp8(out):
    """qwen3_5_moe_fp8/: a tiny Qwen3_5MoeForCausalLM stored as the Qwen3.5/3.6 FP8 releases store
    it: attention and Gated DeltaNet projections (in_proj_qkv's [q | k | v] sections included),
    the shared expert and each expert (one per expert) as F8_E4M3 with a BF16 weight_scale_inv per
    8x8 block; in_proj_a/b, conv1d, the routers, embeddings and lm_head kept as they are
    (modules_to_not_convert). Sizes chosen so that every section splits on whole blocks at TP 2.
    Expected logits from the model with torch's dequantization; PEFT's 3D adapter and its 2D
    rewrite."""
    root = os.path.join(out, "qwen3_5_moe_fp8")
    shutil.rmtree(root, ignore_errors=True)
    mdir, deq_dir = os.path.join(root, "model"), os.path.join(root, "dequantized")
    bn = bk = 8
    dims = dict(Q35, hidden_size=32, linear_value_head_dim=8, moe_intermediate_size=16,
                shared_expert_intermediate_size=16)
    cfg = Qwen3_5MoeTextConfig(**dims, **EAGER)
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    torch.manual_seed(95)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    q35_randomise(model, 96)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or name.endswith("proj.weight"):
                p.copy_(torch.randn(p.shape) * 0.2)
    model.save_pretrained(deq_dir)
    sd = load_file(os.path.join(deq_dir, "model.safetensors"))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in sd, sorted(sd)[:8]
    keep = ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate",
            "model.layers.*.mlp.shared_expert_gate", "model.layers.*.linear_attn.in_proj_a",
            "model.layers.*.linear_attn.in_proj_b", "model.layers.*.linear_attn.conv1d"]
    kept = lambda k: any(x in k for x in ("lm_head", "embed_tokens", ".mlp.gate.", "shared_expert_gate",
                                          "in_proj_a", "in_proj_b", "conv1d"))
    q, deq = {}, {}
    for k, v in sd.items():
        if k.endswith("proj.weight") and not kept(k):
            codes, scale = fp8_block_quantize(v, bn, bk)
            scale = scale.to(torch.bfloat16)  # as the Qwen3.5/3.6 FP8 releases store them
            q[k], q[k + "_scale_inv"] = codes, scale
            deq[k] = fp8_block_dequantize(codes, scale.to(torch.float32), bn, bk)
        else:
            q[k] = deq[k] = v
    os.makedirs(mdir)
    save_file(q, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, os.path.join(deq_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(mdir)
    with open(os.path.join(mdir, "config.json")) as f:
        cj = json.load(f)
    cj["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                 "weight_block_size": [bn, bk], "modules_to_not_convert": keep}
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
    load = lambda: Qwen3_5MoeForCausalLM.from_pretrained(deq_dir, dtype=torch.float32, **EAGER).eval()
    base = load()
    torch.manual_seed(97)
    lc = LoraConfig(r=4, lora_alpha=8, target_modules=Q35_LINEAR,
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                    init_lora_weights=False)
    pm = get_peft_model(load(), lc)
    pm.save_pretrained(os.path.join(root, "adapter_3d"))
    os.remove(os.path.join(root, "adapter_3d", "README.md"))
    convert_3d_to_2d_python(os.path.join(root, "adapter_3d"), os.path.join(root, "adapter_2d"), "model")
    p3 = peft_load(Qwen3_5MoeForCausalLM, deq_dir, os.path.join(root, "adapter_3d"))
    # PEFT does not put per-expert LoRA on Qwen3.5's fused experts: the 2D twin is checked against
    # the base with it merged by hand.
    p2 = q35_merged_2d(deq_dir, os.path.join(root, "adapter_2d"))
    res = {f"prompt.{k}": torch.tensor(p, dtype=torch.int32) for k, p in enumerate(Q35_PROMPTS)}
    for k, p in enumerate(Q35_PROMPTS):
        res[f"logits.base.{k}"] = logits_of(base, p)
        res[f"logits.adapter_3d.{k}"] = logits_of(p3, p)
        res[f"logits.adapter_2d.{k}"] = res[f"logits.adapter_3d.{k}"].clone()
        assert (logits_of(p2, p) - res[f"logits.adapter_3d.{k}"]).abs().max().item() < 1e-4
        assert (res[f"logits.adapter_3d.{k}"] - res[f"logits.base.{k}"]).abs().max().item() > 1e-3
    save_file(res, os.path.join(root, "expected_logits.safetensors"))
    shutil.rmtree(deq_dir)


def step3p5_fp8(out):
    """step3p5_fp8/: the step3p5 fixture's weights stored as block FP8 (2x2 blocks: every Step3.5
    dimension of the fixture divides by 2) in `model/`: every projection, the stacked experts
    ([E, I, H] codes with [E, I/2, H/2] scales) included; norms, routers and embeddings as they
    are; the MTP layer's weights too (skipped at load). `model_dequantized/`: the same values
    widened by torch (codes.to(float32) times the block's scale), an f32 checkpoint: the engine
    reads both to the same logits, and the f32 path is checked against the independent reference
    by the step3p5 fixture's own tests."""
    src = os.path.join(out, "step3p5", "model")
    root = os.path.join(out, "step3p5_fp8")
    shutil.rmtree(root, ignore_errors=True)
    mdir, ddir = os.path.join(root, "model"), os.path.join(root, "model_dequantized")
    os.makedirs(mdir)
    os.makedirs(ddir)
    bn = bk = 2
    sd = load_file(os.path.join(src, "model.safetensors"))
    q, deq = {}, {}
    for k, v in sd.items():
        if not k.endswith("proj.weight"):
            q[k] = deq[k] = v
            continue
        if v.dim() == 2:
            codes, scale = fp8_block_quantize(v, bn, bk)
            q[k], q[k + "_scale_inv"] = codes, scale
            deq[k] = fp8_block_dequantize(codes, scale, bn, bk)
        else:  # stacked experts: one scale grid per expert
            parts = [fp8_block_quantize(v[e], bn, bk) for e in range(v.shape[0])]
            q[k] = torch.stack([c for c, _ in parts])
            q[k + "_scale_inv"] = torch.stack([sc for _, sc in parts])
            deq[k] = torch.stack([fp8_block_dequantize(c, sc, bn, bk) for c, sc in parts])
    save_file(q, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, os.path.join(ddir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cj = json.load(f)
    with open(os.path.join(ddir, "config.json"), "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
    cj["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                 "weight_block_size": [bn, bk],
                                 "modules_to_not_convert": ["lm_head", "model.embed_tokens",
                                                            "model.layers.*.moe.gate"]}
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data")
    ap.add_argument("--only", choices=["all", "qwen3_moe", "variants", "qwen3_vl_moe_hf5", "qwen3_5_moe", "gpt_oss_lm",
                                     "gpt_oss_lm_2d", "gpt_oss_mxfp4", "qwen3_moe_fp8", "qwen3_5_moe_fp8", "step3p5", "step3p5_fp8"], default="all",
                    help="variants: only qwen3_moe/variants (needs the committed qwen3_moe/model); "
                         "qwen3_5_moe: only that model's fixtures")
    args = ap.parse_args()
    torch.set_default_dtype(torch.float32)
    if args.only == "variants":
        qwen3_moe_variants(args.out)
        return
    if args.only == "qwen3_vl_moe_hf5":  # needs the committed qwen3_vl_moe/model
        qwen3_vl_moe_hf5(args.out)
        return
    if args.only == "qwen3_moe":  # then: tools/make_tokenizers.py tiny --models .../qwen3_moe/model
        for sub in ("qwen3_moe", "qwen3_vl_moe"):
            shutil.rmtree(os.path.join(args.out, sub), ignore_errors=True)
        qwen3_moe(args.out)
        qwen3_moe_variants(args.out)
        qwen3_vl_moe(args.out)  # the same text weights
        qwen3_vl_moe_hf5(args.out)
        return
    if args.only == "qwen3_5_moe":
        qwen3_5_moe(args.out)
        return
    if args.only == "gpt_oss_lm":
        gpt_oss_lm(args.out)
        return
    if args.only == "gpt_oss_lm_2d":
        gpt_oss_lm_2d(args.out)
        return
    if args.only == "step3p5":
        step3p5(args.out)
        step3p5_fp8(args.out)
        return
    if args.only == "step3p5_fp8":  # needs the committed step3p5/model
        step3p5_fp8(args.out)
        return
    if args.only == "gpt_oss_mxfp4":
        gpt_oss_mxfp4(args.out)
        return
    if args.only == "qwen3_moe_fp8":
        qwen3_moe_fp8(args.out)
        return
    if args.only == "qwen3_5_moe_fp8":
        qwen3_5_moe_fp8(args.out)
        return
    for sub in ("qwen3_moe", "qwen3_vl_moe", "gpt_oss"):
        shutil.rmtree(os.path.join(args.out, sub), ignore_errors=True)
    torch.set_default_dtype(torch.float32)
    qwen3_moe(args.out)
    qwen3_moe_variants(args.out)
    qwen3_vl_moe(args.out)
    qwen3_vl_moe_hf5(args.out)
    qwen3_5_moe(args.out)
    gpt_oss(args.out)
    gpt_oss_lm(args.out)
    gpt_oss_mxfp4(args.out)
    qwen3_moe_fp8(args.out)
    qwen3_5_moe_fp8(args.out)
    step3p5(args.out)
    step3p5_fp8(args.out)
    with open(os.path.join(args.out, "versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__,
                   "peft": peft.__version__, "numpy": np.__version__,
                   "safetensors": __import__("safetensors").__version__}, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
