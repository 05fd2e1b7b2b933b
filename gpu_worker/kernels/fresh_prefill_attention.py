"""Causal attention of a step's prompt rows: q and this step's K/V read through TMA, a cached
prefix (when there is one) through the block table.

Sequence b contributes rows query_start_loc[b] .. query_start_loc[b+1] of q, k and v (q_len
rows). Without `prefix` (fresh prompts) the rows sit at positions 0 .. q_len-1 and row i attends
to the rows j <= i of its own sequence:

    out[r, h] = sum_{j <= i} softmax_j(scale * <q[r, h], k[s + j, g]>) v[s + j, g],
                r = s + i,  s = query_start_loc[b],  g = h // G

With `prefix` (CachedPrefix: chunks that continue a sequence, prefix-cache hits) the rows are the
last q_len of context_lens[b] tokens: row i also attends to the P = context_len - q_len cached
keys before them, gathered page by page through block_tables[b] (an fp8 cache with its per-tensor
scales, as paged_prefill_attention reads it), and this step's own keys come from k / v as above.

This is paged_prefill_attention's v2 case stripped to what these steps need: every tile of q and
of this step's K/V comes through a TMA descriptor, each program finds its sequence with one load
from a tile map made once per step (v2 scans the sequences' tile starts), no sliding window. Per
program: the prefix's full key tiles (cache_tiles, no masks), its partial last tile, then this
step's key tiles wholly below the query tile's diagonal without masks, then the diagonal ones with
the causal mask. Fresh prompts compile without the prefix loops: 140 registers where v2 needs 210
(64 x 64 tiles); on the H200 it runs 8 x 2k prompts at 1.14x v2's speed, 32 x 512 at 1.33x, 1 x 8k
at 1.07x, but 1 x 32k at 0.98x, so the engine takes it for steps of up to 8,192 query tokens
(fresh_config). Behind a prefix the key tiles are mostly gathered, as in v2, and it runs
1.00-1.03x v2 at the same tiles; with fresh_config's PREFIX_CONFIG (128 x 128 tiles where the keys
are mostly cached) it runs 1.06-1.10x v2's defaults on 512-2k chunks behind 1.5-6k cached tokens,
1.03x on a serving step, 1.00x on 8k behind 24k (H200).

Query tiles are numbered across sequences on the device (fresh_tile_map: tile starts and each
tile's sequence, no host sync), longest-first within a sequence; the grid is a host-side bound
(CUDA-graph safe). Rows with query_len 1 (decode rows of a mixed step) are left to the decode
kernel when skip_decode_rows. The Triton backend takes it for every prefill step of up to 8,192
query tokens without a sliding window on rows TMA can read (Hopper), except chunks of <= 16
tokens behind a prefix (v2's 16-row tiles); anything else goes to paged_prefill_attention.

Tried and dropped: Triton 3.6's Hopper warp specialization
(tl.range(warp_specialize=True), FlashAttention-3's producer / two-consumer layout). Its pass
accepts only one key loop with every load a TMA load and no early return; the kernels it then
built hung on the H200 or returned NaN.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._paged_kv import F32_DOTS
from gpu_worker.kernels._utils import check_device, next_pow2
from gpu_worker.kernels.paged_prefill_attention import (LOG2E, cache_tiles, online_softmax, paged_prefill_attention_ref,
                                                        prefill_tile_starts, row_descriptor, tma_ok)


class FreshConfig(NamedTuple):
    """Launch configuration: query rows and keys per tile, warps, pipeline depth."""
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


# Default by max_query_len (the first bound >= it); longer prompts have none: paged_prefill_attention's
# 128 x 128 TMA kernel is as fast there. Set from bench/sweep_prefill_attention.py --only-fresh on
# the H200 (2026-12-02), TFLOP/s against v2's defaults in the same call:
# 8 x 2k 483.6 vs 423.1, 32 x 512 289.6 vs 218.5 (64 x 64); 1 x 8k 585.7 vs 549.4, 1 x 32k 549.7 vs
# 559.6 (128 x 128, 8 warps).
FRESH_CONFIGS: list[tuple[int, FreshConfig]] = [
    (4096, FreshConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)),
    (8192, FreshConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)),
]
# Steps whose keys are mostly cached (max_context_len >= 2 x max_query_len) read most tiles through
# the block table, where 128 x 128 tiles win at every chunk length (H200, 2026-12-03, TFLOP/s
# against the 64 x 64 tiles): 2k behind 6k 397.3 vs 368.6, 8 x 2k behind 2k 425.7 vs 392.5, 32 x 512
# behind 1.5k 362.9 vs 346.7; a serving step's 1k chunk behind 512 (+ 60 decode rows) keeps 64 x 64
# (336.2 vs 325.9).
PREFIX_CONFIG = FreshConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


def fresh_config(max_query_len: int, max_context_len: int = 0) -> FreshConfig | None:
    """The launch configuration for a step, or None where paged_prefill_attention is faster
    (host ints only; max_context_len: the step's longest context, cached prefix included)."""
    for bound, cfg in FRESH_CONFIGS:
        if max_query_len <= bound:
            return PREFIX_CONFIG if max_context_len >= 2 * max_query_len else cfg
    return None


class CachedPrefix(NamedTuple):
    """The paged cache behind a step's rows, for chunks that continue a sequence: sequence b's
    first context_lens[b] - q_len_b positions are read through block_tables[b] (pages of
    k_cache.shape[1] tokens); an fp8 cache holds K / k_scale and V / v_scale."""
    k_cache: torch.Tensor        # (num_blocks, page, num_kv_heads, head_dim)
    v_cache: torch.Tensor
    block_tables: torch.Tensor   # (B, max_blocks) int32
    context_lens: torch.Tensor   # (B,) int32, this step's tokens included
    k_scale: float = 1.0
    v_scale: float = 1.0


class FreshTiles(NamedTuple):
    """One step's query tiles: tile_starts (B+1,) prefix sums, tile_seq (bound,) owner of each."""
    tile_starts: torch.Tensor
    tile_seq: torch.Tensor


def grid_bound(num_seqs: int, num_tokens: int, block_m: int) -> int:
    """Host-side bound on a step's query tiles: sum(ceil(q_len / block_m)) <= T / block_m + B."""
    return triton.cdiv(num_tokens, block_m) + num_seqs


def fresh_tile_map(query_start_loc: torch.Tensor, block_m: int, num_tokens: int,
                   skip_decode_rows: bool = True) -> FreshTiles:
    """Number every sequence's query tiles on the device, once per step: tile_seq[t] is the
    sequence owning tile t for t < tile_starts[-1] (the entries past it are never read); its
    length is grid_bound(B, num_tokens, block_m), the launch's grid."""
    starts = prefill_tile_starts(query_start_loc, block_m, skip_decode_rows)       # (B+1,)
    bound = grid_bound(query_start_loc.shape[0] - 1, num_tokens, block_m)
    items = torch.arange(bound, device=starts.device, dtype=torch.int32)         # (bound,)
    tile_seq = torch.searchsorted(starts[1:].contiguous(), items, right=True).to(torch.int32)
    return FreshTiles(starts, tile_seq)


@triton.jit
def _attend(q, m, l, acc, lo, hi, qi, q_start, g, kn_desc, vn_desc, qk_scale,
            HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Fold this sequence's key tiles lo .. hi-1 into (m, l, acc), log2 domain. CAUSAL: row qi
    sees keys j <= qi; else every key is visible to every row. Tiles may run past q_len into the
    next sequence's rows (or TMA's zeros past T): the causal mask hides them from every row <
    q_len, and rows >= q_len are never stored. Their values must be finite all the same (p = 0
    times NaN is NaN): a padded prefill graph's rows are zeroed by the backend (padded_rows)."""
    for n0 in range(lo, hi, BLOCK_N):
        k = kn_desc.load([q_start + n0, g * HEAD_DIM])      # (BLOCK_N, HEAD_DIM)
        v = vn_desc.load([q_start + n0, g * HEAD_DIM])
        s = tl.dot(q, tl.trans(k), input_precision=F32_DOTS)   # (BLOCK_M, BLOCK_N) raw logits
        if CAUSAL:
            j = n0 + tl.arange(0, BLOCK_N)
            s = tl.where(j[None, :] <= qi[:, None], s, float("-inf"))
        # no guard: key 0 is in every row's view, so no row's running max stays -inf
        m, l, acc = online_softmax(q, s, v, m, l, acc, qk_scale, 1.0, False, False)
    return m, l, acc


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"],
            do_not_specialize_on_alignment=["qsl_ptr", "tile_start_ptr", "tile_seq_ptr", "bt_ptr", "ctx_ptr"])
