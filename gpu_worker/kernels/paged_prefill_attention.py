"""Prefill / extend attention over the paged KV cache (variable lengths, causal, online softmax).

Sequence b contributes rows query_start_loc[b] .. query_start_loc[b+1] of q (query_len rows) and
has context_len = context_lens[b] tokens in the cache, this step's K/V included (the KV write
runs first). The queries are the last query_len tokens of the context, so query row i sits at
absolute position  pos_i = context_len - query_len + i  and attends to keys j <= pos_i:

    |<------------------ context_len (paged cache) ------------------>|
    |<---- cached prefix (context_len - query_len) ---->|<-query_len->|
                                                   row i ^ sees keys 0 .. pos_i

    out[r, h] = sum_{j <= pos_r} softmax_j(scale * <q[r, h], K[j, g]>) V[j, g],  g = h // G

Grid: (query heads, query tiles of BLOCK_M rows of all sequences). The tiles are numbered by a
device-side prefix sum (prefill_tile_starts, no host sync), so a mixed step with hundreds of
decode rows launches programs only for the prefill tiles. Each program walks the keys in
BLOCK_N tiles gathered through the block table, FlashAttention-style (running max / sum /
accumulator in fp32, exp2 domain): first the tiles wholly below the diagonal without masks,
then the diagonal tiles with the causal mask. Decode rows (query_len 1) are handled like any
other (or skipped with skip_decode_rows=True when the decode kernel takes them). With a sliding
window W, row i also ignores keys j <= pos_i - W (and tiles wholly before the window are skipped).
An fp8 cache is read with per-tensor scales as in paged_decode_attention.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._utils import check_device, next_pow2
from gpu_worker.kernels.paged_decode_attention import gather_context

LOG2E = 1.4426950408889634
MAX_BLOCK_B = 1024      # sequences scanned per step of the kernel's tile -> sequence search


@triton.jit
def _attend_tiles(
    q, m, l, acc, lo, hi, qpos, window, bt_row, k_cache_ptr, v_cache_ptr, g, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)                    # (BLOCK_N,) key positions
        tmask = tok < hi
        blk = tl.load(bt_row + tok // PAGE, mask=tmask, other=0).to(tl.int64)
        off = tok % PAGE
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks + g * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)                # (BLOCK_N, BLOCK_D)
        v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + g * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale   # (BLOCK_M, BLOCK_N), log2 domain
        if CAUSAL_MASK:
            visible = (tok[None, :] <= qpos[:, None]) & tmask[None, :]
            if HAS_WINDOW:
                visible = visible & (tok[None, :] > qpos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing visible yet
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m = m_new
    return m, l, acc


# Step-dependent scalars and pointers (see paged_decode_attention._STEP_PTRS): no specialization.
_STEP_PTRS = ["block_tables_ptr", "context_lens_ptr", "qsl_ptr", "tile_start_ptr"]


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"], do_not_specialize_on_alignment=_STEP_PTRS)
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, qsl_ptr, tile_start_ptr, num_seqs,
    out_ptr, qk_scale, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, BLOCK_B: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    h = tl.program_id(0)
    item = tl.program_id(1)                                  # a query tile of some sequence
    if item >= tl.load(tile_start_ptr + num_seqs):
        return                                               # the grid is an upper bound
    # Our sequence b: tile_start[b] <= item < tile_start[b+1], i.e. b = #{j >= 1: tile_start[j] <= item}.
    count = tl.zeros((BLOCK_B,), tl.int32)
    for j0 in range(0, num_seqs, BLOCK_B):
        j = j0 + 1 + tl.arange(0, BLOCK_B)
        ts = tl.load(tile_start_ptr + j, mask=j <= num_seqs, other=2147483647)
        count += (ts <= item).to(tl.int32)
    b = tl.sum(count, axis=0)
    mb = tl.load(tile_start_ptr + b + 1) - 1 - item          # the sequence's last (longest) tiles first
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    g = h // GROUP
    n_ctx = tl.load(context_lens_ptr + b)
    prefix = n_ctx - q_len

    i = mb * BLOCK_M + tl.arange(0, BLOCK_M)                 # (BLOCK_M,) query index in the sequence
    rmask = i < q_len
    qpos = prefix + i                                        # absolute positions
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    rows = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)   # (BLOCK_M, BLOCK_D)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    first_q = prefix + mb * BLOCK_M                          # smallest position in this tile
    full_end = (first_q // BLOCK_N) * BLOCK_N                # keys below: visible to every row
    kv_end = tl.minimum(n_ctx, first_q + BLOCK_M)            # keys at/after: visible to none
    lo = 0
    if HAS_WINDOW:                   # keys before first_q - window + 1 are visible to no row;
        lo = (tl.maximum(first_q - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_end = lo                # and every tile needs the mask
    m, l, acc = _attend_tiles(q, m, l, acc, lo, full_end, qpos, window, bt_row, k_cache_ptr, v_cache_ptr, g,
                              qk_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                              HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, False, HAS_WINDOW)
    m, l, acc = _attend_tiles(q, m, l, acc, full_end, kv_end, qpos, window, bt_row, k_cache_ptr, v_cache_ptr, g,
                              qk_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                              HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, True, HAS_WINDOW)
    o = acc * v_scale / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def default_block_m(max_query_len: int) -> int:
    return 64 if max_query_len > 16 else 16


def prefill_tile_starts(query_start_loc: torch.Tensor, block_m: int, skip_decode_rows: bool = False) -> torch.Tensor:
    """(B+1,) int32 prefix sums of each sequence's query tiles (ceil(q_len / block_m); 0 for a
    decode row when skipped), on the device, without a host sync. Compute once per step."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]                        # (B,)
    tiles = (q_lens + block_m - 1) // block_m
    if skip_decode_rows:
        tiles = torch.where(q_lens == 1, 0, tiles)
    starts = torch.zeros(q_lens.shape[0] + 1, dtype=torch.int32, device=q_lens.device)
    starts[1:] = torch.cumsum(tiles, dim=0)
    return starts


