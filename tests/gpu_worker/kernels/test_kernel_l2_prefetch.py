"""L2 prefetch programs beside the decode attention (kernels/l2_prefetch.py) under the
interpreter: in the "dry" mode they exist and split the bytes as on the GPU but issue nothing, so
these check that the attention programs after them still compute the reference."""
import pytest
import torch

from gpu_worker.kernels import l2_prefetch as l2
from gpu_worker.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref

from test_kernel_paged_decode import make_paged


def test_mode_under_the_interpreter(monkeypatch):
    w = torch.zeros(8, 8)
    monkeypatch.setattr(l2, "MODE", l2.MODES["off"])
    assert l2.mode_for(w) == 0
    for name in ("line", "evict_last", "bulk"):
        monkeypatch.setattr(l2, "MODE", l2.MODES[name])
        assert l2.mode_for(w) == l2.DRY and l2.mode_for(None) == 0


def test_spans_cover_the_bytes_in_whole_lines():
    w = torch.zeros(1000, 37)                       # 148,000 bytes
    for programs in (1, 7, 132, 5000):
        span = l2.span_bytes(w, programs)
        assert span % l2.SPAN_ALIGN == 0 and span * programs >= 148_000
        assert span - l2.SPAN_ALIGN < 148_000 / programs or span == l2.SPAN_ALIGN


@pytest.mark.parametrize("context_lens,num_splits", [([1, 17, 257], 1), ([257, 5], 3)])
def test_decode_with_prefetch_programs_matches_reference(randn, rel_err, monkeypatch, context_lens, num_splits):
    monkeypatch.setattr(l2, "MODE", l2.MODES["bulk"])
    n_kv, group, head_dim, page = 2, 4, 64, 16
    k_cache, v_cache, tables = make_paged(randn, context_lens, n_kv, head_dim, page)
    q = randn(len(context_lens), n_kv * group, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    weight = randn(96, 80)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, max_context_len=max(context_lens),
                                 num_splits=num_splits, block_n=32, l2_prefetch=weight)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    assert rel_err(out, ref) < 1e-5


def test_standalone_prefetch_leaves_the_tensor_alone(monkeypatch):
    monkeypatch.setattr(l2, "MODE", l2.MODES["line"])
    w = torch.randn(33, 48)
    before = w.clone()
    l2.l2_prefetch(w, programs=5)
    assert torch.equal(w, before)
