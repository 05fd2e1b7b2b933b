#!/usr/bin/env python3
"""The decode layer at batch 1..4 as four fused GEMVs (gpu_worker/kernels/fp8_gemv.py: RMSNorm and
SwiGLU prologues, residual-add epilogues) against the unfused sequence the decoder runs otherwise,
per Llama-3.1-8B layer, with bf16 and fp8 weights:

    unfused  add+RMSNorm kernel, qkv GEMM | o_proj GEMM | add+RMSNorm, gate_up GEMM | SwiGLU kernel,
             down GEMM    (GEMM = cuBLAS for bf16 and our plain GEMV; our plain GEMV for fp8)
    fused    qkv(norm) | o_proj(+residual) | gate_up(norm) | down(swiglu, +residual), each with
             the config families below (split-K auto) and the plain GEMV's tuned config

Every fused variant is checked against w8_gemv_ref first (rel. error < 1e-2). Timing as
bench/sweep_gemv.py (its Timer): the op over >= 4 weight copies (> 200 MB) inside one CUDA graph,
median of 7 replays, per call. Prints a row per variant, then per (weights, M) the layer sums
and the FUSED_TUNED entries to paste into fp8_gemv.py; writes $OUT/sweep_gemv_fusions.json.

    PYTHONPATH=. python3 bench/sweep_gemv_fusions.py            # the H200 (~2 min)
    PYTHONPATH=. python3 bench/sweep_gemv_fusions.py --smoke    # CPU, TRITON_INTERPRET=1, toy sizes
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# layer -> (N, K, fusion): fusion is what the decoder fuses into that GEMV
LAYERS = {"qkv": (6144, 4096, "norm"), "o_proj": (4096, 4096, "res"),
          "gate_up": (28672, 4096, "norm"), "down": (4096, 14336, "swiglu+res")}
SMOKE_LAYERS = {"qkv": (48, 64, "norm"), "o_proj": (32, 48, "res"), "gate_up": (96, 64, "norm"),
                "down": (32, 48, "swiglu+res")}
L2_BYTES = 220e6
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def families(kind: str, M: int):
    """Config families (split-K auto); FMA rows for M <= 2 only; fp8 dots with the PTX upcast."""
    from gpu_worker.kernels.fp8_gemv import GemvConfig as C
    up = 2 if kind == "fp8" else 0
    fam = {"fma16x256": C(16, 256, 0, "last", False, 0, 4, 1), "fma16x512": C(16, 512, 0, "last", False, 0, 4, 1),
           "fma16x1024": C(16, 1024, 0, "last", False, 0, 4, 1), "dot32x256": C(32, 256, 0, "last", True, up, 4, 3),
           "dot64x128": C(64, 128, 0, "last", True, up, 4, 4)}
    return {k: v for k, v in fam.items() if v.dot or M <= 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, toy sizes")
    ap.add_argument("--ms", default="1,2,4", help="comma list of rows M")
    ap.add_argument("--time-budget", type=float, default=150.0, help="seconds; later variants are skipped")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as F
    from gpu_worker.kernels import fp8_gemv as G
    from gpu_worker.kernels.fp8_linear import quantize_weight_fp8
    from gpu_worker.kernels.rmsnorm import rmsnorm, rmsnorm_ref
    from gpu_worker.kernels.swiglu import swiglu, swiglu_ref
    from sweep_gemv import Timer, cfg_str, rel_err

    smoke, dev = args.smoke, ("cpu" if args.smoke else "cuda")
    layers = SMOKE_LAYERS if smoke else LAYERS
    xdt = torch.float32 if smoke else torch.bfloat16
    if smoke:                               # the interpreter has no Triton norm / SwiGLU launches here
        rmsnorm, swiglu = rmsnorm_ref, swiglu_ref
    end = T0 + args.time_budget
    timer, g = Timer(smoke), torch.Generator(device="cpu").manual_seed(0)
    rows, sums, tuned = [], {}, {}

    def timed(fn, copies):
        return timer(fn, copies)[0] if time.time() < end else float("nan")

    for kind in ("bf16", "fp8"):
        for M in map(int, args.ms.split(",")):
            acc = sums.setdefault((kind, M), {"unfused cuBLAS": 0.0, "unfused GEMV": 0.0, "fused": 0.0})
            for name, (N, K, fusion) in layers.items():
                wb = (torch.randn(N, K, generator=g) / K ** 0.5).to(xdt)
                copies = 1 if smoke else max(4, int(L2_BYTES / (N * K * (1 if kind == "fp8" else 2))) + 1)
                if kind == "fp8":
                    q = quantize_weight_fp8(wb.float())
                    ws = [(q.weight.to(dev).clone(), q.scale.to(dev)) for _ in range(copies)]
                else:
                    ws = [(wb.to(dev).clone(), None) for _ in range(copies)]
                x_in = torch.randn(M, 2 * K if "swiglu" in fusion else K, generator=g).to(dev, xdt)
                kw = {}
                if fusion == "norm":
                    kw = dict(norm_weight=(1 + 0.1 * torch.randn(K, generator=g)).to(dev, xdt), eps=1e-5)
                elif "swiglu" in fusion:
                    kw = dict(swiglu=True)
                if "res" in fusion:
                    kw["residual"] = torch.randn(M, N, generator=g).to(dev, xdt)
                ref = G.w8_gemv_ref(x_in, *ws[0], None, **kw)
                # the unfused neighbours: add+RMSNorm before qkv / gate_up, SwiGLU before down
                res_in = torch.randn(M, K, generator=g).to(dev, xdt)
                side = 0.0
                if fusion == "norm":
                    side = timed(lambda i: rmsnorm(x_in, kw["norm_weight"], 1e-5, res_in).out, copies)
                elif "swiglu" in fusion:
                    side = timed(lambda i: swiglu(x_in), copies)
                plain_x = x_in[:, :K].contiguous()
                t_gemv = timed(lambda i: G.w8_gemv(plain_x, *ws[i]), copies)
                t_cublas = (timed(lambda i: F.linear(plain_x, ws[i][0]), copies) if kind == "bf16"
                            else t_gemv)
                best = (float("inf"), None, "")
                cands = dict(families(kind, M), tuned=G.gemv_config(M, N, K, ws[0][0].dtype))
                for label, cfg in cands.items():
                    cfg = G.resolve_split(cfg, N, K)
                    fn = lambda i, cfg=cfg: G.w8_gemv(x_in, *ws[i], config=cfg, **kw)   # noqa: E731
                    try:
                        err = rel_err(fn(0), ref)
                        us = timed(fn, copies) if err < 1e-2 else float("nan")
                    except Exception as e:                    # a config that cannot compile: noted
                        err, us = float("nan"), float("nan")
                        log(f"{kind} M={M} {name} {label}: {type(e).__name__}: {e}"[:300])
                    rows.append(dict(kind=kind, M=M, layer=name, variant=label, config=list(cfg), us=us, err=err))
                    log(f"{kind} M={M} {name:8s} fused {label:10s} {us:7.2f} us  err {err:.1e}")
                    if us < best[0]:
                        best = (us, cfg, label)
                log(f"{kind} M={M} {name:8s} unfused: side kernel {side:.2f} us + cuBLAS {t_cublas:.2f} / "
                    f"GEMV {t_gemv:.2f} us; fused best {best[0]:.2f} us ({best[2]})")
                acc["unfused cuBLAS"] += side + t_cublas
                acc["unfused GEMV"] += side + t_gemv
                acc["fused"] += best[0]
                if best[1] is not None:
                    tuned[(kind, M, N, K, fusion)] = (best[1], best[0])
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_gemv_fusions.json").write_text(json.dumps(dict(
        rows=rows, sums={f"{k} M={m}": v for (k, m), v in sums.items()}), indent=1))
    print("\nFUSED_TUNED entries (paste into fp8_gemv.py):")
    for (kind, M, N, K, fusion), (cfg, us) in tuned.items():
        wk = "fp8" if kind == "fp8" else "16bit"
        print(f'    ("{wk}", {M}, {N}, {K}, "{fusion}"): {cfg_str(cfg)},  # {us:.2f} us')
    print("\nper layer, us (four GEMVs with their side kernels):")
    print(f"{'weights':8s} {'M':>2s} {'unfused cuBLAS':>15s} {'unfused GEMV':>13s} {'fused':>8s}")
    for (kind, M), v in sums.items():
        print(f"{kind:8s} {M:2d} {v['unfused cuBLAS']:15.1f} {v['unfused GEMV']:13.1f} {v['fused']:8.1f}")


if __name__ == "__main__":
    main()