def paged_prefill_attention(
    q: torch.Tensor,               # (T, num_heads, head_dim)
    k_cache: torch.Tensor,         # (num_blocks, block_size, num_kv_heads, head_dim), this step written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,    # (B, max_blocks) int32
    context_lens: torch.Tensor,    # (B,) int32
    query_start_loc: torch.Tensor,  # (B+1,) int32
    scale: float,
    *,
    max_query_len: int,            # host-side max of query lens (sizes the grid)
    out: torch.Tensor | None = None,
    skip_decode_rows: bool = False,
    sliding_window: int | None = None,   # row at position p sees keys p - W + 1 .. p
    k_scale: float = 1.0,                # fp8 caches: K = k_scale * stored, V = v_scale * stored
    v_scale: float = 1.0,
    tile_starts: torch.Tensor | None = None,   # (B+1,) int32 from prefill_tile_starts (one per step)
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged context (module docstring)."""
    T, n_heads, head_dim = q.shape
    n_blocks, page, n_kv, head_dim_c = k_cache.shape
    B = block_tables.shape[0]
    assert v_cache.shape == k_cache.shape, "k_cache and v_cache must have one shape"
    assert head_dim_c == head_dim, f"cache head_dim {head_dim_c} != q's {head_dim}"
    assert n_heads % n_kv == 0, f"num_heads {n_heads} must be a multiple of num_kv_heads {n_kv}"
    assert context_lens.shape == (B,) and query_start_loc.shape == (B + 1,), "context_lens (B,), query_start_loc (B+1,)"
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    check_device(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if B == 0 or T == 0:
        return out
    block_m, block_n = block_m or default_block_m(max_query_len), block_n or 64
    if tile_starts is None:
        tile_starts = prefill_tile_starts(query_start_loc, block_m, skip_decode_rows)
    assert tile_starts.shape == (B + 1,) and tile_starts.dtype == torch.int32
    # Tiles of all sequences <= sum(ceil(q_len / block_m)) <= T / block_m + B: a host-side bound.
    grid = (n_heads, triton.cdiv(T, block_m) + B)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, tile_starts, B, out,
        scale * k_scale * LOG2E,
        v_scale, sliding_window or 0, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=n_heads // n_kv, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page, BLOCK_B=min(MAX_BLOCK_B, next_pow2(B)),
        HAS_WINDOW=bool(sliding_window),
        num_warps=num_warps or 4, num_stages=num_stages or 2,
    )
    return out


def paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                skip_decode_rows: bool = False, sliding_window=None, k_scale=1.0,
                                v_scale=1.0) -> torch.Tensor:
    """Plain-torch reference in fp32 (skipped rows are left as zeros)."""
    n_heads, n_kv = q.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(block_tables.shape[0]):
        s0, s1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len, n = s1 - s0, int(context_lens[b])
        if q_len == 0 or (skip_decode_rows and q_len == 1):
            continue
        k = gather_context(k_cache, block_tables[b], n).float().repeat_interleave(n_heads // n_kv, dim=1) * k_scale
        v = gather_context(v_cache, block_tables[b], n).float().repeat_interleave(n_heads // n_kv, dim=1) * v_scale
        s = torch.einsum("qhd,nhd->hqn", q[s0:s1].float(), k) * scale     # (H, q_len, n)
        qpos = torch.arange(n - q_len, n, device=q.device)[:, None]
        kpos = torch.arange(n, device=q.device)[None, :]
        s = s.masked_fill(kpos > qpos, float("-inf"))
        if sliding_window:
            s = s.masked_fill(kpos <= qpos - sliding_window, float("-inf"))
        out[s0:s1] = torch.einsum("hqn,nhd->qhd", s.softmax(-1), v)
    return out.to(q.dtype)
