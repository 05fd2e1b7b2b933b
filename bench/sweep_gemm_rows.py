#!/usr/bin/env python3
"""cuBLAS bf16 GEMMs of one Llama-3.1-8B layer (and the lm_head) at the row counts of batched
decode steps: how close each is to its own floor, max(weight read at the copy ceiling, FLOPs at
the matmul ceiling). This is the profile behind the batched-decode and ShareGPT rows of
BENCHMARKS.md: a decode step of M rows runs these 4 x 32 GEMMs + the lm_head.

Timing: each weight exists in enough copies that they do not fit in L2 (50 MB); one CUDA graph
calls F.linear on every copy, so host launch gaps do not count; median of 7 replays, per call.
The ceilings are measured in the same run (an 8192^3 bf16 matmul; a 2 GB device copy).

    PYTHONPATH=. python3 bench/sweep_gemm_rows.py              # the H200, ~30 s
    PYTHONPATH=. python3 bench/sweep_gemm_rows.py --rows 64,256 --smoke   # CPU: checks the script
Writes $OUT/sweep_gemm_rows.json (OUT defaults to ./out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# (name, N, K) of Llama-3.1-8B: fused qkv, o_proj, fused gate_up, down; then the lm_head
LAYER = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
HEAD = ("lm_head", 128256, 4096)
NUM_LAYERS = 32


def ceilings(dev) -> tuple[float, float]:
    """(bf16 matmul TFLOP/s, copy GB/s) measured here."""
    from cuda_timing import event_median_ms
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = event_median_ms(lambda: a @ b, reps=10, warmup=3)
    tflops = 2 * 8192 ** 3 / ms / 1e9
    src = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms = event_median_ms(lambda: dst.copy_(src), reps=10, warmup=3)
    gbs = 2 * src.numel() / ms / 1e6            # read + write
    return tflops, gbs


def time_linear(m: int, n: int, k: int, dev, smoke: bool) -> float:
    """Microseconds of one (m, k) x (n, k)^T bf16 F.linear, weights out of L2."""
    if smoke:                                       # the flow only: shapes / 16
        n, k = n // 16, k // 16
    copies = 1 if smoke else max(2, -(-200_000_000 // (2 * n * k)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    if smoke:
        t = time.perf_counter()
        F.linear(x, ws[0])
        return 1e6 * (time.perf_counter() - t)
    from cuda_timing import graph_median_ms

    def all_copies():
        for w in ws:
            F.linear(x, w)
    return 1e3 * graph_median_ms(all_copies, inner=2, reps=7) / copies   # ms per all_copies()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,128,171,192,256,384,512,768,1024")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    peak, gbs = (1.0, 1.0) if args.smoke else ceilings(dev)
    print(f"ceilings: bf16 matmul {peak:.0f} TFLOP/s, copy {gbs:.0f} GB/s", flush=True)
    rows, table = [int(r) for r in args.rows.split(",")], []
    for m in rows:
        per, step_us, floor_us = {}, 0.0, 0.0
        for name, n, k in LAYER + [HEAD]:
            us = time_linear(m, n, k, dev, args.smoke)
            flops, nbytes = 2 * m * n * k, 2 * n * k
            floor = max(nbytes / (gbs * 1e3), flops / (peak * 1e6))          # us
            times = 1 if name == "lm_head" else NUM_LAYERS
            step_us += times * us
            floor_us += times * floor
            per[name] = {"us": round(us, 2), "tflops": round(flops / us / 1e6, 1),
                         "weight_tbs": round(nbytes / us / 1e6, 2), "of_floor": round(floor / us, 3)}
        table.append({"rows": m, "step_gemm_ms": round(step_us / 1e3, 3), "floor_ms": round(floor_us / 1e3, 3),
                      "of_floor": round(floor_us / step_us, 3), "per_gemm": per})
        print(f"M={m:5d}  GEMMs/step {step_us / 1e3:6.2f} ms  floor {floor_us / 1e3:6.2f} ms  "
              + "  ".join(f"{k} {v['us']:.0f}us {v['tflops']:.0f}TF" for k, v in per.items()), flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_gemm_rows.json").write_text(json.dumps(
        {"matmul_tflops": peak, "copy_gbs": gbs, "table": table}, indent=1))
    print("\n rows | GEMM ms/step | floor ms | share of floor")
    for r in table:
        print(f"{r['rows']:5d} | {r['step_gemm_ms']:12.2f} | {r['floor_ms']:8.2f} | {r['of_floor']:.2f}")


if __name__ == "__main__":
    main()
