#!/usr/bin/env python3
"""Images and what transformers' Qwen2-VL image processor makes of them, for the parity test of
moelora's image preprocessing (tests/integration/image_processor_test.sh).

    image_processor_reference.py make OUT_DIR
        writes generated test images (PNG in every Pillow mode a PNG opens as, JPEG baseline /
        progressive / grayscale / 4:4:4, WebP lossy / lossless / with alpha, broken files) of
        many sizes and aspect ratios into OUT_DIR, and OUT_DIR/configs/*/preprocessor_config.json
    image_processor_reference.py compare EXPECTED.jsonl EXPECTED.safetensors OURS.jsonl OURS.safetensors
        the parity check (exit status 1 on any difference)
    image_processor_reference.py expect CONFIG_DIR IMAGE... --out FILE
        runs Qwen2VLImageProcessorPil (the Pillow backend of transformers' Qwen2VLImageProcessor)
        with CONFIG_DIR's preprocessor_config.json on each image opened by Pillow, one at a
        time; writes FILE (safetensors: pixel_values.<i>, image_grid_thw.<i>) and prints one JSON
        line per image: {"file", "image_grid_thw"} or {"file", "error"}
"""
import argparse
import io
import json
import os
import sys

import numpy as np


def make(out):
    from PIL import Image

    rng = np.random.default_rng(7)
    os.makedirs(out, exist_ok=True)

    def content(h, w, channels):
        # Smooth gradients plus noise: resampling changes every pixel, edges included.
        y, x = np.mgrid[0:h, 0:w]
        base = [(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 7) % 256]
        planes = [np.clip(base[c % 3] + rng.integers(-40, 41, (h, w)), 0, 255) for c in range(channels)]
        return np.stack(planes, -1).astype(np.uint8)

    sizes = [(1, 1), (7, 300), (300, 7), (33, 65), (64, 64), (100, 150), (257, 129), (375, 500),
             (96, 1000), (1000, 5), (480, 640)]
    for h, w in sizes:
        Image.fromarray(content(h, w, 3), "RGB").save(f"{out}/rgb_{h}x{w}.png")
    Image.fromarray(content(90, 120, 4), "RGBA").save(f"{out}/rgba_90x120.png")
    Image.fromarray(content(61, 47, 1)[..., 0], "L").save(f"{out}/l_61x47.png")
    Image.fromarray(content(61, 47, 2), "LA").save(f"{out}/la_61x47.png")
    Image.fromarray(content(40, 70, 1)[..., 0] > 128).save(f"{out}/1bit_40x70.png")
    p = Image.fromarray(content(50, 80, 3), "RGB").quantize(colors=37)
    p.save(f"{out}/p_50x80.png")
    p.save(f"{out}/p_trns_50x80.png", transparency=5)
    Image.fromarray(content(45, 33, 1)[..., 0], "L").save(f"{out}/l_trns_45x33.png", transparency=128)
    Image.fromarray(content(30, 50, 3), "RGB").save(f"{out}/rgb_trns_30x50.png",
                                                     transparency=(10, 20, 30))
    i16 = (content(36, 52, 1)[..., 0].astype(np.uint16) * 3)
    Image.fromarray(i16).save(f"{out}/i16_36x52.png")
    rgb = content(123, 211, 3)
    Image.fromarray(rgb, "RGB").save(f"{out}/jpeg_123x211.jpg", quality=90)
    Image.fromarray(rgb, "RGB").save(f"{out}/jpeg444_123x211.jpg", quality=95, subsampling=0)
    Image.fromarray(rgb, "RGB").save(f"{out}/jpeg_prog_123x211.jpg", quality=80, progressive=True)
    Image.fromarray(rgb[..., 0], "L").save(f"{out}/jpeg_gray_123x211.jpg", quality=90)
    Image.fromarray(content(600, 800, 3), "RGB").save(f"{out}/jpeg_600x800.jpg", quality=85)
    Image.fromarray(rgb, "RGB").save(f"{out}/webp_lossy_123x211.webp", quality=80)
    Image.fromarray(rgb, "RGB").save(f"{out}/webp_lossless_123x211.webp", lossless=True)
    Image.fromarray(content(77, 55, 4), "RGBA").save(f"{out}/webp_alpha_77x55.webp", lossless=True)
    # Broken files: both sides must refuse them.
    whole = open(f"{out}/rgb_100x150.png", "rb").read()
    open(f"{out}/bad_truncated.png", "wb").write(whole[: len(whole) // 2])
    whole = open(f"{out}/jpeg_123x211.jpg", "rb").read()
    open(f"{out}/bad_truncated.jpg", "wb").write(whole[: len(whole) // 2])
    open(f"{out}/bad_random.bin", "wb").write(rng.integers(0, 256, 500, dtype=np.uint8).tobytes())
    Image.fromarray(content(1, 250, 3), "RGB").save(f"{out}/bad_ratio_1x250.png")

    configs = {
        # Qwen3-VL / Qwen3.5 as released (preprocessor_config.json of Qwen3-VL-30B-A3B).
        "qwen3_vl": {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                     "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                     "image_std": [0.5, 0.5, 0.5],
                     "image_processor_type": "Qwen2VLImageProcessor"},
        # Small bounds: most images shrink (the filter's support widens), odd patch size.
        "small": {"min_pixels": 1024, "max_pixels": 20000, "patch_size": 6,
                  "temporal_patch_size": 1, "merge_size": 2, "resample": 3,
                  "image_processor_type": "Qwen2VLImageProcessor"},
        # The class defaults (Qwen2-VL: patch 14, CLIP mean/std); bilinear.
        "defaults": {"resample": 2, "image_processor_type": "Qwen2VLImageProcessor"},
    }
    for name, cfg in configs.items():
        os.makedirs(f"{out}/configs/{name}", exist_ok=True)
        json.dump(cfg, open(f"{out}/configs/{name}/preprocessor_config.json", "w"), indent=1)


def expect(config_dir, images, out):
    from PIL import Image
    from safetensors.numpy import save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = json.load(open(f"{config_dir}/preprocessor_config.json"))
    cfg.pop("image_processor_type", None)
    processor = Qwen2VLImageProcessorPil(**cfg)
    tensors = {}
    for i, path in enumerate(images):
        line = {"file": path}
        try:
            with Image.open(path) as image:
                image.load()
                result = processor(images=[image], return_tensors="np")
            tensors[f"pixel_values.{i}"] = np.ascontiguousarray(result["pixel_values"], np.float32)
            tensors[f"image_grid_thw.{i}"] = np.ascontiguousarray(result["image_grid_thw"], np.int64)
            line["image_grid_thw"] = result["image_grid_thw"][0].tolist()
        except Exception as e:  # noqa: BLE001 - any refusal counts
            line["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(line))
    save_file(tensors, out)


def compare(expected_jsonl, expected_file, ours_jsonl, ours_file):
    """Exit status 1 unless moelora refused exactly the images transformers refused and gave
    every other image the same grid and the same pixel_values (bit for bit)."""
    from safetensors.numpy import load_file

    want = [json.loads(l) for l in open(expected_jsonl)]
    got = [json.loads(l) for l in open(ours_jsonl)]
    expected = load_file(expected_file)
    ours = load_file(ours_file) if os.path.getsize(ours_file) > 0 else {}
    failures, row, same = [], 0, 0
    for i, (w, g) in enumerate(zip(want, got)):
        name = os.path.basename(w["file"])
        if ("error" in w) != ("error" in g):
            failures.append(f"{name}: transformers {w.get('error', 'accepts it')}, moelora "
                            f"{g.get('error', 'accepts it')}")
            continue
        if "error" in w:
            same += 1
            continue
        if w["image_grid_thw"] != g["image_grid_thw"]:
            failures.append(f"{name}: grid {g['image_grid_thw']} != {w['image_grid_thw']}")
            continue
        n = int(np.prod(g["image_grid_thw"]))
        ref = expected[f"pixel_values.{i}"]
        mine = ours["pixel_values"][row:row + n]
        row += n
        if mine.shape != ref.shape or not np.array_equal(mine, ref):
            diff = np.abs(mine - ref).max() if mine.shape == ref.shape else "shape"
            failures.append(f"{name}: pixel_values differ (max |diff| {diff}, "
                            f"{int((mine != ref).sum()) if mine.shape == ref.shape else '-'} values)")
            continue
        same += 1
    for f in failures:
        print("MISMATCH", f)
    print(f"{same} of {len(want)} images identical (refusals included)")
    return 1 if failures or len(want) != len(got) else 0


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out")
    e = sub.add_parser("expect")
    e.add_argument("config_dir")
    e.add_argument("images", nargs="+")
    e.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("expected_jsonl")
    c.add_argument("expected")
    c.add_argument("ours_jsonl")
    c.add_argument("ours")
    a = ap.parse_args()
    if a.cmd == "compare":
        return compare(a.expected_jsonl, a.expected, a.ours_jsonl, a.ours)
    if a.cmd == "make":
        make(a.out)
    else:
        expect(a.config_dir, a.images, a.out)


if __name__ == "__main__":
    sys.exit(main())
