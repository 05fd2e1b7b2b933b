"""Triton helpers shared by the paged attention kernels: reading K/V tiles of one sequence
through its block-table row (paged_decode_attention, the cached prefix of both prefill kernels), and
the fp32 dots' precision (F32_DOTS)."""
from __future__ import annotations

import triton
import triton.language as tl

# The attention dots' precision when q is fp32 (bf16 / fp16 dots ignore it). Triton's default, tf32,
# keeps 10 mantissa bits: on the H200 a tiny fp32 model's logits drifted 0.7-1.5% of their std from
# Hugging Face's fp32 within 74 positions. tf32x3 (three
# tf32 products on the tensor cores) is within 5e-5 there, as is "ieee" (FMA, far slower).
F32_DOTS: tl.constexpr = tl.constexpr("tf32x3")


@triton.jit
def load_tile(ptrs, rmask, dmask, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """(rows, BLOCK_D) tile; masked loads only where needed (unmasked tiles stay plain loads)."""
    if ROW_MASK:
        x = tl.load(ptrs, mask=rmask[:, None] & dmask[None, :], other=0.0)
    elif EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=dmask[None, :], other=0.0)
    return x


@triton.jit
def gather_kv_tile(bt_row, k_cache_ptr, v_cache_ptr, tok, tmask, d, dmask, g,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   PAGE: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) K and V tiles of KV head g at key positions `tok`, each found
    through the block table: slot = block_table[tok // PAGE], row tok % PAGE. MASKED: positions
    where tmask is False read zeros; else every position is valid and loads stay unmasked."""
    if MASKED:
        blk = tl.load(bt_row + tok // PAGE, mask=tmask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + tok // PAGE).to(tl.int64)
    off = tok % PAGE
    k = load_tile(k_cache_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks + g * stride_kh + d[None, :],
                  tmask, dmask, MASKED, EVEN_D)
    v = load_tile(v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + g * stride_vh + d[None, :],
                  tmask, dmask, MASKED, EVEN_D)
    return k, v
