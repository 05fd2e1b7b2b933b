"""Weight-only FP8 GEMV for decode-sized batches (M <= 4 rows): y = x @ (W8 * s).T.

    x (M, K) bf16/fp16/fp32     W8 (N, K) e4m3     s (N,) fp32     y (M, N) in x's dtype
    y[m, n] = s[n] * sum_k x[m, k] * float(W8[n, k])          (fp32 accumulation)

At batch 1 a linear layer is a pass over its weights; cuBLASLt's fp8 GEMM (torch._scaled_mm)
is built for large M and also needs the activations quantized first (another launch). This
kernel reads each weight byte once, keeps x unquantized (so it is also more accurate), and
scales in the epilogue. Grid: one program per BLOCK_N output channels; each walks K in
BLOCK_K steps, (BLOCK_M, BLOCK_N, BLOCK_K) products reduced over K in registers.

(Lives with the layers for now: the kernels helper owns gpu_worker/kernels/.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 4


@triton.jit
def _w8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)                        # (BN,)
    rm = tl.arange(0, BLOCK_M)                                        # (BM,)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)                               # (BK,)
        k_ok = rk < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)      # (BN, BK)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & k_ok[None, :], other=0.0).to(tl.float32)  # (BM, BK)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)          # (BM, BN)
    y = acc
    if HAS_SCALE:
        y = y * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & n_ok[None, :])


def w8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """(M, K) x, M <= MAX_M, unit last stride; (N, K) e4m3 weight; (N,) fp32 scale -> (M, N).
    With scale None the weight may be any float dtype (a plain GEMV, for comparisons)."""
    M, K = x.shape
    N = weight.shape[0]
    assert 1 <= M <= MAX_M and x.stride(1) == 1, f"x must be (M <= {MAX_M}, K) row-major, got {tuple(x.shape)}"
    assert weight.shape == (N, K) and weight.stride(1) == 1 and (scale is None or scale.shape == (N,))
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BLOCK_M = 1 if M == 1 else (2 if M == 2 else 4)
    BLOCK_N = 16 if N >= 2048 else 8
    BLOCK_K = 512 // BLOCK_M if K >= 512 else triton.next_power_of_2(K)
    grid = (triton.cdiv(N, BLOCK_N),)
    dummy = weight                                    # never read (HAS_SCALE/HAS_BIAS False)
    _w8_gemv_kernel[grid](x, weight, dummy if scale is None else scale, dummy if bias is None else bias,
                          y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
                          HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return y


def w8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    w = weight.float() if scale is None else weight.float() * scale[:, None]
    y = x.float() @ w.t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
