"""The command channel's ForwardBatch packing round-trips exactly, and shard arithmetic."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.parallel.state import ParallelContext
from gpu_worker.parallel.tp_linear import head_shard, kv_head_shard, kv_heads_per_rank
from gpu_worker.parallel.tp_protocol import OP_FORWARD, pack_batch, payload_len, unpack_batch
from gpu_worker.parallel.vocab_parallel import vocab_shard
from parallel_helpers import batch_for


def test_forward_batch_round_trips():
    batch = batch_for([[1, 2, 3, 4, 5], [9, 8]], [2, 0], [[3, 1], [0, 2, 5]])
    header, payload = pack_batch(batch)
    assert int(header[0]) == OP_FORWARD and payload_len(header) == payload.numel()
    back = unpack_batch(header, payload.clone())
    for name in ("input_ids", "positions", "query_lens", "context_lens", "query_start_loc",
                 "block_tables", "slot_mapping", "logits_indices"):
        ours, ref = getattr(back, name), getattr(batch, name)
        assert ours.dtype == ref.dtype and torch.equal(ours, ref), name
    assert (back.max_query_len, back.max_context_len) == (batch.max_query_len, batch.max_context_len)


@pytest.mark.parametrize("nkv,world,expected", [(8, 2, [(0, 4), (4, 8)]), (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
                                               (1, 2, [(0, 1), (0, 1)])])
def test_kv_heads_split_or_replicate(nkv, world, expected):
    got = []
    for r in range(world):
        s = kv_head_shard(nkv, 1, ParallelContext(r, world))
        got.append((s.start, s.stop))
        # the rank's query heads all map onto its KV heads (GQA groups stay whole)
        q = head_shard(8, 1, ParallelContext(r, world))
        group = 8 // nkv
        assert {h // group for h in range(q.start, q.stop)} <= set(range(s.start, s.stop))
    assert got == expected and kv_heads_per_rank(nkv, world) == expected[0][1] - expected[0][0]
    with pytest.raises(ValueError):
        kv_heads_per_rank(3, 2)


def test_vocab_shards_pad_the_last_rank():
    shards = [vocab_shard(1001, ParallelContext(r, 2)) for r in range(2)]
    assert [(s.start, s.stop) for s in shards] == [(0, 501), (501, 1001)]
