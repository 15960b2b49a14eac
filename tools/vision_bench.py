#!/usr/bin/env python3
"""The peer side of bench/vision_encoder: a Qwen3-VL-MoE checkpoint whose vision tower has the
released 30B-A3B's dimensions (1152 hidden, 16 heads, 4304 MLP, patch 16, merge 2, DeepStack) and
fewer blocks, with a small text model; and transformers' timing of that tower.

    vision_bench.py make --out DIR [--depth 4]
        writes DIR/model (config.json, model.safetensors, preprocessor_config.json, random
        weights) and DIR/images/{448,1344}.png
    vision_bench.py run --dir DIR --threads N --runs R --image 448 [--dtype bfloat16]
        times model.model.visual(pixel_values, grid_thw) in the dtype on N threads (median of R
        runs after one warm-up) on the image's processor output; prints one JSON line
        {"image", "patches", "seconds": [...], "median"}
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch


def make(out, depth):
    from PIL import Image
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    mdir = os.path.join(out, "model")
    os.makedirs(mdir, exist_ok=True)
    text = dict(vocab_size=512, hidden_size=2048, intermediate_size=256, moe_intermediate_size=64,
                num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                num_experts=4, num_experts_per_tok=2, max_position_embeddings=8192,
                decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                 "mrope_section": [24, 20, 20], "mrope_interleaved": True})
    deep = [i for i in (depth // 4, depth // 2, depth - 1) if i < depth]
    vision = dict(depth=depth, hidden_size=1152, num_heads=16, intermediate_size=4304,
                  patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                  out_hidden_size=2048, num_position_embeddings=2304,
                  deepstack_visual_indexes=sorted(set(deep)), hidden_act="gelu_pytorch_tanh")
    cfg = Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=500,
                           vision_start_token_id=498, vision_end_token_id=499,
                           tie_word_embeddings=False)
    cfg.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    torch.manual_seed(0)
    model = Qwen3VLMoeForConditionalGeneration(cfg).eval()
    model.save_pretrained(mdir)
    # The released checkpoints keep the text experts transposed.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_vision_fixtures import transpose_expert_storage
    transpose_expert_storage(os.path.join(mdir, "model.safetensors"))
    json.dump({"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
               "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
               "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor"},
              open(os.path.join(mdir, "preprocessor_config.json"), "w"))
    idir = os.path.join(out, "images")
    os.makedirs(idir, exist_ok=True)
    rng = np.random.default_rng(0)
    for side in (448, 1344):
        y, x = np.mgrid[0:side, 0:side]
        img = np.stack([x * 255 // side, y * 255 // side, (x ^ y) % 256], -1)
        img = np.clip(img + rng.integers(-20, 21, img.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(os.path.join(idir, f"{side}.png"))


def run(d, threads, runs, image, dtype):
    from PIL import Image
    from transformers import Qwen3VLMoeForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.set_num_threads(threads)
    mdir = os.path.join(d, "model")
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(mdir, dtype=dt).eval()
    cfg = json.load(open(os.path.join(mdir, "preprocessor_config.json")))
    cfg.pop("image_processor_type", None)
    proc = Qwen2VLImageProcessorPil(**cfg)
    out = proc(images=[Image.open(os.path.join(d, "images", f"{image}.png"))], return_tensors="pt")
    pix, grid = out["pixel_values"].to(dt), out["image_grid_thw"]
    times = []
    with torch.no_grad():
        for i in range(runs + 1):
            t0 = time.perf_counter()
            model.model.visual(pix, grid_thw=grid)
            if i > 0:
                times.append(time.perf_counter() - t0)
    print(json.dumps({"image": image, "patches": int(pix.shape[0]), "seconds": times,
                      "median": statistics.median(times),
                      "attn_implementation": model.config.vision_config._attn_implementation}))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--depth", type=int, default=4)
    r = sub.add_parser("run")
    r.add_argument("--dir", required=True)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--runs", type=int, default=3)
    r.add_argument("--image", type=int, default=448)
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.out, a.depth)
    else:
        run(a.dir, a.threads, a.runs, a.image, a.dtype)


if __name__ == "__main__":
    main()