def _fresh_prefill_kernel(
    q_desc, kn_desc, vn_desc, out_ptr, qsl_ptr, tile_start_ptr, tile_seq_ptr, num_seqs, qk_scale,
    stride_ot, stride_oh,
    k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, qk_scale_cache, v_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_PREFIX: tl.constexpr, PAGE: tl.constexpr, SCALE_V: tl.constexpr,
):
    h = tl.program_id(0)                                     # query head
    item = tl.program_id(1)                                  # a query tile of some sequence
    if item >= tl.load(tile_start_ptr + num_seqs):
        return                                               # the grid is an upper bound
    b = tl.load(tile_seq_ptr + item)
    mb = tl.load(tile_start_ptr + b + 1) - 1 - item          # a sequence's last (longest) tiles first
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    g = h // GROUP
    t0 = mb * BLOCK_M                                        # first row of the tile
    qi = t0 + tl.arange(0, BLOCK_M)                          # (BLOCK_M,) row index in this step's rows
    q = q_desc.load([q_start + t0, h * HEAD_DIM])            # (BLOCK_M, HEAD_DIM); rows >= q_len: not ours
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    if HAS_PREFIX:               # the cached prefix (positions < prefix): visible to every row
        prefix = tl.load(ctx_ptr + b) - q_len
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        full_p = (prefix // BLOCK_N) * BLOCK_N
        m, l, acc = cache_tiles(q, m, l, acc, 0, full_p, qi, 0, bt_row, k_cache_ptr, v_cache_ptr, g,
                                qk_scale_cache, v_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                stride_vh, HEAD_DIM, HEAD_DIM, BLOCK_N, PAGE,
                                False, False, False, SCALE_V, True)                      # full tiles
        m, l, acc = cache_tiles(q, m, l, acc, full_p, prefix, qi, 0, bt_row, k_cache_ptr, v_cache_ptr, g,
                                qk_scale_cache, v_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                stride_vh, HEAD_DIM, HEAD_DIM, BLOCK_N, PAGE,
                                True, False, False, SCALE_V, True)                       # the partial tail
    full = (t0 // BLOCK_N) * BLOCK_N                         # this step's keys below: visible to every row
    end = tl.minimum(q_len, t0 + BLOCK_M)                    # keys at/after: visible to none
    m, l, acc = _attend(q, m, l, acc, 0, full, qi, q_start, g, kn_desc, vn_desc, qk_scale,
                        HEAD_DIM, BLOCK_N, False)
    m, l, acc = _attend(q, m, l, acc, full, end, qi, q_start, g, kn_desc, vn_desc, qk_scale,
                        HEAD_DIM, BLOCK_N, True)
    rows = (q_start + qi).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + (rows * stride_ot + h * stride_oh)[:, None] + d[None, :],
             (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=(qi < q_len)[:, None])


def fresh_prefill_supported(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> bool:
    """Whether these rows can take this kernel: q, K and V readable through TMA (tma_ok: Hopper
    or the interpreter, power-of-two head_dim, heads contiguous in a row, aligned rows)."""
    return tma_ok(k_new, v_new) and tma_ok(q, q)          # (tma_ok also checks TensorDescriptor imported)


def fresh_prefill_attention(
    q: torch.Tensor,                # (T, num_heads, head_dim)
    k_new: torch.Tensor,            # (T, num_kv_heads, head_dim), K rotated, rows aligned with q's
    v_new: torch.Tensor,            # (T, num_kv_heads, head_dim)
    query_start_loc: torch.Tensor,  # (B+1,) int32
    scale: float,
    *,
    max_query_len: int,             # host-side max of the query lens
    out: torch.Tensor | None = None,
    skip_decode_rows: bool = False,
    tiles: FreshTiles | None = None,   # fresh_tile_map(query_start_loc, config.block_m, T, skip_decode_rows)
    config: FreshConfig | None = None,
    prefix: CachedPrefix | None = None,   # chunks behind a cached prefix; None: every prompt is fresh
) -> torch.Tensor:
    """Causal attention of every sequence's rows over its own rows, and over its cached prefix
    when `prefix` is given (module docstring)."""
    T, n_heads, head_dim = q.shape
    n_kv = k_new.shape[1]
    B = query_start_loc.shape[0] - 1
    assert k_new.shape == (T, n_kv, head_dim) and v_new.shape == k_new.shape, \
        f"k_new / v_new must be (T, num_kv_heads, head_dim) = {(T, n_kv, head_dim)}"
    assert n_heads % n_kv == 0, f"num_heads {n_heads} must be a multiple of num_kv_heads {n_kv}"
    assert next_pow2(head_dim) == head_dim, f"head_dim {head_dim} must be a power of two"
    assert query_start_loc.dtype == torch.int32 and scale > 0
    assert fresh_prefill_supported(q, k_new, v_new), "rows not readable through TMA (fresh_prefill_supported)"
    check_device(q, k_new, v_new, query_start_loc)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if B == 0 or T == 0:
        return out
    cfg = config or fresh_config(max_query_len) or FreshConfig()
    bound = grid_bound(B, T, cfg.block_m)
    if tiles is None:
        tiles = fresh_tile_map(query_start_loc, cfg.block_m, T, skip_decode_rows)
    assert tiles.tile_starts.shape == (B + 1,) and tiles.tile_seq.shape == (bound,)
    if prefix is not None:
        kc, vc, tables, ctx = prefix.k_cache, prefix.v_cache, prefix.block_tables, prefix.context_lens
        assert vc.shape == kc.shape and kc.shape[2:] == (n_kv, head_dim), \
            f"caches must be (num_blocks, page, {n_kv}, {head_dim})"
        assert tables.shape[0] == B and ctx.shape == (B,), "block_tables (B, max_blocks), context_lens (B,)"
        assert tables.dtype == torch.int32 and tables.stride(-1) == 1 and ctx.dtype == torch.int32
        assert kc.stride(-1) == 1 and vc.stride(-1) == 1 and prefix.k_scale > 0 and prefix.v_scale > 0
        check_device(q, kc, vc, tables, ctx)
        cache_args = (kc, vc, tables, ctx, scale * prefix.k_scale * LOG2E, prefix.v_scale,
                      *kc.stride()[:3], *vc.stride()[:3], tables.stride(0))
        page, scale_v = kc.shape[1], prefix.v_scale != 1.0
    else:                                   # dummies: HAS_PREFIX=False compiles the loops away
        cache_args = (q, q, query_start_loc, query_start_loc, 1.0, 1.0, 0, 0, 0, 0, 0, 0, 0)
        page, scale_v = 16, False
    _fresh_prefill_kernel[(n_heads, bound)](
        row_descriptor(q, cfg.block_m), row_descriptor(k_new, cfg.block_n), row_descriptor(v_new, cfg.block_n),
        out, query_start_loc,
        tiles.tile_starts, tiles.tile_seq, B, scale * LOG2E, out.stride(0), out.stride(1), *cache_args,
        GROUP=n_heads // n_kv, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        HAS_PREFIX=prefix is not None, PAGE=page, SCALE_V=scale_v,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def fresh_prefill_attention_ref(q, k_new, v_new, query_start_loc, scale, skip_decode_rows: bool = False,
                                prefix: CachedPrefix | None = None):
    """Plain-torch reference in fp32 (skipped rows are left as zeros); with a prefix,
    paged_prefill_attention's reference on the same cache, this step's keys from k_new / v_new."""
    if prefix is not None:
        return paged_prefill_attention_ref(q, prefix.k_cache, prefix.v_cache, prefix.block_tables,
                                           prefix.context_lens, query_start_loc, scale, skip_decode_rows,
                                           k_scale=prefix.k_scale, v_scale=prefix.v_scale, k_new=k_new, v_new=v_new)
    n_heads, n_kv = q.shape[1], k_new.shape[1]
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(query_start_loc.shape[0] - 1):
        s0, s1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if s1 == s0 or (skip_decode_rows and s1 - s0 == 1):
            continue
        k = k_new[s0:s1].float().repeat_interleave(n_heads // n_kv, dim=1)      # (n, nh, D)
        v = v_new[s0:s1].float().repeat_interleave(n_heads // n_kv, dim=1)
        s = torch.einsum("qhd,nhd->hqn", q[s0:s1].float(), k) * scale            # (nh, n, n)
        causal = torch.ones(s1 - s0, s1 - s0, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
        out[s0:s1] = torch.einsum("hqn,nhd->qhd", s.softmax(-1), v)
    return out.to(q.dtype)
