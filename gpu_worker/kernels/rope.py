"""Rotary position embedding on q and k, in place (Hugging Face `rotate_half` convention).

With half = head_dim / 2, x1 = x[..., :half], x2 = x[..., half:] and, for a token at position p,
cos = cos_sin_cache[p, :half], sin = cos_sin_cache[p, half:] (angles p * inv_freq[i]):

    x[..., :half] = x1 * cos - x2 * sin
    x[..., half:] = x2 * cos + x1 * sin

The model builds the cache once (`build_cos_sin_cache`, any scaling such as llama3's folded
into inv_freq); the kernel only gathers a row per token, so positions can be anything
(chunked prefill, prefix hits, padded CUDA-graph rows).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._utils import check_device, next_pow2


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """(head_dim/2,) fp32 inverse frequencies; `scaling` is config.json's rope_scaling (llama3 or None)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return inv_freq.float()
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, llama3)")
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)   # long waves: slowed down
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)                  # in between: blended
    scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return scaled.float()


def build_cos_sin_cache(inv_freq: torch.Tensor, max_position: int, scale: float = 1.0) -> torch.Tensor:
    """(max_position, head_dim) fp32 = [cos | sin] of position * inv_freq (scale: attention_factor)."""
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq.double())  # (P, half)
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * scale).float()


@triton.jit
def _rope_rows(x_ptr, stride_t, stride_h, t, cos, sin,
               NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]                     # (BLOCK_H, 1)
    d = tl.arange(0, BLOCK_HALF)[None, :]                  # (1, BLOCK_HALF)
    mask = (h < NUM_HEADS) & (d < HALF)
    p1 = x_ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])   # positions: a view into per-step staging
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rope_rows(q_ptr, stride_qt, stride_qh, t, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rope_rows(k_ptr, stride_kt, stride_kh, t, cos, sin, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def rope_(
    positions: torch.Tensor,      # (T,) int
    q: torch.Tensor,              # (T, num_heads, head_dim), may be a strided view of a fused qkv
    k: torch.Tensor,              # (T, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, head_dim) fp32 [cos | sin], or (max_position, 2, head_dim/2)
) -> None:
    """Rotate q and k in place (see the module docstring)."""
    T, n_q, head_dim = q.shape
    if cos_sin_cache.dim() == 3:                 # (P, 2, half): the same memory as (P, [cos | sin])
        cos_sin_cache = cos_sin_cache.reshape(cos_sin_cache.shape[0], -1)
    assert k.dim() == 3 and k.shape[0] == T and k.shape[2] == head_dim, f"k {tuple(k.shape)} does not match q {tuple(q.shape)}"
    assert head_dim % 2 == 0 and cos_sin_cache.shape[1] == head_dim, \
        f"cos_sin_cache must be (max_position, {head_dim}), got {tuple(cos_sin_cache.shape)}"
    assert positions.shape == (T,), f"positions must be ({T},), got {tuple(positions.shape)}"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    check_device(positions, q, k, cos_sin_cache)
    if T == 0:
        return
    half = head_dim // 2
    _rope_kernel[(T,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=n_q, NUM_K_HEADS=k.shape[1], HALF=half,
        BLOCK_QH=next_pow2(n_q), BLOCK_KH=next_pow2(k.shape[1]), BLOCK_HALF=next_pow2(half),
        num_warps=4,
    )


def rope_ref(positions, q, k, cos_sin_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference (returns rotated copies; HF's rotate_half formula in fp32)."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache.reshape(cos_sin_cache.shape[0], -1)[positions.long()].float()           # (T, head_dim)
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None, :]   # (T, 1, head_dim)
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1)[:, None, :]

    def rotate_half(x):
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    qf, kf = q.float(), k.float()
    return ((qf * cos + rotate_half(qf) * sin).to(q.dtype), (kf * cos + rotate_half(kf) * sin).to(k.dtype))
