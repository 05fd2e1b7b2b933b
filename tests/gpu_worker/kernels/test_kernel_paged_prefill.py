"""Prefill/extend attention over paged KV vs its torch reference (ragged, causal, cached prefix).

This step's keys come from the contiguous k_new / v_new rows, the cached prefix from the cache;
k_new / v_new here differ from what the cache holds at those positions, so the reference tells
which one the kernel read."""
import pytest
import torch

import gpu_worker.kernels.paged_prefill_attention as ppa
from gpu_worker.kernels.paged_prefill_attention import (PrefillConfig, paged_prefill_attention,
                                                        paged_prefill_attention_ref, prefill_config,
                                                        prefill_tile_starts)
from test_kernel_paged_decode import make_paged


def run_case(randn, rel_err, query_lens, context_lens, group, head_dim=64, page=16, n_kv=2, skip=False,
             share_prefix=True, block=16, fp8=False, window=None, **kw):
    """kw: block_n, pack_gqa, ... overrides of the launch config. Returns (out, ref, qsl)."""
    k_cache, v_cache, tables = make_paged(randn, context_lens, n_kv, head_dim, page, share_prefix=share_prefix)
    scales = {}
    if fp8:                                   # an e4m3 cache holding 8x the values, read back with scales
        k_cache, v_cache = (k_cache * 8).to(torch.float8_e4m3fn), (v_cache * 8).to(torch.float8_e4m3fn)
        scales = dict(k_scale=0.125, v_scale=0.125)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    T = sum(query_lens)
    q = randn(T, n_kv * group, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    extra = dict(k_new=randn(T, n_kv, head_dim), v_new=randn(T, n_kv, head_dim))
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, k_cache, v_cache, tables, lens, qsl, head_dim ** -0.5, max_query_len=max(query_lens),
                            out=out, skip_decode_rows=skip, block_m=block, block_n=kw.pop("block_n", block),
                            sliding_window=window, **scales, **extra, **kw)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, lens, qsl, head_dim ** -0.5, skip_decode_rows=skip,
                                      sliding_window=window, **scales, **extra)
    return out, ref, qsl


def prefill_rows(q_lens, qsl):
    return [i for b, n in enumerate(q_lens) if n > 1 for i in range(int(qsl[b]), int(qsl[b + 1]))]


def test_prefill_single_token_and_long(randn, rel_err):
    out, ref, _ = run_case(randn, rel_err, [1, 57], [1, 57], 4, head_dim=128, page=32, n_kv=1, share_prefix=False,
                           block_n=32)
    assert rel_err(out, ref) < 1e-5


def test_prefill_skips_decode_rows(randn, rel_err):
    out, ref, qsl = run_case(randn, rel_err, [3, 1, 20], [50, 9, 20], 2, skip=True)
    assert rel_err(out[0:3], ref[0:3]) < 1e-5 and rel_err(out[4:], ref[4:]) < 1e-5
    assert torch.all(out[3] == 7.0)


def test_tile_starts_skip_decode_rows():
    qsl = torch.tensor([0, 1, 18, 19, 19, 52], dtype=torch.int32)      # q_lens 1, 17, 1, 0, 33
    assert prefill_tile_starts(qsl, 16).tolist() == [0, 1, 3, 4, 4, 7]
    assert prefill_tile_starts(qsl, 16, skip_decode_rows=True).tolist() == [0, 0, 2, 2, 2, 5]


def test_prefill_many_decode_rows_multi_chunk_search(randn, rel_err, monkeypatch):
    """Prefill rows scattered among decode rows, the tile search scanning 4 sequences at a time."""
    monkeypatch.setattr(ppa, "MAX_BLOCK_B", 4)
    q_lens = [1, 1, 20, 1, 1, 1, 1, 5, 1, 1, 1, 40, 1]
    ctx = [9, 30, 20, 3, 50, 2, 7, 60, 1, 16, 17, 100, 4]
    out, ref, qsl = run_case(randn, rel_err, q_lens, ctx, 2, skip=True, share_prefix=False, head_dim=32, block=32,
                             block_n=16, pack_gqa=True)
    assert rel_err(out[prefill_rows(q_lens, qsl)], ref[prefill_rows(q_lens, qsl)]) < 1e-5
    single = [int(qsl[b]) for b, n in enumerate(q_lens) if n == 1]
    assert torch.all(out[single] == 7.0)


@pytest.mark.parametrize("group,pack,block_m,block_n", [
    (1, False, 32, 16),      # BLOCK_N < query tile
    (4, False, 32, 64),      # BLOCK_N > query tile
    (4, True, 32, 32),       # 8 tokens x 4 heads per tile (BLOCK_N > the tile's 8 tokens)
    (8, True, 64, 32),       # 8 tokens x 8 heads
])
def test_prefill_fresh_extend_decode(randn, rel_err, group, pack, block_m, block_n):
    # fresh prompts of 17 and 257 (sharing a cached block: a prefix hit), a decode row behind 32
    # cached tokens, 40 new tokens behind a 260-token prefix (not a multiple of the page or tile)
    q_lens, ctx = [17, 257, 1, 40], [17, 257, 33, 300]
    out, ref, _ = run_case(randn, rel_err, q_lens, ctx, group, head_dim=16, n_kv=1, block=block_m,
                           block_n=block_n, pack_gqa=pack)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("pack", [False, True])
