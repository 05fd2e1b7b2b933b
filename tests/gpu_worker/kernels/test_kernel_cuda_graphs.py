"""DecodeGraphs' buffer and padding logic, run eagerly on the CPU with the Triton backend."""
import dataclasses
import gc
import re
import time

import pytest
import torch

from gpu_worker.attention.triton_backend import TritonAttentionBackend
from gpu_worker.cuda_graphs import DecodeGraphs, capture_sizes, no_gc
from test_kernel_triton_backend import make_batch


def test_capture_sizes_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and 256 in sizes and 272 in sizes
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:]))


def test_no_gc_holds_collections_off_and_restores_the_state():
    """Captures run inside no_gc: the cyclic GC is off within it, back on after it (also when the
    capture raises), and left off where the caller had turned it off."""
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with no_gc():
            assert not gc.isenabled()
            raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_padded_replay_matches_direct_call(randn, rel_err):
    """A 3-sequence decode step through a 4-row 'graph' equals the plain backend call, and the
    padding row touches no cache slot."""
    n_heads, n_kv, head_dim, page, n_blocks = 4, 2, 64, 16, 30
    kc, vc = randn(n_blocks, page, n_kv, head_dim), randn(n_blocks, page, n_kv, head_dim)
    w_q = randn(8, n_heads * head_dim)
    w_kv = randn(8, 2 * n_kv * head_dim)
    backend = TritonAttentionBackend()

    def run_model(batch):                      # a one-layer "model": ids -> q, k, v -> attention
        x = torch.nn.functional.one_hot(batch.input_ids % 8, 8).float()
        q = (x @ w_q).view(-1, n_heads, head_dim)
        k, v = (x @ w_kv).view(-1, 2, n_kv, head_dim).unbind(1)
        return backend.forward(q, k, v, kc, vc, batch, head_dim ** -0.5).reshape(x.shape[0], -1)

    graphs = DecodeGraphs(run_model, device=torch.device("cpu"), max_batch_size=4, max_blocks_per_seq=8,
                          max_context_len=128, sizes=[2, 4])
    graphs.capture()
    batch = make_batch([15, 40, 70], [1, 1, 1], page, 6, torch.randperm(n_blocks).int())
    batch.input_ids = torch.tensor([3, 5, 7])
    assert graphs.can_run(batch) and graphs.bucket(3) == 4
    kc0, vc0 = kc.clone(), vc.clone()
    out = graphs.run(batch).clone()
    kc_graph, vc_graph = kc.clone(), vc.clone()
    kc.copy_(kc0), vc.copy_(vc0)
    ref = run_model(batch)
    assert rel_err(out, ref) < 1e-6
    assert torch.equal(kc_graph, kc) and torch.equal(vc_graph, vc)   # the padding row wrote nothing


def test_can_run_rejects_prefill_and_oversized():
    graphs = DecodeGraphs(lambda b: torch.zeros(b.num_tokens, 1), device=torch.device("cpu"), max_batch_size=2,
                          max_blocks_per_seq=4, max_context_len=64, sizes=[1, 2])
    graphs.capture()
    assert not graphs.can_run(make_batch([0], [5], 16, 4, torch.arange(8).int()))          # prefill
    assert not graphs.can_run(make_batch([3, 3, 3], [1, 1, 1], 16, 4, torch.arange(8).int()))  # 3 > 2 rows
    assert graphs.can_run(make_batch([3, 3], [1, 1], 16, 4, torch.arange(8).int()))


def test_capture_times_every_size_largest_first():
    """Each captured size gets its seconds, largest first (the capture order); the summary names
    the count, the total and the slowest sizes."""
    seen = []

    def run_model(batch):
        seen.append(batch.num_seqs)
        if batch.num_seqs == 2:
            time.sleep(0.05)        # stands in for a size whose kernels compile
        return torch.zeros(batch.num_tokens, 1)

    graphs = DecodeGraphs(run_model, device=torch.device("cpu"), max_batch_size=4, max_blocks_per_seq=4,
                          max_context_len=64, sizes=[1, 2, 4])
    graphs.capture()
    assert seen == [4, 2, 1] and list(graphs.capture_times.seconds) == [4, 2, 1]
    summary = graphs.capture_times.summary(slowest=1)
    assert re.fullmatch(r"3 decode \(context 64\) CUDA graphs in \d+\.\d s \(slowest: 2 \d+\.\d s\)", summary), summary


def test_builder_decode_batch_refills_ids_positions_slots_in_one_copy():
    """A pure-decode step from the batch builder stages ids, positions and slots as equal segments
    of one tensor: `_stacked_rows` sees them as one (3, B) view (one copy per replay instead of
    three) and the replay reads the same rows as from three separate tensors; tensors laid out
    otherwise fall back to the three copies."""
    from types import SimpleNamespace

    from gpu_worker.batch_builder import BatchBuilder
    from gpu_worker.cuda_graphs import _stacked_rows
    from gpu_worker.scheduler import ScheduledSeq

    seqs = [SimpleNamespace(token_ids=list(range(10, 10 + n)), num_computed_tokens=n - 1,
                            block_table=list(range(3 * i, 3 * i + -(-n // 4)))) for i, n in enumerate((5, 9, 2))]
    batch = BatchBuilder(4, "cpu").build([ScheduledSeq(s, 1) for s in seqs])
    stacked = _stacked_rows(batch.input_ids, batch.positions, batch.slot_mapping)
    assert stacked is not None and stacked.shape == (3, 3)
    assert stacked.tolist() == [batch.input_ids.tolist(), batch.positions.tolist(), batch.slot_mapping.tolist()]
    assert _stacked_rows(batch.input_ids.clone(), batch.positions, batch.slot_mapping) is None   # other storage
    assert _stacked_rows(batch.input_ids, batch.slot_mapping, batch.positions) is None           # unequal gaps
    whole = torch.arange(12)
    assert _stacked_rows(whole[0:4], whole[2:6], whole[4:8]) is None                              # overlapping

    seen = []
    graphs = DecodeGraphs(lambda b: seen.append((b.input_ids.tolist(), b.positions.tolist(),
                                                 b.slot_mapping.tolist(), b.context_lens.tolist()))
                          or torch.zeros(b.num_tokens, 1),
                          device=torch.device("cpu"), max_batch_size=4, max_blocks_per_seq=16,
                          max_context_len=64, sizes=[4])
    graphs.capture()
    seen.clear()
    graphs.run(batch)
    separate = dataclasses.replace(batch, input_ids=batch.input_ids.clone(), positions=batch.positions.clone(),
                                   slot_mapping=batch.slot_mapping.clone())
    graphs.run(separate)
    expect = ([14, 18, 11, 0], [4, 8, 1, 0], [4, 20, 25, -1], [5, 9, 2, 0])   # padding row: slot -1, context 0
    assert seen[0] == seen[1] == expect
