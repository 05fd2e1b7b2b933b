"""The weight-only FP8 GEMV (decode batches) against its torch reference: awkward N and K
(tails of both tiles), every M it accepts, with and without bias. On the CPU it runs under
Triton's interpreter, in a child process: TRITON_INTERPRET must be set before triton is
first imported, and other tests of this session import it without."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
CASES = [(1, 24, 1000), (2, 40, 64), (3, 2056, 520), (4, 17, 33)]

CHECK = """
import sys, torch
from gpu_worker.kernels.fp8_linear import quantize_weight_fp8
from gpu_worker.kernels.fp8_gemv import w8_gemv, w8_gemv_ref
dev = "cuda" if torch.cuda.is_available() else "cpu"
for M, N, K in {cases}:
    g = torch.Generator().manual_seed(M * 1000 + N)
    q = quantize_weight_fp8(torch.randn(N, K, generator=g))
    w, s = q.weight.to(dev), q.scale.to(dev)
    x = torch.randn(M, K, generator=g).to(dev)
    bias = torch.randn(N, generator=g).to(dev) if M % 2 else None
    y = w8_gemv(x, w, s, bias)
    ref = w8_gemv_ref(x, w, s, bias)
    err = float((y - ref).double().norm() / ref.double().norm())
    assert y.shape == (M, N) and torch.isfinite(y).all(), (M, N, K)
    assert err < 1e-5, (M, N, K, err)        # fp32 sums in another order
    print("ok", M, N, K, err)
wb = torch.randn(40, 72).to(torch.bfloat16).to(dev)          # no scale: a plain bf16 GEMV
x = torch.randn(2, 72).to(torch.bfloat16).to(dev)
y, ref = w8_gemv(x, wb, None).float(), w8_gemv_ref(x, wb, None).float()
assert float((y - ref).norm() / ref.norm()) < 1e-2, "bf16 gemv"
print("ok bf16")
"""


def test_w8_gemv_matches_reference():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", CHECK.format(cases=CASES)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == len(CASES) + 1
