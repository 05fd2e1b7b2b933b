"""The Triton kernels the decoder uses on CUDA (gpu_worker/kernels), or None where they cannot
run (CPU, no triton): every layer keeps its plain-torch path for that case.

    rmsnorm(x, w, eps, residual) -> (out, x + residual)   RMSNorm with the residual add fused
    rope_(positions, q, k, cos_sin)                       rotary embedding in place on q/k views
    swiglu(gate_up) -> silu(gate) * up                    one pass over the fused MLP output
    gemv(x, weight, scale, bias, residual=, norm_out=, swiglu_out=, ...)   the split-K GEMV of
                                                          decode steps of <= gemv_max_rows tokens,
                                                          with a layer's adds, norms and SwiGLU
                                                          fused in (kernels/fp8_gemv.py)
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

log = logging.getLogger(__name__)


def load_fused_kernels(device: torch.device) -> SimpleNamespace | None:
    """The kernel launchers when `device` is CUDA and they import, else None."""
    if torch.device(device).type != "cuda":
        return None
    try:
        from gpu_worker.kernels.fp8_gemv import MAX_M as gemv_max_rows, w8_gemv
        from gpu_worker.kernels.rmsnorm import rmsnorm
        from gpu_worker.kernels.rope import rope_
        from gpu_worker.kernels.swiglu import swiglu
    except Exception as e:   # no triton, or a broken kernel module: the torch path still works
        log.warning("fused Triton kernels unavailable (%s); the decoder uses plain torch ops", e)
        return None
    return SimpleNamespace(rmsnorm=rmsnorm, rope_=rope_, swiglu=swiglu, gemv=w8_gemv, gemv_max_rows=gemv_max_rows)
