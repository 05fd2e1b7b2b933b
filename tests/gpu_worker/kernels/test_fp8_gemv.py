"""The split-K GEMV (fp8 weights with per-channel scales, and plain 16-bit weights) against its
torch reference: every M up to MAX_M, awkward N and K (tails of both tiles, N=1), with and
without bias, each way of handling the rows (tensor-core dot / FMA rows), each e4m3 upcast and
each split-K reduction (fused, last program reduces, two passes), plus every e4m3 code decoded
exactly. On the CPU it runs under Triton's interpreter, in a child process: TRITON_INTERPRET
must be set before triton is first imported, and other tests of this session import it without.
Inputs are fp32 holding bf16-representable values (the interpreter's bf16 dots are wrong), and
one fp16 case covers the fp16 bit upcast."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]

# One config per way of handling the rows and of reducing split-K (test_gemv_fusions.py uses them too);
# source text, for the child processes.
CFGS_SRC = r"""
# (block_n, block_k, split_k, reduce, dot, upcast, num_warps, num_stages)
CFGS = {
    "fma fused":      C(32, 64, 1, "last", False, 0, 4, 1),
    "fma last":       C(32, 32, 3, "last", False, 1, 4, 1),
    "fma two_pass":   C(64, 64, 2, "two_pass", False, 1, 4, 1),
    "dot fused":      C(64, 64, 1, "last", True, 2, 4, 2),
    "dot last":       C(64, 32, 4, "last", True, 1, 4, 2),
    "dot two_pass":   C(16, 64, 3, "two_pass", True, 0, 4, 2),
}
"""

CHECK = r"""
import torch
from gpu_worker.kernels.fp8_linear import quantize_weight_fp8
from gpu_worker.kernels.fp8_gemv import (MAX_M, PROGRAMS_PER_SM, SM_COUNT, GemvConfig as C, auto_split_k,
                                         gemv_config, w8_gemv, w8_gemv_ref)
dev = "cuda" if torch.cuda.is_available() else "cpu"
F8 = torch.float8_e4m3fn
""" + CFGS_SRC + r"""
# (M, N, K): N=1, 17 (< one tile), 257 (a tail); K=16 (< one tile), 100 (a tail), 4096 (long)
SHAPES = [(1, 257, 100), (2, 17, 100), (3, 1, 4096), (4, 17, 16), (MAX_M, 40, 160)]

def bf16_randn(*shape):
    return torch.randn(*shape).to(torch.bfloat16).float()

def check(name, x, w, s, bias, cfg, tol):
    y = w8_gemv(x, w, s, bias, config=cfg)
    ref = w8_gemv_ref(x, w, s, bias)
    err = float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    assert y.shape == ref.shape and y.dtype == x.dtype and torch.isfinite(y).all(), name
    assert err < tol, (name, err)
    print("ok", name, f"{err:.1e}")

n = 0
for M, N, K in SHAPES:
    g = torch.Generator().manual_seed(M * 1000 + N)
    q = quantize_weight_fp8(torch.randn(N, K, generator=g))
    w8, s = q.weight.to(dev), q.scale.to(dev)
    wb = bf16_randn(N, K).to(dev)                     # a 16-bit weight: plain GEMV (scale None)
    xw = bf16_randn(M, K + 8).to(dev)
    x = xw[:, :K] if M % 2 else xw[:, :K].contiguous()  # odd M: rows strided by K + 8
    bias = bf16_randn(N).to(dev)
    for i, (cname, cfg) in enumerate(CFGS.items()):
        if K >= 1024:                                 # long K: 4-8 tiles per split, not 30-60
            cfg = cfg._replace(block_k=8 * cfg.block_k)
        b = bias if (i + M) % 2 else None
        check(f"fp8 M={M} N={N} K={K} {cname} bias={b is not None}", x, w8, s, b, cfg, 1e-5)
        n += 1
        if (i + M) % 3 == 0:                          # a third of the configs per shape, all over M
            b = bias if (i // 2 + M) % 2 else None
            check(f"16bit M={M} N={N} K={K} {cname} bias={b is not None}", x, wb, None, b, cfg, 1e-5)
            n += 1
# the configs gemv_config picks (the kernel's tables / auto split) on a long K
for M in (1, 2, 4):
    x = bf16_randn(M, 4096).to(dev)
    q = quantize_weight_fp8(torch.randn(48, 4096))
    check(f"default fp8 M={M}", x, q.weight.to(dev), q.scale.to(dev), None, None, 1e-5)
    n += 1
cfg = gemv_config(1, 48, 4096, F8)                    # not in TUNED: DEFAULTS, split 0 -> auto
assert cfg.split_k == auto_split_k(48, 4096, cfg.block_n, cfg.block_k, SM_COUNT * PROGRAMS_PER_SM[cfg.dot]) > 1
# fp16 activations: the e4m3 -> fp16 bit upcast (dot) and fp16 weights
x16 = torch.randn(3, 200).half().to(dev)
q = quantize_weight_fp8(torch.randn(70, 200))
check("fp8 fp16-x dot last", x16, q.weight.to(dev), q.scale.to(dev), None, CFGS["dot last"], 2e-3)
check("fp8 fp16-x fma", x16, q.weight.to(dev), q.scale.to(dev), None, CFGS["fma last"], 2e-3)
check("fp16 w fp16-x dot", x16, torch.randn(70, 200).half().to(dev), None, None, CFGS["dot fused"], 2e-3)
n += 3
# every finite e4m3 code (subnormals, +-0, +-448) decodes exactly through each upcast
codes = torch.arange(256)
codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)                       # no NaN codes
wc = torch.zeros(codes.numel(), 32, dtype=torch.uint8)
wc[:, 5] = codes
wc = wc.view(F8).to(dev)
ones = torch.ones(codes.numel(), device=dev)
for xdt, cnames in ((torch.float32, ("fma fused", "fma last", "dot last")),     # fp32: .to / fp32 bits
                    (torch.float16, ("dot fused", "dot last", "dot two_pass"))):  # PTX / bits / .to
    x1 = torch.zeros(1, 32, dtype=xdt, device=dev)
    x1[0, 5] = 1
    for cname in cnames:
        y = w8_gemv(x1, wc, ones, config=CFGS[cname])[0].float()
        assert torch.equal(y, wc[:, 5].float()), (cname, xdt)
        n += 1
print("cases", n)
"""


def test_w8_gemv_matches_reference():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)           # set by this folder's conftest: compiled on a GPU
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "cases 52" in proc.stdout, proc.stdout[-2000:]
