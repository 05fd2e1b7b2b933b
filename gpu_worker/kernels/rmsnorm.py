"""Fused residual add + RMSNorm, one program per token row.

    s            = x + residual                (rounded to x's dtype: it is the new residual)
    out          = (s * rsqrt(mean(s^2) + eps)).to(dtype) * weight
    new_residual = s

With `residual=None` it is a plain RMSNorm and new_residual is x itself. The sum of squares and
the scaling run in fp32; the rounding points follow Hugging Face's LlamaRMSNorm (normalize in
fp32, cast to the input dtype, then multiply by the weight).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._pdl import pdl_kwargs, pdl_wait
from gpu_worker.kernels._utils import check_device, next_pow2


class NormOutput(NamedTuple):
    out: torch.Tensor           # (T, hidden) normalized
    residual: torch.Tensor      # (T, hidden) the residual stream to carry to the next layer


@triton.jit
def rms_normalize(s, w, N, eps, DT: tl.constexpr):
    """fp32 row s (its N valid elements; the rest 0) -> RMSNorm(s) * w in fp32, rounded where HF's
    LlamaRMSNorm rounds (normalized row cast to DT before the weight). Shared with fp8_gemv's
    norm_out epilogue, so both give the same bits."""
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / N + eps)
    return (s * rstd).to(DT).to(tl.float32) * w


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)                  # kernels/_pdl.py: before every load and store
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)   # the residual stream keeps x's dtype
        tl.store(res_out_ptr + row * stride_ro + cols, s, mask=mask)
    else:
        s = x
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = rms_normalize(s.to(tl.float32), w, N, eps, x.dtype)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor,                 # (T, hidden) or (..., hidden), e.g. (T, heads, head_dim) for q/k norms
    weight: torch.Tensor,            # (hidden,)
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x, or None
) -> NormOutput:
    """Fused (residual add +) RMSNorm over the last dim; returns (out, new_residual) shaped like x.
    Inputs are not modified."""
    if x.dim() != 2:
        shape = x.shape
        res = None if residual is None else residual.reshape(-1, shape[-1])
        out, new_res = rmsnorm(x.reshape(-1, shape[-1]), weight, eps, res)
        return NormOutput(out.view(shape), new_res.view(shape))
    assert x.stride(-1) == 1, "x must have a unit last stride"
    T, N = x.shape
    assert weight.shape == (N,), f"weight must be ({N},), got {tuple(weight.shape)}"
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1, "residual must match x"
    check_device(x, weight, residual)
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if T == 0:
        return NormOutput(out, res_out)
    BLOCK = next_pow2(N)
    assert BLOCK <= 65536, f"hidden size {N} too large for a one-row-per-program RMSNorm"
    _rmsnorm_kernel[(T,)](
        x, residual if residual is not None else x, weight, out, res_out,
        x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0), res_out.stride(0),
        N, eps, HAS_RESIDUAL=residual is not None, BLOCK=BLOCK,
        num_warps=min(16, max(1, BLOCK // 512)), **pdl_kwargs(x),
    )
    return NormOutput(out, res_out)


def rmsnorm_ref(x, weight, eps, residual=None) -> NormOutput:
    """Plain-torch reference with the same rounding points."""
    s = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    sf = s.float()
    y = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    out = (y.to(x.dtype).float() * weight.float()).to(x.dtype)
    return NormOutput(out, s)
