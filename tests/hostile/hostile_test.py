"""Hostile clients against a running moelora-controller (tests/hostile/hostile_test.sh starts it:
the tiny Qwen3-VL-MoE, TP=1, tokens on, --max-num-seqs 4, --request-timeout-s 3, --max-lora-rank 3).

  python hostile_test.py HTTP_PORT GRPC_PORT CONTROLLER_PID ADAPTER_ROOT ADMIN_TOKEN INFERENCE_TOKEN

One case per attack (raw sockets where a client library would refuse to send it, the openai
client otherwise). After every case: /health answers within 100 ms, a greedy request gives the
tokens it gave before any case ran, and the controller's RSS stayed within +256 MiB of where it
started. Ends by stopping the controller (SIGTERM) while a kept-alive client keeps sending
requests: the script's caller checks that it exits 0. Prints one summary line (cases, checks,
peak RSS, slowest health answer).
"""

import base64
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

import openai

HTTP_PORT, GRPC_PORT, PID = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ADAPTER_ROOT, ADMIN, INFER = sys.argv[4], sys.argv[5], sys.argv[6]
MODEL = "model"  # --served-model-name's default: the model directory's name
client = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key=INFER, max_retries=0)
checks = 0
slowest_health = 0.0
peak_rss = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def rss_kib():
    with open(f"/proc/{PID}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS: the controller is gone")