def test_prefill_sliding_window_and_decode_skip(randn, rel_err, pack):
    # the window reaches into the cached prefix for some rows, not for others; a skipped decode row
    q_lens, ctx = [30, 1, 45], [100, 9, 60]
    out, ref, qsl = run_case(randn, rel_err, q_lens, ctx, 4, head_dim=32, window=24, block=32,
                             block_n=16, pack_gqa=pack, skip=True)
    rows = prefill_rows(q_lens, qsl)
    assert rel_err(out[rows], ref[rows]) < 1e-5 and torch.all(out[30] == 7.0)


def test_prefill_fp8_cache_scales_only_cached_keys(randn, rel_err):
    """k_scale / v_scale apply to the cached prefix; k_new / v_new are raw."""
    out, ref, _ = run_case(randn, rel_err, [9, 20, 1], [40, 20, 17], 4, head_dim=32, fp8=True, block=16,
                           pack_gqa=True)
    assert rel_err(out, ref) < 1e-5


def test_prefill_odd_head_dim_and_group(randn, rel_err):
    """head_dim 24 (BLOCK_D 32), 3 query heads per KV head packed into 16 rows (5 tokens + a spare row)."""
    out, ref, _ = run_case(randn, rel_err, [17, 6], [50, 6], 3, head_dim=24, block=16, pack_gqa=True)
    assert rel_err(out, ref) < 1e-5


def test_prefill_default_config(randn, rel_err):
    out, ref, _ = run_case(randn, rel_err, [70, 2], [150, 130], 4, head_dim=16, n_kv=1, block=None,
                           block_n=None)
    assert rel_err(out, ref) < 1e-5


def test_prefill_config_tiles():
    cfg = PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, pack_gqa=True)
    assert cfg.tile_tokens(4) == 32 and cfg.tile_tokens(1) == 128 and cfg.tile_tokens(3) == 42
    assert cfg.tile_tokens(256) == 128 and not cfg.packs(256)            # a group wider than the tile: no packing
    assert cfg._replace(pack_gqa=False).tile_tokens(4) == 128
    for n in (1, 2, 16, 17, 2048, 8192, 1 << 20):
        assert isinstance(prefill_config(n, 128, 4), PrefillConfig)
    assert prefill_config(2048, 256, 4).block_m <= 64


# ------------------------------------------------------------------------------------------- TMA
def qkv_views(randn, T, n_heads, n_kv, head_dim):
    """q, k_new, v_new as the engine passes them: (T, heads, D) views of one qkv projection output."""
    qkv = randn(T, (n_heads + 2 * n_kv) * head_dim)
    q, k, v = qkv.split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    return q.view(T, n_heads, head_dim), k.view(T, n_kv, head_dim), v.view(T, n_kv, head_dim)


@pytest.mark.parametrize("pack,window", [(False, None), (True, None), (False, 24)])
def test_tma_rows_of_the_qkv_output(randn, rel_err, pack, window):
    """This step's K/V through TMA descriptors over strided qkv rows: ragged prompts whose last
    query tile runs into the next sequence's rows (17, 129) and past T (the last one), a decode
    row, an extension behind a cached prefix; the same output as the pointer loads."""
    q_lens, ctx, n_kv, group, hd = [17, 129, 1, 40], [17, 129, 33, 160], 2, 4, 32
    k_cache, v_cache, tables = make_paged(randn, ctx, n_kv, hd, 16, share_prefix=True)
    q, k_new, v_new = qkv_views(randn, sum(q_lens), n_kv * group, n_kv, hd)
    assert ppa.tma_ok(k_new, v_new)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, lens, qsl, hd ** -0.5)
    ref = paged_prefill_attention_ref(*args, k_new=k_new, v_new=v_new, sliding_window=window)
    outs = []
    for tma in (True, False):
        cfg = PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2, pack_gqa=pack, tma=tma)
        outs.append(paged_prefill_attention(*args, max_query_len=max(q_lens), k_new=k_new, v_new=v_new,
                                            config=cfg, sliding_window=window))
    assert rel_err(outs[0], ref) < 1e-5 and torch.equal(outs[0], outs[1])


def test_tma_ok_needs_contiguous_heads_and_aligned_rows(randn):
    k = randn(8, 2, 32)
    assert ppa.tma_ok(k, k)
    assert not ppa.tma_ok(k.transpose(0, 1).contiguous().transpose(0, 1), k)   # heads not within a row
    rows = randn(8, 2 * 32 + 1)[:, :64].view(8, 2, 32)                          # 260-byte rows
    assert not ppa.tma_ok(rows, rows)
    odd = randn(8, 2, 24)                                                        # head_dim not a power of 2
    assert not ppa.tma_ok(odd, odd)
