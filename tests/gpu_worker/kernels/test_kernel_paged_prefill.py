"""Prefill/extend attention over paged KV vs its torch reference (ragged, causal, cached prefix)."""
import pytest
import torch

from gpu_worker.kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from test_kernel_paged_decode import make_paged


def run_case(randn, rel_err, query_lens, context_lens, group, head_dim=64, page=16, n_kv=2, skip=False,
             share_prefix=True, block=16):
    k_cache, v_cache, tables = make_paged(randn, context_lens, n_kv, head_dim, page, share_prefix=share_prefix)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    T = sum(query_lens)
    q = randn(T, n_kv * group, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, k_cache, v_cache, tables, lens, qsl, head_dim ** -0.5, max_query_len=max(query_lens),
                            out=out, skip_decode_rows=skip, block_m=block, block_n=block)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, lens, qsl, head_dim ** -0.5, skip_decode_rows=skip)
    return out, ref, qsl


@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_fresh_and_extend(randn, rel_err, group):
    # seq 0: fresh prompt of 17; seq 1: 40 new tokens behind a cached prefix of 217 (257 total);
    # seq 2: a decode row (1 new token, context 33)
    out, ref, _ = run_case(randn, rel_err, [17, 40, 1], [17, 257, 33], group)
    assert rel_err(out, ref) < 1e-5


def test_prefill_single_token_and_long(randn, rel_err):
    out, ref, _ = run_case(randn, rel_err, [1, 57], [1, 57], 4, head_dim=128, page=32, n_kv=1, share_prefix=False)
    assert rel_err(out, ref) < 1e-5


def test_prefill_skips_decode_rows(randn, rel_err):
    out, ref, qsl = run_case(randn, rel_err, [3, 1, 20], [50, 9, 20], 2, skip=True)
    assert rel_err(out[0:3], ref[0:3]) < 1e-5 and rel_err(out[4:], ref[4:]) < 1e-5
    assert torch.all(out[3] == 7.0)


def test_prefill_default_tiles(randn, rel_err):
    out, ref, _ = run_case(randn, rel_err, [70, 2], [90, 130], 2, block=None)
    assert rel_err(out, ref) < 1e-5


def test_prefill_sliding_window(randn, rel_err):
    k_cache, v_cache, tables = make_paged(randn, [100, 60], 2, 64, 16)
    qsl = torch.tensor([0, 70, 71], dtype=torch.int32)
    q = randn(71, 4, 64)
    lens = torch.tensor([100, 60], dtype=torch.int32)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, lens, qsl, 0.125, max_query_len=70,
                                  sliding_window=24, block_m=32, block_n=16)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, lens, qsl, 0.125, sliding_window=24)
    assert rel_err(out, ref) < 1e-5


def test_tile_starts_skip_decode_rows():
    from gpu_worker.kernels.paged_prefill_attention import prefill_tile_starts
    qsl = torch.tensor([0, 1, 18, 19, 19, 52], dtype=torch.int32)      # q_lens 1, 17, 1, 0, 33
    assert prefill_tile_starts(qsl, 16).tolist() == [0, 1, 3, 4, 4, 7]
    assert prefill_tile_starts(qsl, 16, skip_decode_rows=True).tolist() == [0, 0, 2, 2, 2, 5]


def test_prefill_many_decode_rows_multi_chunk_search(randn, rel_err, monkeypatch):
    """Prefill rows scattered among decode rows, the tile search scanning 4 sequences at a time."""
    import gpu_worker.kernels.paged_prefill_attention as mod
    monkeypatch.setattr(mod, "MAX_BLOCK_B", 4)
    q_lens = [1, 1, 20, 1, 1, 1, 1, 5, 1, 1, 1, 40, 1]
    ctx = [9, 30, 20, 3, 50, 2, 7, 60, 1, 16, 17, 100, 4]
    out, ref, qsl = run_case(randn, rel_err, q_lens, ctx, 2, skip=True, share_prefix=False)
    rows = [i for b, n in enumerate(q_lens) if n > 1 for i in range(int(qsl[b]), int(qsl[b + 1]))]
    assert rel_err(out[rows], ref[rows]) < 1e-5
    single = [int(qsl[b]) for b, n in enumerate(q_lens) if n == 1]
    assert torch.all(out[single] == 7.0)
