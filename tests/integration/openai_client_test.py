"""The OpenAI-compatible HTTP API with the real `openai` client (PyPI), against a running
moelora-controller (tests/integration/openai_http_test.sh starts it with the run command's flags).

  python openai_client_test.py HTTP_PORT GRPC_PORT MODEL_DIR CONTROLLER_PID

Checks: models list; completions and chat, streamed and not, with an adapter and with the base;
the streamed text equals the unary text; greedy tokens equal gRPC Generate's (grpcurl) for the
same prompt ids; the chat prompt is the tokens of transformers' apply_chat_template; n, seeds,
stop strings, logprobs, include_usage; vLLM's load/unload endpoints; errors in OpenAI's shape
with their HTTP status; a client that leaves mid-stream cancels its request; 300 concurrent
streams open at once hold no thread each.
"""

import asyncio
import json
import os
import subprocess
import sys

import httpx2 as httpx  # the openai client's own HTTP library
import openai
from transformers import AutoTokenizer

HTTP_PORT, GRPC_PORT, MODEL_DIR, PID = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
BASE = f"http://localhost:{HTTP_PORT}"
client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)
MODEL = os.path.basename(os.path.normpath(MODEL_DIR))  # --served-model-name's default
PROMPT = "The quick brown fox"
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def grpc_generate(body):
    out = subprocess.run(["grpcurl", "-plaintext", "-d", json.dumps(body), f"localhost:{GRPC_PORT}",
                          "moelora.v1.Controller/Generate"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def stream_text(stream):
    parts, finish, usage, chunks = [], None, None, 0
    for ch in stream:
        chunks += 1
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            parts.append(c.text if hasattr(c, "text") else (c.delta.content or ""))
            finish = c.finish_reason or finish
    return "".join(parts), finish, usage, chunks


# Models: the base and every adapter, parent and root as vLLM gives them.
models = {m.id: m for m in client.models.list()}
check({MODEL, "a2d", "a3d"} <= set(models), f"models: {sorted(models)}")
check(models["a2d"].model_extra["parent"] == MODEL and models["a2d"].model_extra["root"] == "qwen3_moe/adapter_2d",
      f"a2d: {models['a2d']}")

check(client.models.retrieve("a3d").model_extra["root"] == "qwen3_moe/adapter_3d", "retrieve a3d")
try:
    client.models.retrieve("no-such-model")
    check(False, "an unknown model was retrieved")
except openai.NotFoundError:
    check(True, "")

tok = AutoTokenizer.from_pretrained(MODEL_DIR)
for model in (MODEL, "a2d", "a3d"):
    # Completions: unary == streamed; greedy tokens == gRPC Generate's for the same prompt ids.
    ids = tok.encode(PROMPT)
    r = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0, logprobs=0)
    text, finish = r.choices[0].text, r.choices[0].finish_reason
    s_text, s_finish, _, chunks = stream_text(client.completions.create(
        model=model, prompt=ids, max_tokens=12, temperature=0, stream=True))
    check(s_text == text and s_finish == finish, f"{model}: streamed {s_text!r} {s_finish} vs {text!r} {finish}")
    g = grpc_generate({"adapter": "" if model == MODEL else model, "prompt_token_ids": ids, "max_tokens": 12,
                       "return_logprobs": True})
    g_ids = [int(t) for t in g.get("tokenIds", g.get("token_ids", []))]
    check(r.usage.completion_tokens == len(g_ids) and g.get("text", "") == text,
          f"{model}: HTTP {text!r} ({r.usage.completion_tokens} tokens) vs gRPC {g.get('text')!r} {g_ids}")
    lp = r.choices[0].logprobs
    check(lp is not None and [tok.decode([i]) for i in g_ids] == lp.tokens, f"{model}: logprob tokens {lp}")
    check(all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs, g["logprobs"])), f"{model}: logprobs")
    check(r.usage.prompt_tokens == len(ids), f"{model}: usage {r.usage}")
    # A text prompt is the same prompt.
    rt = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    check(rt.choices[0].text == text, f"{model}: text prompt {rt.choices[0].text!r} vs ids {text!r}")

    # Chat: the prompt is transformers' apply_chat_template, tokenized; unary == streamed.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(chat_ids, list):  # transformers 5 returns a BatchEncoding
        chat_ids = chat_ids["input_ids"]
    c = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    check(c.usage.prompt_tokens == len(chat_ids), f"{model}: chat prompt {c.usage.prompt_tokens} vs {len(chat_ids)}")
    check(c.choices[0].message.role == "assistant", "chat role")
    s_text, s_finish, usage, _ = stream_text(client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    check(s_text == c.choices[0].message.content and s_finish == c.choices[0].finish_reason,
          f"{model}: chat streamed {s_text!r} vs {c.choices[0].message.content!r}")
    check(usage is not None and usage.completion_tokens == c.usage.completion_tokens, f"{model}: usage {usage}")
    g = grpc_generate({"adapter": "" if model == MODEL else model, "prompt_token_ids": chat_ids, "max_tokens": 10})
    check(g.get("text", "") == c.choices[0].message.content, f"{model}: chat vs gRPC {g.get('text')!r}")

# The server runs with --reasoning-parser qwen3 and the hermes tool-call parser: the checks above
# (unary == streamed == gRPC's text) hold with them on; the SDK reads the reasoning fields, null
# for the tiny model's answers (which open no <think>). Tools cannot be offered here: Qwen3's tool
# preamble alone is longer than the tiny model's 128 positions (the parsers' own HTTP test,
# ChatOutputApiTest, offers them over a scripted worker).
for model in (MODEL, "a3d"):
    w = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    extra = w.choices[0].message.model_extra or {}
    check("reasoning" in extra and extra["reasoning"] is None and extra.get("reasoning_content") is None,
          f"{model}: reasoning fields {extra}")

# n, seeds, sampling: the same seed gives the same choices; n > 1 gives n choices, in order.
a = client.completions.create(model="a2d", prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, seed=7, n=3)
b = client.completions.create(model="a2d", prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, seed=7, n=3)
check([c.index for c in a.choices] == [0, 1, 2], f"n=3 indices {[c.index for c in a.choices]}")
check([c.text for c in a.choices] == [c.text for c in b.choices], "seeded choices repeat")
check(a.usage.completion_tokens == 24, f"n=3 usage {a.usage}")
# Several prompts in one call: one choice each.
m = client.completions.create(model="a3d", prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0)
check(len(m.choices) == 2 and m.choices[0].text == client.completions.create(
    model="a3d", prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text, "two prompts")
# A stop string ends the text before it, streamed or not.
full = client.completions.create(model="a2d", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
stop = full[3:5] if len(full) >= 5 else None
if stop:
    st = client.completions.create(model="a2d", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    check(st.choices[0].text == full[:full.index(stop)] and st.choices[0].finish_reason == "stop",
          f"stop {stop!r}: {st.choices[0].text!r} from {full!r}")
    s_text, s_finish, _, _ = stream_text(client.completions.create(
        model="a2d", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True))
    check(s_text == st.choices[0].text and s_finish == "stop", f"streamed stop {s_text!r}")
# vLLM's extras.
x = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                              extra_body={"top_k": 1, "ignore_eos": True, "stop_token_ids": []})
check(x.usage.completion_tokens == 6 and x.choices[0].finish_reason == "length", f"extras {x}")

# Errors: OpenAI's shape and HTTP status, naming the parameter.
for kwargs, status, param in [
        ({"model": "no-such-adapter", "prompt": "x", "max_tokens": 2}, 404, "model"),
        ({"model": "a2d", "prompt": "x", "max_tokens": 2, "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"model": "a2d", "prompt": "x", "max_tokens": 2, "logprobs": 2}, 400, "logprobs"),
        ({"model": "a2d", "prompt": "x", "max_tokens": 100000}, 400, None),
        ({"model": "a2d", "prompt": "x", "max_tokens": 2, "n": 0}, 400, "n")]:
    try:
        client.completions.create(**kwargs)
        check(False, f"{kwargs} was accepted")
    except openai.APIStatusError as e:
        body = e.response.json()
        check(e.status_code == status and {"message", "type", "param", "code"} <= set(body["error"]),
              f"{kwargs}: {e.status_code} {body}")
        check(param is None or body["error"]["param"] == param, f"{kwargs}: param {body['error']}")
bad = httpx.post(f"{BASE}/v1/chat/completions", content=b"{not json")
check(bad.status_code == 400 and "error" in bad.json(), f"bad JSON: {bad.status_code} {bad.text}")
check(httpx.get(f"{BASE}/v1/nothing").status_code == 404, "unknown route")
check(httpx.get(f"{BASE}/v1/completions").status_code == 405, "wrong method")
check(httpx.get(f"{BASE}/health").status_code == 200, "health")
# The metrics the inference gateway's endpoint picker reads, on the serving port.
prom = httpx.get(f"{BASE}/metrics").text
check(all(m in prom for m in ("moelora_queue_depth", "moelora_running_sequences", "moelora_kv_cache_usage_ratio",
                              "moelora_lora_requests_info{")), "metrics on the HTTP port")

# vLLM's adapter endpoints: load, use, unload; a bad adapter changes nothing.
r = httpx.post(f"{BASE}/v1/load_lora_adapter", json={"lora_name": "shared", "lora_path": "qwen3_moe/adapter_2d_shared_a"})
check(r.status_code == 200 and "added successfully" in r.text, f"load: {r.status_code} {r.text}")
check("shared" in {m.id for m in client.models.list()}, "loaded adapter listed")
check(client.completions.create(model="shared", prompt=PROMPT, max_tokens=4, temperature=0).usage.completion_tokens == 4,
      "loaded adapter serves")
r = httpx.post(f"{BASE}/v1/load_lora_adapter", json={"lora_name": "shared", "lora_path": "qwen3_moe/adapter_2d_shared_a"})
check(r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", f"load twice: {r.status_code} {r.text}")
r = httpx.post(f"{BASE}/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": "qwen3_moe/model"})
check(r.status_code == 400 and "broken" not in {m.id for m in client.models.list()}, f"bad adapter: {r.text}")
r = httpx.post(f"{BASE}/v1/unload_lora_adapter", json={"lora_name": "shared"})
check(r.status_code == 200 and "removed successfully" in r.text, f"unload: {r.status_code} {r.text}")
check("shared" not in {m.id for m in client.models.list()}, "unloaded adapter gone")
r = httpx.post(f"{BASE}/v1/unload_lora_adapter", json={"lora_name": "shared"})
check(r.status_code == 404, f"unload twice: {r.status_code}")


def metric(name):
    port = json.load(open(os.environ["PORT_FILE"]))["metrics_port"]
    total = 0.0
    for line in httpx.get(f"http://localhost:{port}/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


# A client that leaves mid-stream: its request is cancelled (counted with code "cancelled").
before = metric('moelora_requests_total{adapter="a2d",code="cancelled"}')
with httpx.stream("POST", f"{BASE}/v1/completions",
                  json={"model": "a2d", "prompt": PROMPT, "max_tokens": 100, "temperature": 0,
                        "stream": True, "ignore_eos": True}) as resp:
    for line in resp.iter_lines():
        if line.startswith("data: {"):
            break
for _ in range(100):
    if metric('moelora_requests_total{adapter="a2d",code="cancelled"}') > before:
        break
    import time
    time.sleep(0.1)
check(metric('moelora_requests_total{adapter="a2d",code="cancelled"}') > before, "left stream cancelled")


# 300 streams open at once hold no thread each: the controller's thread count, sampled while
# they run, against the count before.
def threads():
    with open(f"/proc/{PID}/status") as f:
        return int(next(l for l in f if l.startswith("Threads:")).split()[1])


async def many_streams(n):
    state = {"open": 0, "peak_open": 0, "peak_threads": 0, "done": False}

    async def sample():
        while not state["done"]:
            state["peak_threads"] = max(state["peak_threads"], threads())
            await asyncio.sleep(0.01)

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n + 10)) as ac:
        async def one(i):
            body = {"model": ("a2d", "a3d", MODEL)[i % 3], "prompt": PROMPT, "max_tokens": 48,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            text = []
            async with ac.stream("POST", f"{BASE}/v1/completions", json=body) as resp:
                assert resp.status_code == 200, resp.status_code
                state["open"] += 1
                state["peak_open"] = max(state["peak_open"], state["open"])
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        break
                    if line.startswith("data: "):
                        text.append(json.loads(line[6:])["choices"][0]["text"])
                state["open"] -= 1
            return "".join(text)
        sampler = asyncio.create_task(sample())
        texts = await asyncio.gather(*[one(i) for i in range(n)])
        state["done"] = True
        await sampler
    return state, texts


base_threads = threads()
state, texts = asyncio.run(many_streams(300))
expected = {m: client.completions.create(model=m, prompt=PROMPT, max_tokens=48, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for m in ("a2d", "a3d", MODEL)}
check(all(t == expected[("a2d", "a3d", MODEL)[i % 3]] for i, t in enumerate(texts)), "300 streams' texts")
check(state["peak_open"] >= 250, f"only {state['peak_open']} streams were open at once")
check(state["peak_threads"] - base_threads < 20,
      f"{state['peak_open']} open streams: {base_threads} threads before, {state['peak_threads']} with them")
print(f"openai client: {checks} checks passed (controller threads: {base_threads} before, "
      f"{state['peak_threads']} at most with {state['peak_open']} streams open at once)")

# Bad input of every shape: a JSON error with a 4xx status each time, and the server serves on.
import random
rng = random.Random(5)
junk = [None, True, -1, 2**64, 1e308, "x", [], {}, [1, "a"], {"type": 3}, [[2**40]], "\ud7ff" * 3]
fields = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
          "stream", "stream_options", "logprobs", "top_logprobs", "stop_token_ids", "tools",
          "chat_template_kwargs", "response_format", "tool_choice", "ignore_eos", "top_k"]
statuses = {}
for i in range(300):
    body = {"model": "a2d", "max_tokens": 2}
    if i % 2:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", [{"type": "text", "text": "x"}],
                                                                    [{"type": 7}], {"a": 1}, None])}]
    else:
        body["prompt"] = rng.choice(["hi", [1, 2], [[1, 2], [3]], [2**31], [-1], [], [[]]])
    for f in rng.sample(fields, 3):
        body[f] = rng.choice(junk)
    path = "/v1/chat/completions" if i % 2 else "/v1/completions"
    r = httpx.post(f"{BASE}{path}", json=body, timeout=60)
    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    if r.status_code != 200:
        check(400 <= r.status_code < 500 and "error" in r.json(), f"{body}: {r.status_code} {r.text[:200]}")
check(httpx.get(f"{BASE}/health").status_code == 200, "serving after bad input")
check(client.completions.create(model="a2d", prompt=PROMPT, max_tokens=4, temperature=0).usage.completion_tokens == 4,
      "generating after bad input")
print(f"bad input: 300 bodies answered {dict(sorted(statuses.items()))}; {checks} checks passed")
