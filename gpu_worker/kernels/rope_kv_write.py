"""RoPE on q and k fused with the KV-cache write: one kernel per layer instead of two.

Exactly `rope_(positions, q, k, cos_sin_cache)` followed by `kv_cache_write(k, v, k_cache,
v_cache, slot_mapping, k_scale, v_scale)`, one program per token:

    q[t], k[t]  <- rotate(q[t]), rotate(k[t])           (in place, HF rotate_half, fp32 maths)
    slot = slot_mapping[t]; if slot >= 0:
        k_cache[slot] = k[t] / k_scale;  v_cache[slot] = v[t] / v_scale   (scales: fp8 caches only)

A decode step is a few hundred small kernels; fusing these two saves a launch per layer and a
re-read of k. The attention backend's `rope_kv_write` uses it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._pdl import pdl_kwargs, pdl_wait
from gpu_worker.kernels._utils import check_device, next_pow2
from gpu_worker.kernels.kv_cache_write import is_fp8, kv_cache_write_ref
from gpu_worker.kernels.rope import _rope_rows, rope_ref


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])   # views into per-step staging
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    inv_k_scale, inv_v_scale, fp8_max,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)                  # kernels/_pdl.py
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]                   # (1, BLOCK_HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rope_rows(q_ptr, stride_qt, stride_qh, t, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)

    h = tl.arange(0, BLOCK_KH)[:, None]                     # (BLOCK_KH, 1)
    mask = (h < NUM_KV_HEADS) & (d < HALF)
    pk = k_ptr + t * stride_kt + h * stride_kh + d
    k1 = tl.load(pk, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(pk + HALF, mask=mask, other=0.0).to(tl.float32)
    r1 = (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty)  # rounded as rope_ stores them
    r2 = (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty)
    tl.store(pk, r1, mask=mask)
    tl.store(pk + HALF, r2, mask=mask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        pv = v_ptr + t * stride_vt + h * stride_vh + d
        v1 = tl.load(pv, mask=mask, other=0.0)
        v2 = tl.load(pv + HALF, mask=mask, other=0.0)
        kc = k_cache_ptr + (slot // PAGE) * stride_kc_b + (slot % PAGE) * stride_kc_s + h * stride_kc_h + d
        vc = v_cache_ptr + (slot // PAGE) * stride_vc_b + (slot % PAGE) * stride_vc_s + h * stride_vc_h + d
        # New names below: a variable from before this runtime `if` must keep its type inside it.
        if USE_SCALE:
            kw1 = tl.clamp(r1.to(tl.float32) * inv_k_scale, -fp8_max, fp8_max)
            kw2 = tl.clamp(r2.to(tl.float32) * inv_k_scale, -fp8_max, fp8_max)
            vw1 = tl.clamp(v1.to(tl.float32) * inv_v_scale, -fp8_max, fp8_max)
            vw2 = tl.clamp(v2.to(tl.float32) * inv_v_scale, -fp8_max, fp8_max)
        else:
            kw1, kw2, vw1, vw2 = r1, r2, v1, v2
        tl.store(kc, kw1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(kc + HALF, kw2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, vw1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + HALF, vw2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rope_kv_write(
    positions: torch.Tensor,      # (T,) int
    q: torch.Tensor,              # (T, num_heads, head_dim), rotated in place
    k: torch.Tensor,              # (T, num_kv_heads, head_dim), rotated in place
    v: torch.Tensor,              # (T, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, head_dim) [cos | sin] fp32, or (max_position, 2, head_dim/2)
    k_cache: torch.Tensor,        # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,   # (T,), < 0 = skip the write
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """rope_ then kv_cache_write, in one launch (see the module docstring)."""
    T, n_q, head_dim = q.shape
    if cos_sin_cache.dim() == 3:
        cos_sin_cache = cos_sin_cache.reshape(cos_sin_cache.shape[0], -1)
    n_kv = k.shape[1]
    assert k.shape == (T, n_kv, head_dim) and v.shape == k.shape, "k, v must be (T, num_kv_heads, head_dim)"
    assert k_cache.shape[2:] == (n_kv, head_dim) and v_cache.shape == k_cache.shape, "caches do not match k"
    assert cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0
    assert positions.shape == (T,) and slot_mapping.shape == (T,)
    for x in (q, k, v, k_cache, v_cache, cos_sin_cache):
        assert x.stride(-1) == 1, "last dims must be contiguous"
    check_device(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    if T == 0:
        return
    fp8 = is_fp8(k_cache.dtype)
    half = head_dim // 2
    _rope_kv_write_kernel[(T,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        1.0 / k_scale, 1.0 / v_scale, torch.finfo(k_cache.dtype).max if fp8 else 0.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=n_q, NUM_KV_HEADS=n_kv, HALF=half, PAGE=k_cache.shape[1],
        BLOCK_QH=next_pow2(n_q), BLOCK_KH=next_pow2(n_kv), BLOCK_HALF=next_pow2(half), USE_SCALE=fp8,
        num_warps=4, **pdl_kwargs(q),
    )


def rope_kv_write_ref(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Reference: rope_ref then kv_cache_write_ref, in place like the kernel."""
    q_rot, k_rot = rope_ref(positions, q, k, cos_sin_cache)
    q.copy_(q_rot)
    k.copy_(k_rot)
    kv_cache_write_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
