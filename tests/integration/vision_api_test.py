#!/usr/bin/env python3
"""Images through the public API of a running controller (vision_api_test.sh starts it): the
upstream mixed 2D/3D test replicated with grpcurl (two images through a 2D and a 3D adapter
that both adapt the tower, beside a base request, together and in the other order), greedy
tokens against transformers' (the fixture's continuations); placeholder forms (one pad, the
exact count, text prompts); the HTTP chat API with data: URLs; refusals that change nothing.

Usage: vision_api_test.py GRPC_PORT HTTP_PORT METRICS_PORT FIXTURE_DIR MAX_IMAGES
"""
import base64
import concurrent.futures
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

from safetensors.numpy import load_file
from safetensors import safe_open

GRPC, HTTP, METRICS, FIXTURE, MAX_IMAGES = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
CONFIG = json.load(open(os.path.join(FIXTURE, "model", "config.json")))
PAD = CONFIG["image_token_id"]
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def grpc(method, body, expect_error=False):
    p = subprocess.run(["grpcurl", "-plaintext", "-d", json.dumps(body), f"localhost:{GRPC}",
                        f"moelora.v1.Controller/{method}"], capture_output=True, text=True)
    if expect_error:
        return p.returncode != 0, p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"{method}: {p.stdout}{p.stderr}")
    return json.loads(p.stdout)


