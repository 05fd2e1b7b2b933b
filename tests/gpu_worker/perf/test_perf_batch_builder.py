"""The numpy batch builder builds the same batch as the plain per-token definition."""
from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from gpu_worker.batch_builder import BatchBuilder, build_forward_batch
from gpu_worker.scheduler import ScheduledSeq

BS = 4


def reference(scheduled, bs):
    """The module docstring's definition, token by token."""
    ids, pos, slots, qlens, ctx, starts, logits = [], [], [], [], [], [0], []
    for seq, q in scheduled:
        c = seq.num_computed_tokens
        for p in range(c, c + q):
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
        qlens.append(q)
        ctx.append(c + q)
        starts.append(starts[-1] + q)
        if c + q == len(seq.token_ids):
            logits.append(starts[-1] - 1)
    return ids, pos, slots, qlens, ctx, starts, logits


def random_step(rng, n):
    scheduled = []
    for _ in range(n):
        total = rng.randint(1, 60)
        computed = rng.choice([0, rng.randint(0, total - 1)])          # fresh prompts often
        q = rng.choice([1, total - computed, rng.randint(1, total - computed)])
        blocks = rng.sample(range(500), -(-(computed + q) // BS))
        seq = SimpleNamespace(token_ids=[rng.randrange(1000) for _ in range(total)],
                              num_computed_tokens=computed, block_table=blocks)
        scheduled.append(ScheduledSeq(seq, q))
    return scheduled


def test_matches_the_definition_on_random_steps():
    rng = random.Random(0)
    builder = BatchBuilder(BS, "cpu")
    for trial in range(60):
        scheduled = random_step(rng, rng.randint(1, 9))
        batch = builder.build(scheduled) if trial % 2 else build_forward_batch(scheduled, BS, "cpu")
        ids, pos, slots, qlens, ctx, starts, logits = reference(scheduled, BS)
        assert batch.input_ids.tolist() == ids and batch.positions.tolist() == pos
        assert batch.slot_mapping.tolist() == slots and batch.query_lens.tolist() == qlens
        assert batch.context_lens.tolist() == ctx and batch.query_start_loc.tolist() == starts
        assert batch.logits_indices.tolist() == logits
        assert batch.max_query_len == max(qlens) and batch.max_context_len == max(ctx)
        # every prefill row starts at position 0 (decode rows aside): the fresh-prompt attention kernel
        assert batch.fresh_prefill == all(seq.num_computed_tokens == 0 or q == 1 for seq, q in scheduled)
        assert batch.block_tables.shape[1] % 16 == 0                    # padded width
        for i, (seq, _) in enumerate(scheduled):
            row = batch.block_tables[i].tolist()
            assert row[:len(seq.block_table)] == seq.block_table and set(row[len(seq.block_table):]) <= {0}
        assert batch.input_ids.dtype == torch.int64 and batch.block_tables.dtype == torch.int32
        for t in (batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_indices, batch.query_lens,
                  batch.context_lens, batch.query_start_loc, batch.block_tables):
            assert t.storage_offset() * t.element_size() % 64 == 0      # aligned kernel pointers


def test_earlier_batches_stay_intact():
    """CPU batches share memory with their host arrays: a later build must not overwrite them."""
    rng = random.Random(1)
    builder = BatchBuilder(BS, "cpu")
    first_step = random_step(rng, 5)
    first = builder.build(first_step)
    expected = first.input_ids.tolist(), first.block_tables.tolist()
    for _ in range(4):
        builder.build(random_step(rng, 7))
    assert (first.input_ids.tolist(), first.block_tables.tolist()) == expected