def connect(timeout=60):
    s = socket.create_connection(("127.0.0.1", HTTP_PORT), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_response(s):
    """(status, headers text, body bytes) of one HTTP/1.1 answer (Content-Length or chunked)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = s.recv(65536)
        if not d:
            raise ConnectionError(f"closed before the headers: {buf[:200]!r}")
        buf += d
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {l.split(":", 1)[0].lower(): l.split(":", 1)[1].strip() for l in lines[1:] if ":" in l}
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            d = s.recv(65536)
            if not d:
                break
            rest += d
        return status, headers, rest[:n]
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in rest:
                rest += s.recv(65536)
            size_line, rest = rest.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            while len(rest) < size + 2:
                rest += s.recv(65536)
            body += rest[:size]
            rest = rest[size + 2:]
            if size == 0:
                return status, headers, body
    while True:
        d = s.recv(65536)
        if not d:
            return status, headers, rest
        rest += d


def request(method, path, body=None, token=INFER, extra="", timeout=60):
    """One request on its own connection: (status, body bytes)."""
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else b"")
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n{extra}\r\n").encode()
    with connect(timeout) as s:
        s.sendall(head)
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered (and closed) before the body: read that answer
        status, _, out = read_response(s)
        return status, out


def error_of(body):
    e = json.loads(body)["error"]  # every error is OpenAI's shape, valid JSON
    return e


def health_seconds():
    t0 = time.monotonic()
    status, _ = request("GET", "/health", token=None, timeout=5)
    dt = time.monotonic() - t0
    check(status == 200, f"/health answered {status}")
    return dt


def greedy():
    out = client.completions.create(model=MODEL, prompt=[1, 17, 42, 5], max_tokens=8, temperature=0)
    return out.choices[0].text


def metric(name, labels=""):
    status, body = request("GET", "/metrics", token=None)
    check(status == 200, "/metrics is open on the HTTP port (--http-metrics open)")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


RSS0 = rss_kib()
BASELINE = greedy()
cases = []


def case(fn):
    cases.append(fn)
    return fn


def after_case(name):
    global slowest_health, peak_rss
    dt = health_seconds()
    slowest_health = max(slowest_health, dt)
    check(dt < 0.1, f"{name}: /health took {dt * 1000:.0f} ms")
    check(greedy() == BASELINE, f"{name}: the greedy tokens changed")
    rss = rss_kib()
    peak_rss = max(peak_rss, rss)
    check(rss - RSS0 < 256 * 1024, f"{name}: RSS grew {(rss - RSS0) / 1024:.0f} MiB")


@case
def invalid_utf8_path():
    # curl --path-as-is /%FF%FE: no token (refused at the headers), then with one (404).
    with connect() as s:
        s.sendall(b"GET /%FF%FE HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, _, body = read_response(s)
    check(status == 401, f"no token: {status}")
    error_of(body)
    status, body = request("GET", "/%FF%FE")
    check(status == 404, f"with a token: {status}")
    check("\\xff\\xfe" in error_of(body)["message"], "the path is escaped in the message")
    status, body = request("GET", "/v1/models/%C3%28")
    check(status == 404, f"/v1/models/%C3%28: {status}")
    error_of(body)


@case
def grpc_stop_flood():
    # 8,000,000 empty stop strings: 16 MB on the wire, gigabytes once protobuf builds them; the
    # counts are checked on the wire first.
    body = json.dumps({"prompt_token_ids": [1, 2], "max_tokens": 2, "stop": [""] * 8000000})
    g = subprocess.run(["grpcurl", "-plaintext", "-max-msg-sz", str(1 << 30), "-H",
                        f"authorization: Bearer {INFER}", "-d", "@", f"127.0.0.1:{GRPC_PORT}",
                        "moelora.v1.Controller/Generate"],
                       input=body, capture_output=True, text=True, timeout=120)
    check("InvalidArgument" in g.stderr and "--max-stop-strings" in g.stderr, f"{g.stderr[:300]}")


@case
def nested_200000_levels():
    deep = "[" * 200000 + "]" * 200000
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "hi", "x": %s}]}'
            % (MODEL, deep)).encode()
    status, out = request("POST", "/v1/chat/completions", body)
    check(status == 400 and "deeper than" in error_of(out)["message"], f"{status} {out[:200]}")


@case
def stops_before_copies():
    for count in (200000, 2000000):
        status, out = request("POST", "/v1/completions",
                              {"model": MODEL, "prompt": [[1]] * 16, "n": 16, "stop": [""] * count})
        e = error_of(out)
        # 2,000,000 are past the body's JSON value budget already.
        check(status == 400 and (e["param"] == "stop" or "JSON values" in e["message"]),
              f"{count} stops: {status} {out[:200]}")
    status, out = request("POST", "/v1/completions",
                          {"model": MODEL, "prompt": "x", "stop": ["y" * 300]})
    check(status == 400 and "--max-stop-bytes" in error_of(out)["message"], f"{out[:200]}")
    status, out = request("POST", "/v1/completions",
                          {"model": MODEL, "prompt": [1], "stop_token_ids": [1] * 2000})
    check(status == 400 and error_of(out)["param"] == "stop_token_ids", f"{out[:200]}")


def thirty_mb_bodies(token, expect):
    results = []
    size = 30 << 20

    def one():
        try:
            status, _ = request("POST", "/v1/completions", b"x" * size, token=token, timeout=120)
            results.append(status)
        except Exception as e:  # noqa: BLE001 - a reset after an early answer is an answer too
            results.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [r for r in results if r not in expect]
    check(not bad, f"24 x 30 MB (token {token is not None}): {results}")
    return results


@case
def unauthenticated_bodies():
    thirty_mb_bodies(None, {401})


@case
def authenticated_bodies():
    # Within --http-max-client-buffered-bytes (128 MiB) four are read at once; the others 429.
    r = thirty_mb_bodies(INFER, {400, 429, 503})
    check(r.count(400) >= 1, f"some were read and refused as not JSON: {r}")


@case
def many_keys():
    keys = ",".join(f'"k{i}":0' for i in range(1200000))
    status, out = request("POST", "/v1/completions", ("{" + keys + "}").encode())
    check(status == 400 and "JSON values" in error_of(out)["message"], f"{status} {out[:200]}")
    keys = ",".join(f'"k{i}":0' for i in range(400000))
    t0 = time.monotonic()
    status, out = request("POST", "/v1/completions",
                          ('{"model": "%s", "prompt": [1, 2], "max_tokens": 2, %s}' % (MODEL, keys)).encode())
    check(status == 200, f"400k unknown keys: {status} {out[:200]}")
    check(time.monotonic() - t0 < 10, "400k keys parsed and looked up in linear time")


@case
def numbers_out_of_range():
    for body, param in (({"top_k": 2 ** 40}, "top_k"), ({"top_k": -5}, "top_k"),
                        ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
                        ({"n": 10 ** 12}, "n"), ({"seed": 2 ** 70}, "seed"),
                        ({"temperature": "hot"}, "temperature")):
        status, out = request("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", **body})
        check(status == 400 and error_of(out)["param"] == param, f"{body}: {status} {out[:200]}")


@case
def counts_before_work():
    msg = {"role": "user", "content": "hi"}
    status, out = request("POST", "/v1/chat/completions", {"model": MODEL, "messages": [msg] * 5000})
    check(status == 400 and error_of(out)["param"] == "messages", f"{out[:200]}")
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    status, out = request("POST", "/v1/chat/completions",
                          {"model": MODEL, "messages": [msg], "tools": [tool] * 600})
    check(status == 400 and error_of(out)["param"] == "tools", f"{out[:200]}")
    status, out = request("POST", "/v1/completions", {"model": MODEL, "prompt": "a" * (9 << 20)})
    check(status == 400 and "--max-prompt-bytes" in error_of(out)["message"], f"{out[:200]}")
    status, out = request("POST", "/v1/completions", {"model": MODEL, "prompt": [[1]] * 300})
    check(status == 400 and "--max-choices" in error_of(out)["message"], f"{out[:200]}")
    status, out = request("POST", "/v1/completions", {"model": MODEL, "prompt": list(range(3000))})
    check(status == 400 and error_of(out)["param"] == "prompt", f"{out[:200]}")


def blank_png(w, h):
    row = b"\x00" + b"\x00" * (w * 3)
    raw = zlib.compress(row * h, 9)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", raw) + chunk(b"IEND", b""))


@case
def image_bombs():
    png = base64.b64encode(blank_png(9000, 9000)).decode()
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}}] * 60
    t0 = time.monotonic()
    status, out = request("POST", "/v1/chat/completions",
                          {"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    check(status == 400 and "max_model_len" in error_of(out)["message"], f"{status} {out[:300]}")
    check(time.monotonic() - t0 < 10, "refused from the images' headers, none decoded")
    tiny = base64.b64encode(blank_png(1, 1)).decode()
    many = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + tiny}}] * 1000
    status, out = request("POST", "/v1/chat/completions",
                          {"model": MODEL, "messages": [{"role": "user", "content": many}]})
    check(status == 400 and "--limit-mm-per-prompt" in error_of(out)["message"], f"{out[:300]}")


LONG = {"model": MODEL, "prompt": [[1, 2, 3]] * 16, "n": 16, "max_tokens": 400, "ignore_eos": True}


@case
def unary_client_hangs_up():
    cancelled0 = metric("moelora_requests_total", 'code="cancelled"')
    s = connect()
    data = json.dumps(LONG).encode()
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {INFER}\r\n"
               f"Content-Length: {len(data)}\r\n\r\n").encode() + data)
    time.sleep(0.5)
    s.close()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if metric("moelora_requests_total", 'code="cancelled"') - cancelled0 >= 200:
            break
        time.sleep(0.1)
    got = metric("moelora_requests_total", 'code="cancelled"') - cancelled0
    check(got >= 200, f"{got:.0f} of 256 choices cancelled within 3 s of the hang-up")


def worker_pids():
    with open(f"/proc/{PID}/task/{PID}/children") as f:
        return [int(p) for p in f.read().split()]


@case
def request_timeout_on_both_apis():
    # --request-timeout-s (3 s) ends a request on either API.
    out = {}
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 400, "ignore_eos": True}

    def http():
        out["http"] = request("POST", "/v1/completions", body, timeout=60)

    def grpc():
        out["grpc"] = subprocess.run(
            ["grpcurl", "-plaintext", "-H", f"authorization: Bearer {INFER}", "-d",
             json.dumps({"prompt_token_ids": [1, 2], "max_tokens": 400, "ignore_eos": True}),
             f"127.0.0.1:{GRPC_PORT}", "moelora.v1.Controller/Generate"],
            capture_output=True, text=True, timeout=60)

    # The tiny model would finish in a fraction of a second: the worker is throttled (stopped
    # 98 ms of every 100; its health probes, 1 s deadlines, still answer) so that both outlive 3 s.
    workers = worker_pids()
    check(len(workers) == 1, f"one worker: {workers}")
    threads = [threading.Thread(target=http), threading.Thread(target=grpc)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and time.monotonic() - t0 < 30:
        os.kill(workers[0], 19)  # SIGSTOP
        time.sleep(0.098)
        os.kill(workers[0], 18)  # SIGCONT
        time.sleep(0.002)
    os.kill(workers[0], 18)
    for t in threads:
        t.join()
    status, resp = out["http"]
    check(status == 504 and "--request-timeout-s" in error_of(resp)["message"], f"HTTP: {status} {resp[:200]}")
    g = out["grpc"]
    check("DeadlineExceeded" in g.stderr, f"gRPC: rc {g.returncode} {g.stderr[:300]} {g.stdout[:100]}")
    check(time.monotonic() - t0 < 40, f"ended by the bound, not run to the end ({time.monotonic() - t0:.1f} s)")


@case
def heavy_preparation_beside_a_stream():
    times = []
    t_stream = None

    def stream():
        try:
            for _ in client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=500,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
                times.append(time.monotonic())
        except openai.APIError:
            pass  # ended by --request-timeout-s: the events before count

    t_stream = threading.Thread(target=stream)
    t_stream.start()
    while len(times) < 3 and t_stream.is_alive():
        time.sleep(0.01)
    check(len(times) >= 3, "the stream started")
    t0 = time.monotonic()
    # Six 7.5 MB prompts: tokenized on the preparation threads (two at a time), then too long for
    # the model. Were they tokenized on the threads that write answers, the stream would stop for
    # most of that time.
    results = []

    def heavy():
        results.append(request("POST", "/v1/completions",
                               {"model": MODEL, "prompt": "hello world " * (650 << 10)})[0])
    hs = [threading.Thread(target=heavy) for _ in range(6)]
    for h in hs:
        h.start()
    for h in hs:
        h.join()
    heavy_s = time.monotonic() - t0
    t_stream.join()
    during = [b - a for a, b in zip(times, times[1:]) if a >= t0 and b <= t0 + heavy_s]
    gap = max(during) if during else 0
    print(f"  heavy preparation {heavy_s:.2f} s; the stream's longest gap meanwhile {gap * 1000:.0f} ms"
          f" over {len(during)} events")
    check(results == [400] * 6, f"heavy prompts: {results}")
    check(len(during) >= 5 and gap < 0.5 * heavy_s,
          "the stream kept going while the prompts were tokenized")


@case
def hostile_adapter_files():
    def make(name, config=None, safetensors_from=None):
        d = os.path.join(ADAPTER_ROOT, name)
        os.makedirs(d, exist_ok=True)
        if config is not None:
            with open(os.path.join(d, "adapter_config.json"), "w") as f:
                json.dump(config, f)
        if safetensors_from:
            src = os.path.join(ADAPTER_ROOT, safetensors_from, "adapter_model.safetensors")
            with open(src, "rb") as f, open(os.path.join(d, "adapter_model.safetensors"), "wb") as g:
                g.write(f.read())
        return d

    good = json.load(open(os.path.join(ADAPTER_ROOT, "vl2d", "adapter_config.json")))
    os.symlink("/dev/zero", os.path.join(make("zero", safetensors_from="vl2d"), "adapter_config.json"))
    os.mkfifo(os.path.join(make("fifo", safetensors_from="vl2d"), "adapter_config.json"))
    os.mkfifo(os.path.join(make("fifo_weights", config=good), "adapter_model.safetensors"))
    make("patterns", config={**good, "rank_pattern": {f"k{i}": 3 for i in range(1000)}},
         safetensors_from="vl2d")
    for name in ("zero", "fifo", "fifo_weights", "patterns"):
        t0 = time.monotonic()
        status, out = request("POST", "/v1/load_lora_adapter",
                              {"lora_name": name, "lora_path": name}, token=ADMIN, timeout=20)
        check(status == 400, f"{name}: {status} {out[:200]}")
        check(time.monotonic() - t0 < 5, f"{name}: refused at once")
    names = [m.id for m in client.models.list()]
    check(not {"zero", "fifo", "fifo_weights", "patterns"} & set(names), f"registered: {names}")
    # Rank above --max-lora-rank: 400 over HTTP (a client must not retry it), RESOURCE_EXHAUSTED
    # over gRPC (the API's contract).
    status, out = request("POST", "/v1/load_lora_adapter",
                          {"lora_name": "big", "lora_path": "vl3d"}, token=ADMIN)
    check(status == 400 and "--max-lora-rank" in error_of(out)["message"], f"{status} {out[:200]}")
    g = subprocess.run(["grpcurl", "-plaintext", "-H", f"authorization: Bearer {ADMIN}", "-d",
                        json.dumps({"name": "big", "path": "vl3d"}), f"127.0.0.1:{GRPC_PORT}",
                        "moelora.v1.Controller/LoadAdapter"], capture_output=True, text=True, timeout=60)
    check("ResourceExhausted" in g.stderr, f"gRPC: {g.stderr[:300]}")


@case
def unloaded_adapter_leaves_metrics():
    status, out = request("POST", "/v1/load_lora_adapter",
                          {"lora_name": "tmp2d", "lora_path": "vl2d"}, token=ADMIN)
    check(status == 200, f"load: {status} {out[:200]}")
    client.completions.create(model="tmp2d", prompt=[1, 2], max_tokens=2)
    check(metric("moelora_requests_total", 'adapter="tmp2d"') >= 1, "counted under its name")
    status, out = request("POST", "/v1/unload_lora_adapter", {"lora_name": "tmp2d"}, token=ADMIN)
    check(status == 200, f"unload: {status}")
    _, body = request("GET", "/metrics", token=None)
    check(b'adapter="tmp2d"' not in body, "its series left /metrics")


@case
def a_local_process_cannot_drive_the_worker():
    # The spawned worker's plaintext port on loopback: calls without the group's secret are
    # refused (a Step with a larger epoch would otherwise take it from its controller).
    port = json.load(open(os.environ["WORKER_PORT_FILE"]))["port"]
    for method, body in (("Info", {}), ("Step", {"epoch": 2 ** 62}),
                         ("StageAdapter", {"adapter_id": 99, "path": "vl2d"})):
        g = subprocess.run(["grpcurl", "-plaintext", "-d", json.dumps(body), f"127.0.0.1:{port}",
                            f"moelora.v1.Worker/{method}"], capture_output=True, text=True, timeout=60)
        check("Unauthenticated" in g.stderr, f"{method}: rc {g.returncode} {g.stderr[:300]}")


@case
def auth_everywhere_but_health():
    status, _ = request("GET", "/v1/models", token=None)
    check(status == 401, f"models without a token: {status}")
    status, _ = request("GET", "/v1/models", token="nope")
    check(status == 401, f"unknown token: {status}")
    status, _ = request("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x"})
    check(status == 403, f"inference token on an admin route: {status}")


for fn in cases:
    t0 = time.monotonic()
    fn()
    after_case(fn.__name__)
    print(f"  {fn.__name__}: ok ({time.monotonic() - t0:.1f} s, RSS {rss_kib() / 1024:.0f} MiB)",
          flush=True)


# Shutdown while a kept-alive client keeps sending: the controller must exit 0, never abort.
stop = threading.Event()
answers = []


def keep_alive():
    try:
        with connect(10) as s:
            while not stop.is_set():
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                          + INFER.encode() + b"\r\n\r\n")
                answers.append(read_response(s)[0])
    except Exception:  # noqa: BLE001 - the server closing the connection ends this client
        pass


clients = [threading.Thread(target=keep_alive) for _ in range(4)]
for c in clients:
    c.start()
time.sleep(0.3)
os.kill(PID, 15)
time.sleep(1.5)
stop.set()
for c in clients:
    c.join()
check(200 in answers, "kept-alive clients were served before the stop")
print(f"hostile: {len(cases)} cases, {checks} checks passed; peak RSS {peak_rss / 1024:.0f} MiB "
      f"(start {RSS0 / 1024:.0f} MiB); slowest /health {slowest_health * 1000:.1f} ms")
