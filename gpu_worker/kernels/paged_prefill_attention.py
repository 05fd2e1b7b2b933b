"""Prefill / extend attention over the paged KV cache (variable lengths, causal, online softmax).

Sequence b contributes rows query_start_loc[b] .. query_start_loc[b+1] of q (query_len rows) and
has context_len = context_lens[b] tokens in the cache, this step's K/V included (the KV write
runs first). The queries are the last query_len tokens of the context, so query row i sits at
absolute position  pos_i = context_len - query_len + i  and attends to keys j <= pos_i:

    |<------------------ context_len (paged cache) ------------------>|
    |<---- cached prefix (context_len - query_len) ---->|<-query_len->|
                                                   row i ^ sees keys 0 .. pos_i

    out[r, h] = sum_{j <= pos_r} softmax_j(scale * <q[r, h], K[j, g]>) V[j, g],  g = h // G

The keys of this step's own tokens (positions prefix .. context_len-1) are read from the
contiguous k_new / v_new rows (aligned with q's rows: row query_start_loc[b] + j holds position
prefix + j), and only the cached prefix (positions < prefix) is gathered through the block table.
Per program: the prefix's full tiles without masks, its last partial tile with a bound mask, then
this step's keys: the tiles wholly below the query tile's diagonal without masks, the diagonal
ones with the causal mask. With pack_gqa one program takes a KV head and stacks its G query heads'
rows into the M dimension (BLOCK_M rows = BLOCK_M / G tokens x G heads), so each K/V tile is
loaded once for the group. With config.tma (the defaults) and rows tma_ok() accepts, this step's
K/V tiles are read through TMA descriptors (Hopper's bulk copy engine) instead of pointer loads.
Launch configurations come from prefill_config() (defaults set by bench/sweep_prefill_attention.py).
Measurements and fresh_prefill_attention.py call this kernel "v2".

Grid (heads, query tiles of all sequences). The tiles are numbered by a device-side prefix
sum (prefill_tile_starts, no host sync), so a mixed step with hundreds of decode rows launches
programs only for the prefill tiles; the grid is a host-side bound (CUDA-graph safe). Running
max / sum / accumulator in fp32, exp2 domain. Decode rows (query_len 1) are handled like any
other (or skipped with skip_decode_rows=True when the decode kernel takes them). With a sliding
window W, row i also ignores keys j <= pos_i - W (tiles wholly before the window are skipped,
every other tile is masked).

An fp8 cache is read with per-tensor scales as in paged_decode_attention: K = k_scale * stored,
V = v_scale * stored. k_new / v_new are this step's raw (unquantized, e.g. bf16) K/V and are used
as they are: k_scale enters only the logits of cached keys, v_scale only the weights of cached
values. (So with an fp8 cache a chunk attends to its own tokens at full precision, as SGLang's
extend attention does; later chunks and decode steps see them quantized.)
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

try:                                        # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:                         # pragma: no cover
    TensorDescriptor = None

from gpu_worker.kernels._paged_kv import F32_DOTS, gather_kv_tile, load_tile
from gpu_worker.kernels._utils import check_device, hopper_or_newer, interpreting, next_pow2
from gpu_worker.kernels.paged_decode_attention import gather_context

LOG2E = 1.4426950408889634
MAX_BLOCK_B = 1024      # sequences scanned per step of the kernel's tile -> sequence search
MIN_BLOCK_B = 128       # ... and at least this many (one compiled kernel for every batch size up to it)


class PrefillConfig(NamedTuple):
    """Launch configuration of the kernel."""
    block_m: int = 128        # query rows per program (tokens x heads with pack_gqa)
    block_n: int = 64         # keys per tile
    num_warps: int = 8
    num_stages: int = 2
    pack_gqa: bool = False    # one program per KV head, its G query heads' rows stacked in M
    tma: bool = False         # this step's K/V tiles through TMA descriptors (Hopper's bulk copy
                              # engine) instead of pointer loads; where the rows allow (tma_ok)

    def packs(self, group: int) -> bool:
        """Whether the GQA group is packed (needs a group > 1 that fits in block_m)."""
        return self.pack_gqa and 1 < group <= self.block_m

    def tile_tokens(self, group: int) -> int:
        """Query tokens per tile: the block size to give prefill_tile_starts."""
        return self.block_m // group if self.packs(group) else self.block_m


# ------------------------------------------------------------------------------------------------
# Default launch configurations of the kernel, by max_query_len (head_dim <= 128): the first
# entry whose bound is >= max_query_len. Set from bench/sweep_prefill_attention.py on the H200
# (it prints the lines to paste here).
PREFILL_CONFIGS: list[tuple[int, PrefillConfig]] = [
    # measured on the H200 (bench/sweep_prefill_attention.py, Llama-8B heads, 2026-11-29 and -12-02):
    # the 2k-class cases peak at 64 x 64 tiles with 3 stages (pointer loads 342-378 TFLOP/s, TMA
    # 365-427), the 8k/32k prompts at 128 x 128 with 3 stages (pointer loads 474-491, TMA 545-550);
    # GQA packing never won; 4 stages of 128 x 128 overflow shared memory.
    (16, PrefillConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, pack_gqa=False)),
    (4096, PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, pack_gqa=False, tma=True)),
    (1 << 62, PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, pack_gqa=False, tma=True)),
]
# head_dim > 128 (e.g. 256): smaller tiles (registers / shared memory)
PREFILL_CONFIG_WIDE = PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, pack_gqa=False)


def prefill_config(max_query_len: int, head_dim: int = 128, group: int = 1) -> PrefillConfig:
    """The default launch configuration for a step (host ints only). `group` (query heads per
    KV head) is accepted for future per-group defaults; tile_tokens(group) needs it too."""
    if head_dim > 128:
        return PREFILL_CONFIG_WIDE
    for bound, cfg in PREFILL_CONFIGS:
        if max_query_len <= bound:
            return cfg
    return PREFILL_CONFIGS[-1][1]


def _block_b(num_seqs: int) -> int:
    return min(MAX_BLOCK_B, max(MIN_BLOCK_B, next_pow2(num_seqs)))


@triton.jit
def _tile_owner(tile_start_ptr, num_seqs, item, BLOCK_B: tl.constexpr):
    """(b, mb): query tile `item` is tile mb of sequence b, where tile_start[b] <= item <
    tile_start[b+1], i.e. b = #{j >= 1: tile_start[j] <= item}; tiles are handed out from the
    sequence's last (longest) ones first."""
    count = tl.zeros((BLOCK_B,), tl.int32)
    for j0 in range(0, num_seqs, BLOCK_B):
        j = j0 + 1 + tl.arange(0, BLOCK_B)
        ts = tl.load(tile_start_ptr + j, mask=j <= num_seqs, other=2147483647)
        count += (ts <= item).to(tl.int32)
    b = tl.sum(count, axis=0)
    mb = tl.load(tile_start_ptr + b + 1) - 1 - item
    return b, mb