def http(path, body=None):
    req = urllib.request.Request(f"http://localhost:{HTTP}{path}",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def image_b64(name):
    return base64.b64encode(open(os.path.join(FIXTURE, "images", name), "rb").read()).decode()


def one_pad(ids):
    """The prompt with each run of image pads reduced to one (the placeholder form)."""
    out = []
    for t in ids:
        if t == PAD and out and out[-1] == PAD:
            continue
        out.append(t)
    return out


expected = load_file(os.path.join(FIXTURE, "expected_logits.safetensors"))
with safe_open(os.path.join(FIXTURE, "expected_logits.safetensors"), "np") as f:
    meta = f.metadata()
prompts = []
for k in range(4):
    prompts.append({"ids": [int(x) for x in expected[f"prompt.{k}"]],
                    "images": json.loads(meta[f"images.{k}"]),
                    "continuation": {v: [int(x) for x in expected[f"continuation.{v}.{k}"]]
                                     for v in ("base", "adapter_2d", "adapter_3d")}})
ADAPTER = {"a2d": "adapter_2d", "a3d": "adapter_3d", "": "base"}


def generate(k, adapter, ids=None, max_tokens=6):
    p = prompts[k]
    body = {"adapter": adapter, "promptTokenIds": one_pad(p["ids"]) if ids is None else ids,
            "maxTokens": max_tokens, "images": [image_b64(n) for n in p["images"]]}
    return grpc("Generate", body)


# The upstream test: a 2D and a 3D adapter with tower LoRA on two images, beside the base
# model, sent together, then with the adapters' images swapped.
for order in ([(0, "a2d"), (1, "a3d"), (3, "")], [(1, "a2d"), (0, "a3d"), (3, "")]):
    with concurrent.futures.ThreadPoolExecutor(len(order)) as ex:
        outs = list(ex.map(lambda r: generate(*r), order))
    for (k, adapter), out in zip(order, outs):
        want = prompts[k]["continuation"][ADAPTER[adapter]]
        got = [int(t) for t in out.get("token_ids", [])]
        check(got == want, f"prompt {k} ({len(prompts[k]['images'])} images) through "
                           f"{adapter or 'base'} in a batch: {got} == transformers' {want}")
        check(out["usage"]["prompt_tokens"] == len(prompts[k]["ids"]),
              f"prompt {k}: usage counts the image tokens ({out['usage']['prompt_tokens']})")
    alone = [generate(k, adapter) for k, adapter in order]
    check([a.get("token_ids") for a in alone] == [o.get("token_ids") for o in outs],
          "each request alone gives what it gave in the batch")

# The pads already expanded to the image's token count are taken as they are.
out = generate(0, "a3d", ids=prompts[0]["ids"])
check([int(t) for t in out["token_ids"]] == prompts[0]["continuation"]["adapter_3d"],
      "expanded pads: the same tokens")

# A text prompt with the model's placeholder equals the same ids sent as ids.
text = "<|vision_start|><|image_pad|><|vision_end|>Look"
ids = subprocess.run([os.environ["MOELORA_TOKENIZER_BIN"], "encode", os.path.join(FIXTURE, "model")],
                     input=json.dumps(text) + "\n", capture_output=True, text=True, check=True)
ids = json.loads(ids.stdout)
a = grpc("Generate", {"prompt": text, "maxTokens": 5, "images": [image_b64("a.png")]})
b = grpc("Generate", {"promptTokenIds": ids, "maxTokens": 5, "images": [image_b64("a.png")]})
check(a["token_ids"] == b["token_ids"] and a["usage"] == b["usage"],
      f"text placeholder == ids ({a['usage']['prompt_tokens']} prompt tokens)")

# HTTP chat with a data: URL equals gRPC on the chat template's prompt.
png = image_b64("a.png")
msgs = [{"role": "user", "content": [{"type": "image_url",
                                      "image_url": {"url": f"data:image/png;base64,{png}"}},
                                     {"type": "text", "text": "What is it?"}]}]
status, chat = http("/v1/chat/completions", {"model": "a3d", "messages": msgs, "max_tokens": 5,
                                             "temperature": 0})
check(status == 200, f"chat with an image: HTTP {status} {chat if status != 200 else ''}")
rendered = subprocess.run([os.environ["MOELORA_TOKENIZER_BIN"], "chat", os.path.join(FIXTURE, "model")],
                          input=json.dumps({"messages": [{"role": "user", "content": [
                              {"type": "image"}, {"type": "text", "text": "What is it?"}]}],
                              "add_generation_prompt": True}) + "\n",
                          capture_output=True, text=True, check=True)
prompt_text = json.loads(rendered.stdout)
g = grpc("Generate", {"adapter": "a3d", "prompt": prompt_text, "maxTokens": 5, "images": [png]})
if status == 200:
    check(chat["choices"][0]["message"]["content"] == g.get("text", ""),
          f"chat text {chat['choices'][0]['message']['content']!r} == gRPC's {g.get('text', '')!r}")
    check(chat["usage"]["prompt_tokens"] == g["usage"]["prompt_tokens"], "chat prompt tokens")

# Refusals, each naming what is wrong; the service serves on.
ok, err = grpc("Generate", {"promptTokenIds": [1, PAD, 2, PAD, 3], "maxTokens": 2,
                            "images": [image_b64("a.png")]}, expect_error=True)
check(ok and "InvalidArgument" in err and "2 image placeholders" in err, "2 placeholders, 1 image")
ok, err = grpc("Generate", {"promptTokenIds": [1, PAD, 2], "maxTokens": 2,
                            "images": [base64.b64encode(b"not an image").decode()]}, expect_error=True)
check(ok and "images[0]" in err and "not a PNG, JPEG or WebP" in err, "a file that is no image")
too_many = [image_b64("a.png")] * (MAX_IMAGES + 1)
ok, err = grpc("Generate", {"promptTokenIds": [1] + [PAD, 2] * len(too_many), "maxTokens": 2,
                            "images": too_many}, expect_error=True)
check(ok and f"at most {MAX_IMAGES}" in err, f"{MAX_IMAGES + 1} images: --limit-mm-per-prompt")
ok, err = grpc("Generate", {"promptTokenIds": [1, PAD, PAD, 2], "maxTokens": 2,
                            "images": [image_b64("a.png")]}, expect_error=True)
check(ok and "give one pad or exactly that many" in err, "a run of pads of the wrong length")
status, body = http("/v1/chat/completions", {"model": "a3d", "max_tokens": 2, "messages": [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]}]})
check(status == 400 and "data: URLs" in json.dumps(body), f"a remote URL: HTTP {status}")
out = generate(1, "a2d")
check([int(t) for t in out["token_ids"]] == prompts[1]["continuation"]["adapter_2d"],
      "after the refusals the same request gives the same tokens")

metrics = urllib.request.urlopen(f"http://localhost:{METRICS}/metrics").read().decode()
images = [l for l in metrics.splitlines() if l.startswith("moelora_images_total")]
check(bool(images) and float(images[0].split()[-1]) >= 14, f"metrics: {images}")
check("moelora_image_preprocess_seconds_count" in metrics, "preprocessing time histogram")

print(f"{len(failures)} failures")
sys.exit(1 if failures else 0)
