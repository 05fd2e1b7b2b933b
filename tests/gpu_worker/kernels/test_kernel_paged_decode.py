"""Paged decode attention vs its torch reference: GQA 1/4/8, holes, shared prefixes, split-K."""
import pytest
import torch

from gpu_worker.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref


def make_paged(randn, context_lens, n_kv, head_dim, page, extra_blocks=3, share_prefix=False):
    """A cache whose blocks are scattered (a permutation with unused holes); optionally sequence 1
    shares sequence 0's first blocks (a prefix hit)."""
    need = [(n + page - 1) // page for n in context_lens]
    total = sum(need) + extra_blocks
    perm = torch.randperm(total)
    max_blocks = max(need) + 1
    tables = torch.zeros((len(context_lens), max_blocks), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used: used + nb].int()
        used += nb
    if share_prefix and len(context_lens) > 1:
        shared = min(need[0], need[1]) - 1
        tables[1, :shared] = tables[0, :shared]
    k_cache = randn(total, page, n_kv, head_dim)
    v_cache = randn(total, page, n_kv, head_dim)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("context_lens,num_splits", [([1, 17, 257], 1), ([257, 200, 5], 3), ([1, 17], 4)])
def test_decode_matches_reference(randn, rel_err, group, context_lens, num_splits):
    n_kv, head_dim, page = 2, 64, 16
    k_cache, v_cache, tables = make_paged(randn, context_lens, n_kv, head_dim, page, share_prefix=True)
    B = len(context_lens)
    q = randn(B, n_kv * group, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5,
                                 max_context_len=max(context_lens), num_splits=num_splits, block_n=32)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    assert rel_err(out, ref) < 1e-5


def test_decode_head_dim_128_page_32_and_auto_splits(randn, rel_err):
    n_kv, group, head_dim, page = 1, 4, 128, 32
    k_cache, v_cache, tables = make_paged(randn, [100, 33], n_kv, head_dim, page)
    q = randn(2, n_kv * group, head_dim)
    lens = torch.tensor([100, 33], dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, max_context_len=100)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.1)
    assert rel_err(out, ref) < 1e-5


def test_decode_mixed_rows_and_padding(randn, rel_err):
    """With query_start_loc, only query_len == 1 rows are written; context 0 (padding) gives zeros."""
    n_kv, group, head_dim, page = 2, 4, 64, 16
    context_lens = [20, 9, 40, 0]
    query_lens = [1, 5, 1, 1]
    k_cache, v_cache, tables = make_paged(randn, [max(n, 1) for n in context_lens], n_kv, head_dim, page)
    qsl = torch.tensor([0, 1, 6, 7, 8], dtype=torch.int32)
    T = sum(query_lens)
    q = randn(T, n_kv * group, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    for splits in (1, 2):
        out = torch.full_like(q, 7.0)
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, max_context_len=40,
                               query_start_loc=qsl, out=out, num_splits=splits, block_n=16)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, query_start_loc=qsl)
        decode_rows = [0, 6]
        assert rel_err(out[decode_rows], ref[decode_rows]) < 1e-5
        assert torch.all(out[1:6] == 7.0)          # the prefill rows are left alone
        assert torch.all(out[7] == 0.0)            # a zero-length (padding) row is zeros


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_sliding_window(randn, rel_err, num_splits):
    n_kv, group, head_dim, page = 2, 4, 64, 16
    context_lens = [257, 17, 40]
    k_cache, v_cache, tables = make_paged(randn, context_lens, n_kv, head_dim, page)
    q = randn(3, n_kv * group, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, max_context_len=257,
                                 num_splits=num_splits, sliding_window=33, block_n=16)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, sliding_window=33)
    assert rel_err(out, ref) < 1e-5
