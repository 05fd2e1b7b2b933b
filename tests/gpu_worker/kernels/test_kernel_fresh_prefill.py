"""fresh_prefill_attention (causal attention of this step's prompt rows, through TMA, and of a
cached prefix through the block table when given) vs its torch reference and vs
paged_prefill_attention on the same rows, on awkward sizes: 1, 17 and 257 tokens, GQA ratios 1, 4
and 8, decode rows skipped, tiles that run past a sequence into the next one's rows and past T,
block tables with holes and a shared prefix, an fp8 cache's scales."""
import pytest
import torch

from gpu_worker.kernels.fresh_prefill_attention import (CachedPrefix, FreshConfig, fresh_prefill_attention,
                                                        fresh_prefill_attention_ref, fresh_tile_map, grid_bound)
from gpu_worker.kernels.paged_prefill_attention import paged_prefill_attention
from test_kernel_paged_decode import make_paged


def rows(randn, query_lens, n_kv, group, head_dim):
    """q (T, H, D) as a view of a wider qkv row (as the model hands it over), k, v (T, n_kv, D)."""
    T = sum(query_lens)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    qkv = randn(T, (n_kv * group + 2 * n_kv) * head_dim)
    q, k, v = qkv.split([n_kv * group * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    view = lambda x, h: x.view(T, h, head_dim)                                     # noqa: E731
    return view(q, n_kv * group), view(k, n_kv), view(v, n_kv), qsl


@pytest.mark.parametrize("group,lens,cfg", [
    (1, [17, 1, 257], FreshConfig(32, 16, 4, 2)),
    (4, [1, 17, 40], FreshConfig(16, 16, 4, 2)),
    (8, [33, 5], FreshConfig(16, 32, 4, 2)),
])
def test_fresh_prefill_matches_reference(randn, rel_err, group, lens, cfg):
    q, k, v, qsl = rows(randn, lens, 2 if group < 8 else 1, group, 32)
    out = torch.full_like(q, 7.0)
    fresh_prefill_attention(q, k, v, qsl, 32 ** -0.5, max_query_len=max(lens), out=out, config=cfg)
    ref = fresh_prefill_attention_ref(q, k, v, qsl, 32 ** -0.5)
    assert rel_err(out, ref) < 1e-5


def test_fresh_prefill_skips_decode_rows_and_matches_paged(randn, rel_err):
    """The backend's case: a mixed step's decode rows are left alone (the decode kernel's), and the
    prefill rows equal paged_prefill_attention's with the same rows as this step's K/V."""
    lens, n_kv, group, d = [20, 1, 9, 1], 2, 4, 64
    q, k, v, qsl = rows(randn, lens, n_kv, group, d)
    cfg = FreshConfig(16, 16, 4, 2)
    tiles = fresh_tile_map(qsl, cfg.block_m, q.shape[0], skip_decode_rows=True)
    assert tiles.tile_starts.tolist() == [0, 2, 2, 3, 3] and tiles.tile_seq.shape == (grid_bound(4, 31, 16),)
    assert tiles.tile_seq[:3].tolist() == [0, 0, 2]
    out = torch.full_like(q, 7.0)
    fresh_prefill_attention(q, k, v, qsl, d ** -0.5, max_query_len=20, out=out, skip_decode_rows=True, tiles=tiles,
                            config=cfg)
    k_cache, v_cache, tables = make_paged(randn, lens, n_kv, d, 16, share_prefix=False)   # holds other values:
    paged = paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), qsl,
                                    d ** -0.5, max_query_len=20, skip_decode_rows=True, k_new=k, v_new=v)
    prefill = [i for b, n in enumerate(lens) if n > 1 for i in range(int(qsl[b]), int(qsl[b + 1]))]
    assert rel_err(out[prefill], paged[prefill]) < 1e-5                                # both read k, v rows
    assert torch.all(out[20] == 7.0) and torch.all(out[30] == 7.0)                    # decode rows untouched


def test_fresh_prefill_refuses_what_it_cannot_read(randn):
    q, k, v, qsl = rows(randn, [4], 1, 2, 24)                                          # head_dim not a power of 2
    with pytest.raises(AssertionError, match="power of two"):
        fresh_prefill_attention(q, k, v, qsl, 0.2, max_query_len=4)



@pytest.mark.parametrize("group,prefixes,lens,cfg,scales", [
    (1, [0, 40, 0, 3], [17, 1, 257, 20], FreshConfig(32, 16, 4, 2), (1.0, 1.0)),  # fresh, decode, chunk
    (4, [16, 100, 33], [1, 17, 40], FreshConfig(16, 16, 4, 2), (1.0, 1.0)),      # prefix a page exactly
    (8, [70, 0], [33, 5], FreshConfig(16, 32, 4, 2), (0.5, 2.0)),                # an fp8 cache's scales
])
def test_fresh_prefill_behind_a_cached_prefix(randn, rel_err, group, prefixes, lens, cfg, scales):
    """Chunks that continue a sequence: the prefix comes from scattered cache blocks (sequence 1
    sharing sequence 0's first blocks), this step's rows from k / v; decode rows are skipped."""
    n_kv, d = 2 if group < 8 else 1, 32
    q, k, v, qsl = rows(randn, lens, n_kv, group, d)
    ctx = [p + n for p, n in zip(prefixes, lens)]
    k_cache, v_cache, tables = make_paged(randn, ctx, n_kv, d, 16, share_prefix=True)
    prefix = CachedPrefix(k_cache, v_cache, tables, torch.tensor(ctx, dtype=torch.int32), *scales)
    out = torch.full_like(q, 7.0)
    fresh_prefill_attention(q, k, v, qsl, d ** -0.5, max_query_len=max(lens), out=out, skip_decode_rows=True,
                            config=cfg, prefix=prefix)
    ref = fresh_prefill_attention_ref(q, k, v, qsl, d ** -0.5, skip_decode_rows=True, prefix=prefix)
    prefill = [i for b, n in enumerate(lens) if n > 1 for i in range(int(qsl[b]), int(qsl[b + 1]))]
    assert rel_err(out[prefill], ref[prefill]) < 1e-5
    decode = [int(qsl[b]) for b, n in enumerate(lens) if n == 1]
    assert all(torch.all(out[r] == 7.0) for r in decode)                            # the decode kernel's rows
    paged = paged_prefill_attention(q, k_cache, v_cache, tables, prefix.context_lens, qsl, d ** -0.5,
                                    max_query_len=max(lens), skip_decode_rows=True, k_new=k, v_new=v,
                                    k_scale=scales[0], v_scale=scales[1])
    assert rel_err(out[prefill], paged[prefill]) < 1e-5


def test_fresh_prefill_prefix_checks_its_cache(randn):
    q, k, v, qsl = rows(randn, [4], 2, 2, 32)
    k_cache, v_cache, tables = make_paged(randn, [10], 2, 64, 16)                    # head_dim 64 != 32
    prefix = CachedPrefix(k_cache, v_cache, tables, torch.tensor([10], dtype=torch.int32))
    with pytest.raises(AssertionError, match="caches must be"):
        fresh_prefill_attention(q, k, v, qsl, 0.2, max_query_len=4, prefix=prefix)
