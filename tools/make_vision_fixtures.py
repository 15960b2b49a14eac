#!/usr/bin/env python3
"""Builds the multimodal test fixtures under tests/data/ with Hugging Face transformers + PEFT:
tiny Qwen3-VL-MoE and Qwen3.5-MoE checkpoints with working vision towers, generated images, the
prompts that hold them, and the logits transformers computes for them. Run by hand, never in CI:

    /opt/fixvenv/bin/pip install torch transformers==5.24.0 peft safetensors numpy pillow==12.3.0
    /opt/fixvenv/bin/python tools/make_vision_fixtures.py --out tests/data

What it writes, per model (qwen3_vl_moe_mm/, qwen3_5_moe_mm/; all float32, random weights with
fixed seeds):

  model/                 config.json, model.safetensors (the VL class's checkpoint: text under
                         model.language_model., the tower under model.visual.), tokenizer.json
                         (the tiny byte-level BPE plus <|vision_start|>, <|vision_end|> and
                         <|image_pad|>), tokenizer_config.json, preprocessor_config.json,
                         chat_template.jinja (ChatML; an image part is the image placeholder)
  images/                the PNG, JPEG and WebP images the prompts show
  adapter_3d/            PEFT: target_parameters on the fused experts, q_proj/o_proj, and the tower's
                         attn.qkv, attn.proj, linear_fc1, linear_fc2 (blocks, merger, DeepStack
                         mergers)
  adapter_2d/            per-expert gate/up/down_proj + the same tower modules, written by this
                         script; its reference is the base model with every delta merged by hand
                         (W += scaling * B @ A), which does not go through PEFT
  expected_logits.safetensors
                         prompt.K (int32 ids, image pads expanded), images.K (the image file names,
                         as JSON in the metadata), pixel_values.K / image_grid_thw.K (what the
                         Pillow-backed processor made of them), rows.K (every third position and
                         the last) and logits.<variant>.K [rows, V] for variant = base |
                         adapter_3d | adapter_2d, computed in float64 and stored as float32;
                         continuation.<variant>.K: 6 greedy tokens (each the argmax of a full
                         forward, with a margin over the runner-up above 1e-3)
"""
import argparse
import json
import os
import shutil

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import peft
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
from transformers import Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

EAGER = dict(attn_implementation="eager", experts_implementation="eager")
VOCAB = 400
VISION_START, VISION_END, IMAGE_PAD = 384, 385, 386
H, I, E = 24, 10, 4
PROCESSOR = {"size": {"shortest_edge": 256, "longest_edge": 4096}, "patch_size": 4,
             "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor",
             "processor_class": "Qwen3VLProcessor"}
VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=40, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=H,
              num_position_embeddings=36, hidden_act="gelu_pytorch_tanh")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' or 'image' in c or 'image_url' in c %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONTINUATION = 6  # greedy tokens per prompt and variant
TOWER_MODULES = ["attn.qkv", "attn.proj", "linear_fc1", "linear_fc2"]
# Prompts: text ids around image placeholders; "IMG" stands for one image's
# <|vision_start|> <|image_pad|> x tokens <|vision_end|>.
PROMPTS = [
    ([5, 17, 42, "IMG", 88, 9, 61], ["a.png"]),
    (["IMG", 3, 9, 27, "IMG", 50, 11], ["b.jpg", "c.webp"]),
    ([7, 2, 95, 14, 33], []),
    ([12, "IMG", 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81], ["c.webp"]),
]


def transpose_expert_storage(path):
    """Rewrites a Qwen3-VL-MoE checkpoint written by transformers with the text experts stored
    transposed ([E,H,2I] / [E,I,H]), as the releases store them."""
    sd = load_file(path)
    for k in list(sd):
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            sd[k] = sd[k].transpose(1, 2).contiguous()
    save_file(sd, path, metadata={"format": "pt"})


def make_images(d):
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(5)

    def content(h, w):
        y, x = np.mgrid[0:h, 0:w]
        planes = [x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), ((x * y) * 3) % 256]
        return np.clip(np.stack(planes, -1) + rng.integers(-30, 31, (h, w, 3)), 0, 255).astype(np.uint8)

    Image.fromarray(content(40, 56)).save(os.path.join(d, "a.png"))
    Image.fromarray(content(30, 90)).save(os.path.join(d, "b.jpg"), quality=90)
    Image.fromarray(content(64, 64)).save(os.path.join(d, "c.webp"), lossless=True)


