"""Write this step's K/V into the paged KV cache, one program per new token.

    slot = slot_mapping[t]                       # block * block_size + offset, or < 0: skip
    k_cache[slot // block_size, slot % block_size, h, :] = k[t, h, :] / k_scale
    v_cache[slot // block_size, slot % block_size, h, :] = v[t, h, :] / v_scale

Negative slots mark padding rows (CUDA-graph batches padded up to a captured size) and are
skipped, so a padded row can never overwrite a real block. The scales are only used by an fp8
cache (float8_e4m3fn or e5m2, one scale per tensor, values saturated to the format's range);
for bf16/fp16/fp32 caches the values are stored as they are. The attention kernels multiply
the scales back in (k_scale into the logits, v_scale into the output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._utils import check_device, next_pow2


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])   # a view into per-step staging
def _kv_cache_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, inv_k_scale, inv_v_scale, fp8_max,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_SCALE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]                     # (BLOCK_H, 1)
    d = tl.arange(0, BLOCK_D)[None, :]                     # (1, BLOCK_D)
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if USE_SCALE:
        k = tl.clamp(k.to(tl.float32) * inv_k_scale, -fp8_max, fp8_max)
        v = tl.clamp(v.to(tl.float32) * inv_v_scale, -fp8_max, fp8_max)
    kc = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s + h * stride_kc_h + d
    vc = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s + h * stride_vc_h + d
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_cache_write(
    k: torch.Tensor,            # (T, num_kv_heads, head_dim)
    v: torch.Tensor,            # (T, num_kv_heads, head_dim)
    k_cache: torch.Tensor,      # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,      # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (T,) int32/int64, < 0 = skip
    k_scale: float = 1.0,        # fp8 caches only: stored = k / k_scale
    v_scale: float = 1.0,
) -> None:
    """Scatter K/V rows into their cache slots in place (see the module docstring)."""
    T, n_kv, head_dim = k.shape
    assert v.shape == k.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches: (blocks, block_size, kv_heads, head_dim)"
    assert k_cache.shape[2:] == (n_kv, head_dim), f"cache heads/dim {tuple(k_cache.shape[2:])} != k's {(n_kv, head_dim)}"
    assert slot_mapping.shape == (T,), f"slot_mapping must be ({T},), got {tuple(slot_mapping.shape)}"
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    check_device(k, v, k_cache, v_cache, slot_mapping)
    if T == 0:
        return
    fp8 = is_fp8(k_cache.dtype)
    _kv_cache_write_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        torch.finfo(k_cache.dtype).max if fp8 else 0.0,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=n_kv, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=next_pow2(n_kv), BLOCK_D=next_pow2(head_dim), USE_SCALE=fp8,
        num_warps=4,
    )


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_write_ref(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Plain-torch reference: the same scatter through a flat slot view."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kf = k_cache.view(-1, *k_cache.shape[2:])   # (num_blocks * block_size, kv_heads, head_dim)
    vf = v_cache.view(-1, *v_cache.shape[2:])
    kk, vv = k[keep], v[keep]
    if is_fp8(k_cache.dtype):
        fmax = torch.finfo(k_cache.dtype).max
        kk = (kk.float() * (1.0 / k_scale)).clamp(-fmax, fmax)
        vv = (vv.float() * (1.0 / v_scale)).clamp(-fmax, fmax)
    kf[slots] = kk.to(kf.dtype)
    vf[slots] = vv.to(vf.dtype)
