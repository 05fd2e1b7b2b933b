"""SwiGLU on the fused gate_up projection's output.

    x   = [gate | up]                 (T, 2 * I): gate in the first half of each row, up in the second
    out = silu(gate) * up             (T, I),  silu(g) = g * sigmoid(g), computed in fp32
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._pdl import pdl_kwargs, pdl_wait
from gpu_worker.kernels._utils import check_device


@triton.jit
def silu_mul(g, u):
    """silu(g) * u on fp32 tiles (one rounding, by the caller); shared with fp8_gemv's swiglu_out."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _swiglu_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)                  # kernels/_pdl.py
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul(g, u)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x of shape (T, 2I); returns a new (T, I) tensor."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(-1) == 1, \
        f"x must be (T, 2*I) with unit last stride, got {tuple(x.shape)}"
    check_device(x)
    T, I = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    BLOCK = 1024
    _swiglu_kernel[(T, triton.cdiv(I, BLOCK))](x, out, x.stride(0), out.stride(0), I, BLOCK=BLOCK, num_warps=4, **pdl_kwargs(x))
    return out


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference (fp32 maths, one rounding at the end)."""
    g, u = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)
