"""FP8 linear (Hopper): e4m3 weights with one scale per output channel, activations quantized
per token on the fly, the GEMM on cuBLASLt through torch._scaled_mm (fp32 accumulation).

    w_scale[n] = max_k |W[n, k]| / 448        W8[n, k] = e4m3(W[n, k] / w_scale[n])
    x_scale[m] = max_k |x[m, k]| / 448        x8[m, k] = e4m3(x[m, k] / x_scale[m])
    y[m, n]    = x_scale[m] * w_scale[n] * sum_k x8[m, k] * W8[n, k]   (+ bias[n])

448 is float8_e4m3fn's largest finite value, so each row uses the format's whole range. The
per-token quantization is one Triton kernel (two passes over a row: max, then scale + cast).
Where _scaled_mm is unavailable (CPU, pre-Hopper GPUs) fp8_linear dequantizes and runs a plain
matmul with the same result up to accumulation order.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._utils import check_device, next_pow2

F8 = torch.float8_e4m3fn
F8_MAX = 448.0
_MIN_SCALE = 1e-12          # an all-zero row gets this scale instead of 0 (no division by zero)


class Fp8Weight(NamedTuple):
    weight: torch.Tensor    # (N, K) float8_e4m3fn, row-major (so weight.t() is column-major for _scaled_mm)
    scale: torch.Tensor     # (N,) fp32, per output channel


def quantize_weight_fp8(w: torch.Tensor) -> Fp8Weight:
    """(N, K) bf16/fp16/fp32 weight -> e4m3 weight + per-output-channel scale (torch ops, load time)."""
    assert w.dim() == 2, f"weight must be (N, K), got {tuple(w.shape)}"
    scale = (w.float().abs().amax(dim=1) / F8_MAX).clamp_min(_MIN_SCALE)        # (N,)
    q = (w.float() / scale[:, None]).clamp(-F8_MAX, F8_MAX).to(F8)
    return Fp8Weight(q.contiguous(), scale)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, min_scale,
                       FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, min_scale)
    tl.store(scale_ptr + row, scale)
    inv = 1.0 / scale
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.clamp(x * inv, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) activations -> ((M, K) e4m3, (M, 1) fp32 scales)."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be (M, K) with unit last stride, got {tuple(x.shape)}"
    check_device(x)
    M, K = x.shape
    q = torch.empty((M, K), dtype=F8, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        BLOCK = min(4096, next_pow2(K))
        _quant_rows_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), _MIN_SCALE,
                                 FP8_MAX=F8_MAX, BLOCK=BLOCK, num_warps=4 if BLOCK <= 1024 else 8)
    return q, scale


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.float().abs().amax(dim=1, keepdim=True) / F8_MAX).clamp_min(_MIN_SCALE)   # (M, 1)
    return (x.float() * (1.0 / scale)).clamp(-F8_MAX, F8_MAX).to(F8), scale          # as the kernel does


def _scaled_mm_available(x: torch.Tensor) -> bool:
    return (x.device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ dequant(W).T (+ bias), x: (..., K) -> (..., N) in out_dtype (default x.dtype)."""
    out_dtype = out_dtype or x.dtype
    lead, K = x.shape[:-1], x.shape[-1]
    N = w.weight.shape[0]
    assert w.weight.shape == (N, K) and w.weight.dtype == F8, f"weight must be ({N}, {K}) e4m3"
    x2 = x.reshape(-1, K)
    x8, xs = quantize_per_token(x2.contiguous())
    if _scaled_mm_available(x2) and K % 16 == 0 and N % 16 == 0:
        y = torch._scaled_mm(x8, w.weight.t(), scale_a=xs, scale_b=w.scale.view(1, N), out_dtype=out_dtype)
    else:
        y = ((x8.float() * xs) @ (w.weight.float() * w.scale[:, None]).t()).to(out_dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, N)


def fp8_linear_ref(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 reference of the same maths (torch's quantizer, dequantized matmul)."""
    x8, xs = quantize_per_token_ref(x.reshape(-1, x.shape[-1]))
    y = (x8.float() * xs) @ (w.weight.float() * w.scale[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], -1)
