#!/usr/bin/env python3
"""The PyTorch wheel's libtorch on the GEMMs a CPU decode step runs, for the libtorch decision
(issue 14; docs/performance.md). Prints the same table as bench/skinny_gemm's at::mm_out column
(one GEMM per expert of one MoE layer, 32 experts of H=1024, I=512), plus a prefill GEMM, so both
libtorch builds are compared on one machine in one sitting:

  python tools/torch_ops_bench.py [--threads 2] [--rows 1,2,4,8,16,24,32,64] [--dtype float32]
  build/bench/skinny_gemm --rows ...             (Debian's libtorch 1.13 and our skinny kernel)
"""
import argparse
import time

import torch


def best(f, reps=7):
    t = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t = min(t, time.perf_counter() - t0)
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,64")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--experts", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    E, H, I = a.experts, 1024, 512
    w13 = (torch.randn(E, 2 * I, H) * 0.02).to(dt)
    w2 = (torch.randn(E, H, I) * 0.02).to(dt)
    print(f"torch {torch.__version__}, {a.threads} threads, {a.dtype}: {E} experts H {H} I {I}")
    print("| rows/expert | per-expert torch.mm ms |\n|---|---|")
    with torch.no_grad():
        for m in [int(r) for r in a.rows.split(",")]:
            x = torch.randn(E * m, H).to(dt)

            def per_expert():
                h13 = torch.empty(E * m, 2 * I, dtype=dt)
                for e in range(E):
                    torch.mm(x[e * m:(e + 1) * m], w13[e].t(), out=h13[e * m:(e + 1) * m])
                act = h13[:, :I].contiguous()
                y = torch.empty(E * m, H, dtype=dt)
                for e in range(E):
                    torch.mm(act[e * m:(e + 1) * m], w2[e].t(), out=y[e * m:(e + 1) * m])

            print(f"| {m} | {best(per_expert) * 1e3:.2f} |")
        x = torch.randn(512, H).to(dt)
        w = (torch.randn(H, H) * 0.02).to(dt)
        t = best(lambda: torch.mm(x, w.t()))
        print(f"prefill GEMM 512 x 1024 x 1024: {t * 1e3:.2f} ms ({2 * 512 * H * H / t / 1e9:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
