"""Turns the scheduler's choice into the model runner's ForwardBatch.

For scheduled sequence i with c = num_computed_tokens and q = num_new_tokens:

    token_ids[c : c+q]  -> input_ids rows  [start_i, start_i + q)   (start_i = query_start_loc[i])
    positions             c, c+1, ..., c+q-1
    slot of position p    block_table[p // block_size] * block_size + p % block_size
    context_len           c + q
    logits row            start_i + q - 1, only when c + q == num_tokens (the sequence samples)
"""
from __future__ import annotations

import torch

from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.scheduler import ScheduledSeq


def build_forward_batch(scheduled: list[ScheduledSeq], block_size: int,
                        device: torch.device | str) -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    starts = [0]
    logits_indices: list[int] = []
    for item in scheduled:
        seq, q = item.seq, item.num_new_tokens
        c = seq.num_computed_tokens
        table = seq.block_table
        input_ids.extend(seq.token_ids[c:c + q])
        positions.extend(range(c, c + q))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c, c + q))
        query_lens.append(q)
        context_lens.append(c + q)
        starts.append(starts[-1] + q)
        if item.samples:
            logits_indices.append(starts[-1] - 1)

    max_blocks = max(len(item.seq.block_table) for item in scheduled)
    tables = [item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table)) for item in scheduled]

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=t(input_ids, torch.int64),          # (T,)
        positions=t(positions, torch.int64),          # (T,)
        query_lens=t(query_lens, torch.int32),        # (B,)
        context_lens=t(context_lens, torch.int32),    # (B,)
        query_start_loc=t(starts, torch.int32),       # (B+1,)
        block_tables=t(tables, torch.int32),          # (B, max_blocks)
        slot_mapping=t(slots, torch.int64),           # (T,)
        logits_indices=t(logits_indices, torch.int64),  # (S,)
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )
