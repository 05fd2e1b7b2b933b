"""The split-K GEMV's decode-layer fusions against w8_gemv_ref: the RMSNorm prologue, the SwiGLU
prologue, the residual-add epilogue and the SwiGLU / RMSNorm epilogues (swiglu_out, norm_out),
alone and together, through each way of handling the rows (tensor-core dot / FMA rows) and each
split-K reduction (fused, last program reduces, two passes: the epilogues then run as the
SwiGLU / RMSNorm kernels after the GEMV), with 16-bit and e4m3 weights, rows 1..MAX_M, K with
and without a tile tail. On the CPU under Triton's interpreter in a child process
(TRITON_INTERPRET must be set before triton is imported); inputs are fp32 holding bf16 values (the interpreter's bf16 arithmetic is wrong). On
a GPU the same cases run, plus bf16 activations, whose roundings must match the reference's
(Hugging Face's order) to within one bf16 ulp of the output."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from test_fp8_gemv import CFGS_SRC

ROOT = Path(__file__).resolve().parents[3]

CHECK = r"""
import torch
from gpu_worker.kernels.fp8_linear import quantize_weight_fp8
from gpu_worker.kernels.fp8_gemv import MAX_M, GemvConfig as C, w8_gemv, w8_gemv_ref
dev = "cuda" if torch.cuda.is_available() else "cpu"
""" + CFGS_SRC + r"""
FUSIONS = ["norm", "swiglu", "residual", "norm+residual", "swiglu+residual",
           "swiglu_out", "norm_out", "residual+norm_out", "norm+residual+norm_out"]

def bf16_randn(*shape, g):
    return torch.randn(*shape, generator=g).to(torch.bfloat16).float()

def case(name, M, N, K, cfg, fusion, fp8, dt, tol, seed):
    g = torch.Generator().manual_seed(seed)
    if "swiglu_out" in fusion:      # N/2 a multiple of 64: the epilogue itself (two-pass: the kernel after)
        N = 128 * -(-N // 128)
    w = bf16_randn(N, K, g=g) / K ** 0.5
    s = None
    if fp8:
        q = quantize_weight_fp8(w)
        w, s = q.weight.to(dev), q.scale.to(dev)
    else:
        w = w.to(dev, dt)
    x = bf16_randn(M, 2 * K if "swiglu" in fusion.replace("swiglu_out", "") else K, g=g).to(dev, dt)
    kw = {}
    if "norm" in fusion.replace("norm_out", ""):
        kw.update(norm_weight=(1 + 0.1 * bf16_randn(K, g=g)).to(dev, dt), eps=1e-5)
    if "swiglu" in fusion.replace("swiglu_out", ""):
        kw.update(swiglu=True)
    if "swiglu_out" in fusion:
        kw.update(swiglu_out=True)
    if "norm_out" in fusion:
        kw.update(norm_out=((1 + 0.1 * bf16_randn(N, g=g)).to(dev, dt), 1e-5))
    if "residual" in fusion:
        kw.update(residual=bf16_randn(M, N, g=g).to(dev, dt))
    y = w8_gemv(x, w, s, None, config=cfg, **kw)
    ref = w8_gemv_ref(x, w, s, None, **kw)
    if "norm_out" in fusion:        # (RMSNorm(y), y): both
        assert y.out.shape == ref.out.shape and y.residual.shape == ref.residual.shape, name
        err = float((y.residual.double() - ref.residual.double()).abs().max() / ref.residual.double().abs().max())
        assert err < tol, (name, "y", err)
        y, ref = y.out, ref.out
    assert y.shape == ref.shape and y.dtype == x.dtype and torch.isfinite(y).all(), name
    err = float((y.double() - ref.double()).abs().max() / ref.double().abs().max())
    assert err < tol, (name, err)

n = 0
for i, (M, N, K) in enumerate([(1, 257, 160), (3, 17, 100), (MAX_M // 2, 40, 1024)]):
    for j, (cname, cfg) in enumerate(CFGS.items()):
        if K >= 1024:
            cfg = cfg._replace(block_k=4 * cfg.block_k)
        for k, fusion in enumerate(FUSIONS):
            if (i + j + k) % 2:                      # half the grid, every pairing covered over shapes
                continue
            fp8 = (j + k) % 3 == 0
            case(f"M={M} N={N} K={K} {cname} {fusion} fp8={fp8}", M, N, K, cfg, fusion, fp8,
                 torch.float32, 1e-5, n)
            n += 1
if dev == "cuda":                                    # bf16 activations: the roundings themselves
    for cname in ("fma last", "dot last", "dot two_pass"):
        for fusion in FUSIONS:
            case(f"bf16 {cname} {fusion}", 2, 300, 4096, CFGS[cname]._replace(block_k=256), fusion,
                 False, torch.bfloat16, 2 ** -7, n)
            n += 1
print("cases", n)
"""


def test_gemv_fusions_match_reference():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)           # set by this folder's conftest: compiled on a GPU
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    want = 81 + (27 if torch.cuda.is_available() else 0)
    assert f"cases {want}" in proc.stdout, proc.stdout[-2000:]