def write_tokenizer(src_dir, dst_dir):
    tok = json.load(open(os.path.join(src_dir, "tokenizer.json")))
    for tid, content in ((VISION_START, "<|vision_start|>"), (VISION_END, "<|vision_end|>"),
                         (IMAGE_PAD, "<|image_pad|>")):
        tok["added_tokens"].append({"id": tid, "content": content, "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": True})
    json.dump(tok, open(os.path.join(dst_dir, "tokenizer.json"), "w"), ensure_ascii=False)
    for f in ("tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src_dir, f)):
            shutil.copy(os.path.join(src_dir, f), dst_dir)
    json.dump(PROCESSOR, open(os.path.join(dst_dir, "preprocessor_config.json"), "w"), indent=1)
    # ChatML with the Qwen-VL rule for content parts: an image part is the image placeholder.
    with open(os.path.join(dst_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)


def randomise(model, seed, scale):
    """Every parameter random (transformers' init leaves biases, norms and the position table at
    constants that would hide a swapped or missing term); linear weights of std scale/sqrt(in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2.0 - 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (scale / max(1, p.shape[-1]) ** 0.5))


def build_inputs(processor, images_dir, prompt, names):
    pix, grids = None, None
    if names:
        out = processor(images=[Image.open(os.path.join(images_dir, n)) for n in names],
                        return_tensors="pt")
        pix, grids = out["pixel_values"], out["image_grid_thw"]
    ids, k = [], 0
    for t in prompt:
        if t == "IMG":
            n = int(grids[k].prod().item() // 4)
            ids += [VISION_START] + [IMAGE_PAD] * n + [VISION_END]
            k += 1
        else:
            ids.append(t)
    return ids, pix, grids


def logits_of(model, ids, pix, grids):
    with torch.no_grad():
        t = torch.tensor([ids])
        kw = dict(input_ids=t, mm_token_type_ids=(t == IMAGE_PAD).int())
        if pix is not None:
            kw.update(pixel_values=pix.to(model.dtype), image_grid_thw=grids)
        return model(**kw).logits[0].float().contiguous()


def merged_2d(model_fn, adapter_dir, interleaved=False):
    """The base model with the 2D adapter merged by hand (W += scaling * B @ A)."""
    model = model_fn()
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
            delta = scaling * (b.to(model.dtype) @ a.to(model.dtype))
            if ".mlp.experts." in module:
                head, e, proj = module.rsplit(".", 2)
                e = int(e)
                gu, down = params[head + ".gate_up_proj"], params[head + ".down_proj"]
                if proj == "down_proj":
                    down[e] += delta
                else:
                    off = 0 if proj == "gate_proj" else I
                    gu[e, off:off + I] += delta
            else:
                params[module + ".weight"] += delta
    return model


def write_2d_adapter(model, path, r, alpha, seed, text_prefix, layer_types=None):
    """Per-expert LoRA on every layer's experts, q_proj on the attention layers, and the tower
    modules (blocks, merger, DeepStack mergers), shapes from the model itself."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    mods = dict(model.named_modules())
    for name, mod in mods.items():
        is_tower = name.startswith("model.visual.") and isinstance(mod, torch.nn.Linear) and \
            any(name.endswith("." + t) for t in TOWER_MODULES)
        is_q = name.endswith("self_attn.q_proj")
        if is_tower or is_q:
            o, i = mod.weight.shape
            sd[f"base_model.model.{name}.lora_A.weight"] = torch.randn(r, i, generator=g) * 0.3
            sd[f"base_model.model.{name}.lora_B.weight"] = torch.randn(o, r, generator=g) * 0.3
        if name.endswith("mlp.experts"):
            for e in range(E):
                for proj, (o, i) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                    k = f"base_model.model.{name}.{e}.{proj}"
                    sd[k + ".lora_A.weight"] = torch.randn(r, i, generator=g) * 0.3
                    sd[k + ".lora_B.weight"] = torch.randn(o, r, generator=g) * 0.3
    os.makedirs(path, exist_ok=True)
    save_file(sd, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": False, "bias": "none",
           "target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"] + TOWER_MODULES,
           "base_model_name_or_path": None, "task_type": "CAUSAL_LM", "lora_dropout": 0.0,
           "modules_to_save": None, "use_dora": False, "fan_in_fan_out": False}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def build(out, name, cls, cfg, seed, transposed_experts, scale):
    root = os.path.join(out, name)
    shutil.rmtree(root, ignore_errors=True)
    mdir, idir = os.path.join(root, "model"), os.path.join(root, "images")
    os.makedirs(mdir)
    make_images(idir)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomise(model, seed + 1, scale)
    model.save_pretrained(mdir)
    if transposed_experts:
        transpose_expert_storage(os.path.join(mdir, "model.safetensors"))
    write_tokenizer(os.path.join(out, "qwen3_moe", "model"), mdir)
    load = lambda: cls.from_pretrained(mdir, dtype=torch.float32, **EAGER).eval()
    # The reference logits come from float64 copies: transformers' own f32 logits are up to 3e-5
    # from them on these prompts (the Gated DeltaNet layers amplify rounding), which would eat
    # the 1e-4 the test allows.
    load64 = lambda: cls.from_pretrained(mdir, dtype=torch.float64, **EAGER).eval()
    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in PROCESSOR.items()
                                            if k not in ("image_processor_type", "processor_class")})

    # 3D adapter by PEFT (experts, q/o, tower), 2D adapter by hand.
    torch.manual_seed(seed + 2)
    lc = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"] + TOWER_MODULES,
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                    init_lora_weights=False)
    pm = get_peft_model(load(), lc)
    pm.save_pretrained(os.path.join(root, "adapter_3d"))
    pm64 = PeftModel.from_pretrained(load64(), os.path.join(root, "adapter_3d")).eval()
    write_2d_adapter(load(), os.path.join(root, "adapter_2d"), r=3, alpha=6, seed=seed + 3,
                     text_prefix="model.language_model")
    variants = {"base": load64(), "adapter_3d": pm64,
                "adapter_2d": merged_2d(load64, os.path.join(root, "adapter_2d"))}
    res, meta = {}, {}
    for k, (prompt, names) in enumerate(PROMPTS):
        ids, pix, grids = build_inputs(processor, idir, prompt, names)
        res[f"prompt.{k}"] = torch.tensor(ids, dtype=torch.int32)
        meta[f"images.{k}"] = json.dumps(names)
        if pix is not None:
            res[f"pixel_values.{k}"] = pix.float().contiguous()
            res[f"image_grid_thw.{k}"] = grids.to(torch.int64).contiguous()
        # Every third row and the last (the file stays small; each row depends on all before it).
        rows = sorted(set(range(0, len(ids), 3)) | {len(ids) - 1})
        res[f"rows.{k}"] = torch.tensor(rows, dtype=torch.int64)
        for v, m in variants.items():
            res[f"logits.{v}.{k}"] = logits_of(m, ids, pix, grids)[rows].contiguous()
            # Greedy continuation (each token the argmax of a full forward of all before it),
            # with a margin that f32 rounding cannot flip.
            seq = list(ids)
            for _ in range(CONTINUATION):
                last = logits_of(m, seq, pix, grids)[-1]
                top = torch.topk(last, 2).values
                assert (top[0] - top[1]).item() > 1e-3, (name, v, k, len(seq), top.tolist())
                seq.append(int(last.argmax()))
            res[f"continuation.{v}.{k}"] = torch.tensor(seq[len(ids):], dtype=torch.int32)
    # The fixture proves something only if images and adapters move the logits.
    for v in ("adapter_3d", "adapter_2d"):
        assert (res[f"logits.{v}.0"] - res["logits.base.0"]).abs().max().item() > 1e-3, v
    base = variants["base"]
    ids, pix, grids = build_inputs(processor, idir, *PROMPTS[0])
    other = pix.flip(0).contiguous()
    flipped = logits_of(base, ids, other, grids)[res["rows.0"]]
    assert (flipped - res["logits.base.0"]).abs().max().item() > 1e-3
    save_file(res, os.path.join(root, "expected_logits.safetensors"), metadata=meta)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    text = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=32, moe_intermediate_size=I,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                num_experts=E, num_experts_per_tok=2, max_position_embeddings=512,
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 2, 2], "mrope_interleaved": True})
    vl = Qwen3VLMoeConfig(text_config=text, vision_config=dict(VISION, deepstack_visual_indexes=[0, 2]),
                          image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START,
                          vision_end_token_id=VISION_END, tie_word_embeddings=False, **EAGER)
    vl.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    build(a.out, "qwen3_vl_moe_mm", Qwen3VLMoeForConditionalGeneration, vl, 700, True, 1.0)

    q35_text = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
                    linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=I,
                    shared_expert_intermediate_size=12, num_experts=E, num_experts_per_tok=2,
                    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 1],
                                     "mrope_interleaved": True})
    q35 = Qwen3_5MoeConfig(text_config=q35_text, vision_config=dict(VISION),
                           image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END, tie_word_embeddings=False, **EAGER)
    q35.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    # Smaller weights: the Gated DeltaNet layers amplify f32 rounding (transformers' own f32 and
    # f64 logits of a 117-token text prompt differ by 1.3e-4 at std 0.35/sqrt(in), 7e-6 at 0.2).
    build(a.out, "qwen3_5_moe_mm", Qwen3_5MoeForConditionalGeneration, q35, 800, False, 0.2)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "peft": peft.__version__, "pillow": Image.__version__}
    json.dump(versions, open(os.path.join(a.out, "versions_vision.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
