"""TritonAttentionBackend vs the plain-torch backend on pure-decode, prefill and mixed batches."""
import pytest
import torch

from gpu_worker.attention.triton_backend import TritonAttentionBackend
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.tuning import KernelTuning

torch_backend = pytest.importorskip("gpu_worker.attention.torch_backend")


def make_batch(computed, query_lens, page, max_blocks, perm):
    """computed[i] tokens already cached, query_lens[i] new ones; blocks assigned from `perm`."""
    B = len(query_lens)
    ctx = [c + q for c, q in zip(computed, query_lens)]
    tables = torch.zeros((B, max_blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(ctx):
        nb = -(-n // page)
        tables[i, :nb] = perm[used: used + nb]
        used += nb
    positions, slots = [], []
    for i in range(B):
        for p in range(computed[i], ctx[i]):
            positions.append(p)
            slots.append(int(tables[i, p // page]) * page + p % page)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    T = sum(query_lens)
    return ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=torch.tensor(positions),
        query_lens=torch.tensor(query_lens, dtype=torch.int32), context_lens=torch.tensor(ctx, dtype=torch.int32),
        query_start_loc=qsl, block_tables=tables, slot_mapping=torch.tensor(slots),
        logits_indices=qsl[1:].long() - 1, max_query_len=max(query_lens), max_context_len=max(ctx),
        fresh_prefill=all(c == 0 or q == 1 for c, q in zip(computed, query_lens)))


@pytest.mark.parametrize("computed,query_lens", [
    ([0, 0], [17, 1]),                 # fresh prompts (one of a single token)
    ([0, 5, 0], [40, 1, 9]),           # fresh prompts and a decode row: fresh_prefill_attention
    ([16, 40, 256], [1, 1, 1]),        # pure decode
    ([40, 3, 100, 0], [1, 20, 1, 33]),  # mixed: decodes + a chunk behind a prefix + a fresh prompt
])
def test_triton_backend_matches_torch_backend(randn, rel_err, computed, query_lens):
    n_heads, n_kv, head_dim, page = 8, 2, 64, 16
    n_blocks = 40
    batch = make_batch(computed, query_lens, page, 24, torch.randperm(n_blocks).int())
    T = batch.num_tokens
    q, k, v = randn(T, n_heads, head_dim), randn(T, n_kv, head_dim), randn(T, n_kv, head_dim)
    kc, vc = randn(n_blocks, page, n_kv, head_dim), randn(n_blocks, page, n_kv, head_dim)
    kc2, vc2 = kc.clone(), vc.clone()
    backend = TritonAttentionBackend()
    out = backend.forward(q, k, v, kc, vc, batch, head_dim ** -0.5)
    ref = torch_backend.TorchAttentionBackend().forward(q, k, v, kc2, vc2, batch, head_dim ** -0.5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(backend.forward(q, k, v, kc, vc, batch, head_dim ** -0.5), out)   # a second layer


def test_rope_kv_write_then_attend_equals_rope_then_forward(randn, rel_err):
    from gpu_worker.kernels.rope import build_cos_sin_cache, rope_, rope_inv_freq
    n_heads, n_kv, head_dim, page, n_blocks = 4, 2, 64, 16, 20
    batch = make_batch([30, 0], [1, 9], page, 8, torch.randperm(n_blocks).int())
    T = batch.num_tokens
    cs = build_cos_sin_cache(rope_inv_freq(head_dim, 10000.0), 256)
    q, k, v = randn(T, n_heads, head_dim), randn(T, n_kv, head_dim), randn(T, n_kv, head_dim)
    kc, vc = randn(n_blocks, page, n_kv, head_dim), randn(n_blocks, page, n_kv, head_dim)
    q2, k2, kc2, vc2 = q.clone(), k.clone(), kc.clone(), vc.clone()
    backend = TritonAttentionBackend()
    backend.rope_kv_write(q, k, v, batch.positions, cs, kc, vc, batch.slot_mapping)
    out = backend.attend(q, kc, vc, batch, 0.125, k, v)
    rope_(batch.positions, q2, k2, cs)
    ref = backend.forward(q2, k2, v, kc2, vc2, batch, 0.125)
    assert rel_err(out, ref) < 1e-6 and torch.allclose(kc, kc2, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("short_split,merge,hpp", [(1, "two_pass", None), (8, "last", None), (1, "last", 1)])
def test_decode_rope_attend_equals_rope_kv_write_then_attend(randn, rel_err, head_dim, short_split, merge, hpp):
    """A pure-decode step's fused path (one kernel) against the two-kernel one, split and not
    (head_dim 48, not a power of two, always takes the two kernels); with the short-context split
    on (these contexts are short), the auto split (None) is fine-grained (key partitions merged in
    the launch, or a program per query head)."""
    from gpu_worker.kernels.rope import build_cos_sin_cache, rope_inv_freq
    from gpu_worker.tuning import DecodeAttentionTuning
    tuning = KernelTuning(decode_attention=DecodeAttentionTuning(short_max_splits=short_split, merge=merge,
                                                                 short_heads_per_program=hpp))
    n_heads, n_kv, page, n_blocks = 8, 2, 16, 40
    batch = make_batch([16, 40, 256], [1, 1, 1], page, 24, torch.randperm(n_blocks).int())
    T = batch.num_tokens
    cs = build_cos_sin_cache(rope_inv_freq(head_dim, 10000.0), 512)
    q, k, v = randn(T, n_heads, head_dim), randn(T, n_kv, head_dim), randn(T, n_kv, head_dim)
    kc, vc = randn(n_blocks, page, n_kv, head_dim), randn(n_blocks, page, n_kv, head_dim)
    for splits in (None, 3):
        q2, k2, kc2, vc2 = q.clone(), k.clone(), kc.clone(), vc.clone()
        backend = TritonAttentionBackend(decode_num_splits=splits, tuning=tuning)
        out = backend.decode_rope_attend(q, k, v, batch.positions, cs, kc, vc, batch, 0.125)
        backend.rope_kv_write(q2, k2, v, batch.positions, cs, kc2, vc2, batch.slot_mapping)
        ref = backend.attend(q2, kc2, vc2, batch, 0.125, k2, v)
        assert rel_err(out, ref) < 1e-6
        assert torch.allclose(kc, kc2, atol=1e-6) and torch.equal(vc, vc2)


def test_sliding_window_matches_torch_backend(randn, rel_err):
    n_heads, n_kv, head_dim, page, n_blocks = 4, 2, 64, 16, 40
    batch = make_batch([100, 0, 60], [1, 50, 7], page, 12, torch.randperm(n_blocks).int())
    T = batch.num_tokens
    q, k, v = randn(T, n_heads, head_dim), randn(T, n_kv, head_dim), randn(T, n_kv, head_dim)
    kc, vc = randn(n_blocks, page, n_kv, head_dim), randn(n_blocks, page, n_kv, head_dim)
    kc2, vc2 = kc.clone(), vc.clone()
    out = TritonAttentionBackend(sliding_window=20).forward(q, k, v, kc, vc, batch, 0.125)
    ref = torch_backend.TorchAttentionBackend(sliding_window=20).forward(q, k, v, kc2, vc2, batch, 0.125)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("computed,query_lens,fresh,kernel", [
    ([0, 0, 7], [17, 30, 1], True, "fresh_prefill_attention"),    # every prefill fresh (decode rows aside)
    ([0, 12], [17, 30], False, "fresh_prefill_attention"),        # a chunk behind a cached prefix: too
    ([0, 12], [16, 3], False, "paged_prefill_attention"),         # ... but not chunks of <= 16 tokens
    ([0, 0], [16, 3], True, "fresh_prefill_attention"),           # (fresh prompts of any length)
])
def test_triton_backend_picks_the_prefill_kernel(randn, rel_err, monkeypatch, computed, query_lens, fresh, kernel):
    import gpu_worker.attention.triton_backend as tb
    calls = []
    for name in ("fresh_prefill_attention", "paged_prefill_attention"):
        real = getattr(tb, name)
        monkeypatch.setattr(tb, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    n_heads, n_kv, d, page = 4, 2, 32, 16
    batch = make_batch(computed, query_lens, page, 8, torch.randperm(16).int())
    assert batch.fresh_prefill == fresh
    T = batch.num_tokens
    qkv = randn(T, (n_heads + 2 * n_kv) * d)                      # q, k, v as views of one row, as in the model
    q, k, v = (x.view(T, -1, d) for x in qkv.split([n_heads * d, n_kv * d, n_kv * d], dim=-1))
    kc, vc = randn(16, page, n_kv, d), randn(16, page, n_kv, d)
    backend = TritonAttentionBackend()
    out = backend.forward(q, k, v, kc, vc, batch, d ** -0.5)
    backend.forward(q, k, v, kc, vc, batch, d ** -0.5)                 # a second layer reuses the tile map
    assert calls == [kernel] * 2
    ref = torch_backend.TorchAttentionBackend().forward(q, k, v, kc.clone(), vc.clone(), batch, d ** -0.5)
    assert rel_err(out, ref) < 1e-5
    calls.clear()                                                     # the benchmarks' A/B switches
    TritonAttentionBackend(tuning=KernelTuning(fresh_prefix=False)).forward(q, k, v, kc, vc, batch, d ** -0.5)
    assert calls == ["fresh_prefill_attention" if fresh else "paged_prefill_attention"]
    calls.clear()
    TritonAttentionBackend(tuning=KernelTuning(fresh_prefix=False, fresh_prefill=False)).forward(
        q, k, v, kc, vc, batch, d ** -0.5)
    assert calls == ["paged_prefill_attention"]