# Step-dependent scalars and pointers (see paged_decode_attention._STEP_PTRS): no specialization.
_STEP_PTRS = ["block_tables_ptr", "context_lens_ptr", "qsl_ptr", "tile_start_ptr"]


# ================================================================================ the kernel
@triton.jit
def online_softmax(q, s, v, m, l, acc, qk_scale, v_scale, GUARD: tl.constexpr, SCALE_V: tl.constexpr):
    """Fold one tile of raw logits s (BLOCK_M, BLOCK_N; masked keys -inf) and its values into
    (m, l, acc), log2 domain (fresh_prefill_attention folds its tiles with it too). GUARD: a row
    may have seen no visible key yet (m_new = -inf)."""
    m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.exp2(m - m_use)
    l = l * alpha + tl.sum(p, axis=1)
    if SCALE_V:
        p = p * v_scale
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=F32_DOTS)
    return m_new, l, acc


@triton.jit
def cache_tiles(
    q, m, l, acc, lo, hi, qpos, window, bt_row, k_cache_ptr, v_cache_ptr, g, qk_scale, v_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, GUARD: tl.constexpr, SCALE_V: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """Cached keys at positions lo .. hi-1, gathered through the block table (fresh_prefill_attention
    reads a cached prefix with it too). MASK: keys >= hi (and, with a window, keys too old for a
    row) are masked; else every key is visible to every row."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)                    # (BLOCK_N,) key positions
        tmask = tok < hi
        k, v = gather_kv_tile(bt_row, k_cache_ptr, v_cache_ptr, tok, tmask, d, dmask, g, stride_kb, stride_ks,
                              stride_kh, stride_vb, stride_vs, stride_vh, PAGE, MASK, EVEN_D)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=F32_DOTS)   # (BLOCK_M, BLOCK_N) raw logits
        if MASK:
            visible = tmask[None, :]
            if HAS_WINDOW:
                visible = visible & (tok[None, :] > qpos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m, l, acc = online_softmax(q, s, v, m, l, acc, qk_scale, v_scale, GUARD, SCALE_V)
    return m, l, acc


@triton.jit
def _new_tiles(
    q, m, l, acc, lo, hi, qi, q_len, window, kn_base, vn_base, stride_knt, stride_vnt,
    kn_desc, vn_desc, q_start, g, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, GUARD: tl.constexpr, EVEN_D: tl.constexpr,
    TMA: tl.constexpr,
):
    """This step's keys j = lo .. hi-1 of the sequence (position prefix + j), from the contiguous
    k_new / v_new rows (TMA: rows q_start + j of the (T, kv heads x D) descriptors, head g's
    columns). CAUSAL: row qi sees j <= qi (with a window also j > qi -
    window), loads stop at q_len (TMA: a tile past q_len reads the next sequence's rows, or zeros
    past T, and the mask hides them; their values must be finite, since p = 0 times NaN is NaN: a
    padded prefill graph's rows are zeroed by the backend); else every key is visible to every row."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)                      # (BLOCK_N,) index among this step's keys
        jmask = j < q_len
        if TMA:
            k = kn_desc.load([q_start + n0, g * HEAD_DIM])
            v = vn_desc.load([q_start + n0, g * HEAD_DIM])
        else:
            k = load_tile(kn_base + j[:, None] * stride_knt + d[None, :], jmask, dmask, CAUSAL, EVEN_D)
            v = load_tile(vn_base + j[:, None] * stride_vnt + d[None, :], jmask, dmask, CAUSAL, EVEN_D)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=F32_DOTS)
        if CAUSAL:
            visible = j[None, :] <= qi[:, None]
            if HAS_WINDOW:
                visible = visible & (j[None, :] > qi[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m, l, acc = online_softmax(q, s, v, m, l, acc, qk_scale, 1.0, GUARD, False)   # raw V: no v_scale
    return m, l, acc


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"], do_not_specialize_on_alignment=_STEP_PTRS)
def _prefill_kernel(
    q_ptr, k_new_ptr, v_new_ptr, kn_desc, vn_desc, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    context_lens_ptr, qsl_ptr, tile_start_ptr, num_seqs, out_ptr, qk_scale_cache, qk_scale_new, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, PAGE: tl.constexpr, BLOCK_B: tl.constexpr,
    PACK_GQA: tl.constexpr, ROW_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SCALE_V_CACHE: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr,
):
    pid = tl.program_id(0)                                   # query head (KV head with PACK_GQA)
    item = tl.program_id(1)                                  # a query tile of some sequence
    if item >= tl.load(tile_start_ptr + num_seqs):
        return                                               # the grid is an upper bound
    b, mb = _tile_owner(tile_start_ptr, num_seqs, item, BLOCK_B)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    n_ctx = tl.load(context_lens_ptr + b)
    prefix = n_ctx - q_len

    t0 = mb * TILE_M                                         # first query token of the tile
    r = tl.arange(0, BLOCK_M)
    if PACK_GQA:                                             # row r: token t0 + r // G, head g*G + r % G
        g = pid
        qi = t0 + r // GROUP
        head = g * GROUP + r % GROUP
    else:
        g = pid // GROUP
        qi = t0 + r
        head = pid
    rmask = qi < q_len
    if ROW_PAD:                                              # BLOCK_M not a multiple of G: spare rows
        rmask = rmask & (r < TILE_M * GROUP)
    rows = (q_start + qi).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    io_mask = rmask[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (rows * stride_qt + head * stride_qh)[:, None] + d[None, :], mask=io_mask, other=0.0)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    qpos = prefix + qi                                       # absolute positions

    # 1. the cached prefix, positions 0 .. prefix-1: visible to every row (but for a window)
    if HAS_WINDOW:                   # keys before prefix + t0 - window + 1 are visible to no row;
        lo_p = (tl.maximum(prefix + t0 - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_p = lo_p                # and every tile needs the mask
    else:
        lo_p = 0
        full_p = (prefix // BLOCK_N) * BLOCK_N
    m, l, acc = cache_tiles(q, m, l, acc, lo_p, full_p, qpos, window, bt_row, k_cache_ptr, v_cache_ptr, g,
                             qk_scale_cache, v_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                             stride_vh, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE,
                             False, HAS_WINDOW, False, SCALE_V_CACHE, EVEN_D)            # full tiles
    m, l, acc = cache_tiles(q, m, l, acc, full_p, prefix, qpos, window, bt_row, k_cache_ptr, v_cache_ptr, g,
                             qk_scale_cache, v_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                             stride_vh, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE,
                             True, HAS_WINDOW, HAS_WINDOW, SCALE_V_CACHE, EVEN_D)        # the partial tail

    # 2. this step's keys j = 0 .. q_len-1 (position prefix + j): j < t0 are visible to every row
    #    of the tile, j in t0 .. t0+TILE_M-1 need the causal mask, later ones are visible to none
    kn_base = k_new_ptr + q_start.to(tl.int64) * stride_knt + g * stride_knh
    vn_base = v_new_ptr + q_start.to(tl.int64) * stride_vnt + g * stride_vnh
    if HAS_WINDOW:
        lo_n = (tl.maximum(t0 - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_n = lo_n
    else:
        lo_n = 0
        full_n = (t0 // BLOCK_N) * BLOCK_N
    end_n = tl.minimum(q_len, t0 + TILE_M)
    m, l, acc = _new_tiles(q, m, l, acc, lo_n, full_n, qi, q_len, window, kn_base, vn_base, stride_knt,
                           stride_vnt, kn_desc, vn_desc, q_start, g, qk_scale_new,
                           HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_WINDOW, False, EVEN_D, TMA)      # below the diagonal
    m, l, acc = _new_tiles(q, m, l, acc, full_n, end_n, qi, q_len, window, kn_base, vn_base, stride_knt,
                           stride_vnt, kn_desc, vn_desc, q_start, g, qk_scale_new,
                           HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_WINDOW, HAS_WINDOW, EVEN_D, TMA)  # the diagonal
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (rows * stride_ot + head * stride_oh)[:, None] + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


# ================================================================================ launcher
def prefill_tile_starts(query_start_loc: torch.Tensor, block_m: int, skip_decode_rows: bool = False) -> torch.Tensor:
    """(B+1,) int32 prefix sums of each sequence's query tiles (ceil(q_len / block_m); 0 for a
    decode row when skipped), on the device, without a host sync. Compute once per step.
    block_m: query tokens per tile (PrefillConfig.tile_tokens(group))."""
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
    k_new: torch.Tensor,           # (T, num_kv_heads, head_dim): this step's K/V, rows aligned with
    v_new: torch.Tensor,           # q's (raw values: no k_scale/v_scale), K rotated
    out: torch.Tensor | None = None,
    skip_decode_rows: bool = False,
    sliding_window: int | None = None,   # row at position p sees keys p - W + 1 .. p
    k_scale: float = 1.0,                # fp8 caches: K = k_scale * stored, V = v_scale * stored
    v_scale: float = 1.0,
    tile_starts: torch.Tensor | None = None,   # (B+1,) int32 from prefill_tile_starts (one per step)
    config: PrefillConfig | None = None,  # launch config (default prefill_config(...)); the
    block_m: int | None = None,           # arguments below override its fields
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pack_gqa: bool | None = None,        # stack a KV head's G query heads in one program
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged context (module docstring).
    A given tile_starts must be prefill_tile_starts(query_start_loc, config.tile_tokens(num_heads //
    num_kv_heads), skip_decode_rows)."""
    T, n_heads, head_dim = q.shape
    n_blocks, page, n_kv, head_dim_c = k_cache.shape
    B = block_tables.shape[0]
    assert v_cache.shape == k_cache.shape, "k_cache and v_cache must have one shape"
    assert head_dim_c == head_dim, f"cache head_dim {head_dim_c} != q's {head_dim}"
    assert n_heads % n_kv == 0, f"num_heads {n_heads} must be a multiple of num_kv_heads {n_kv}"
    assert context_lens.shape == (B,) and query_start_loc.shape == (B + 1,), "context_lens (B,), query_start_loc (B+1,)"
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert scale > 0 and k_scale > 0 and v_scale > 0
    assert k_new.shape == (T, n_kv, head_dim) and v_new.shape == (T, n_kv, head_dim), \
        f"k_new / v_new must be (T, num_kv_heads, head_dim) = {(T, n_kv, head_dim)}"
    assert k_new.stride(-1) == 1 and v_new.stride(-1) == 1
    check_device(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, k_new, v_new)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if B == 0 or T == 0:
        return out
    group = n_heads // n_kv
    cfg = config or prefill_config(max_query_len, head_dim, group)
    overrides = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages, pack_gqa=pack_gqa)
    cfg = cfg._replace(**{key: val for key, val in overrides.items() if val is not None})
    pack, tile_m = cfg.packs(group), cfg.tile_tokens(group)
    if tile_starts is None:
        tile_starts = prefill_tile_starts(query_start_loc, tile_m, skip_decode_rows)
    assert tile_starts.shape == (B + 1,) and tile_starts.dtype == torch.int32
    tma = cfg.tma and tma_ok(k_new, v_new)
    kn_desc = row_descriptor(k_new, cfg.block_n) if tma else None
    vn_desc = row_descriptor(v_new, cfg.block_n) if tma else None
    # Tiles of all sequences <= sum(ceil(q_len / tile_m)) <= T / tile_m + B: a host-side bound.
    grid = (n_kv if pack else n_heads, triton.cdiv(T, tile_m) + B)
    _prefill_kernel[grid](
        q, k_new, v_new, kn_desc, vn_desc, k_cache, v_cache, block_tables, context_lens, query_start_loc,
        tile_starts, B, out,
        scale * k_scale * LOG2E, scale * LOG2E, v_scale, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, TILE_M=tile_m, PAGE=page, BLOCK_B=_block_b(B),
        PACK_GQA=pack, ROW_PAD=pack and tile_m * group != cfg.block_m,
        HAS_WINDOW=bool(sliding_window), SCALE_V_CACHE=v_scale != 1.0,
        EVEN_D=next_pow2(head_dim) == head_dim, TMA=tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def tma_ok(k_new: torch.Tensor, v_new: torch.Tensor) -> bool:
    """Whether this step's (T, kv heads, D) K/V rows can be read through TMA descriptors: a GPU of
    compute capability >= 9 (or the interpreter), a power-of-two head_dim, heads contiguous within
    a row, 16-byte aligned rows (the bulk copy engine's rules)."""
    device_ok = hopper_or_newer(k_new.device) if k_new.is_cuda else interpreting()
    if TensorDescriptor is None or not device_ok:
        return False
    for x in (k_new, v_new):
        d, size = x.shape[2], x.element_size()
        if (next_pow2(d) != d or x.stride(2) != 1 or x.stride(1) != d or (x.stride(0) * size) % 16
                or x.data_ptr() % 16):
            return False
    return True


def row_descriptor(x: torch.Tensor, block: int):
    """(T, heads, D) rows as a 2-D (T, heads x D) TMA descriptor of (block, D) tiles (this
    step's K/V here; q, K and V in fresh_prefill_attention)."""
    T, heads, d = x.shape
    return TensorDescriptor(x, shape=[T, heads * d], strides=[x.stride(0), 1], block_shape=[block, d])


def paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                skip_decode_rows: bool = False, sliding_window=None, k_scale=1.0,
                                v_scale=1.0, k_new=None, v_new=None) -> torch.Tensor:
    """Plain-torch reference in fp32 (skipped rows are left as zeros). With k_new / v_new, the
    keys of this step's tokens (positions context_len - query_len ..) are their rows, unscaled."""
    n_heads, n_kv = q.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(block_tables.shape[0]):
        s0, s1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len, n = s1 - s0, int(context_lens[b])
        if q_len == 0 or (skip_decode_rows and q_len == 1):
            continue
        k = gather_context(k_cache, block_tables[b], n).float() * k_scale        # new tensors
        v = gather_context(v_cache, block_tables[b], n).float() * v_scale
        if k_new is not None:
            k[n - q_len:], v[n - q_len:] = k_new[s0:s1].float(), v_new[s0:s1].float()
        k, v = k.repeat_interleave(n_heads // n_kv, dim=1), v.repeat_interleave(n_heads // n_kv, dim=1)
        s = torch.einsum("qhd,nhd->hqn", q[s0:s1].float(), k) * scale     # (H, q_len, n)
        qpos = torch.arange(n - q_len, n, device=q.device)[:, None]
        kpos = torch.arange(n, device=q.device)[None, :]
        s = s.masked_fill(kpos > qpos, float("-inf"))
        if sliding_window:
            s = s.masked_fill(kpos <= qpos - sliding_window, float("-inf"))
        out[s0:s1] = torch.einsum("hqn,nhd->qhd", s.softmax(-1), v)
    return out.to(q.dtype)
