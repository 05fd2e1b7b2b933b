"""The command channel between a tensor-parallel worker's rank 0 and its followers.

Every command is a fixed-size int64 header, optionally followed by one int64 payload, both
broadcast from rank 0 on the gloo control group (tensors only: nothing is pickled):

    FORWARD      [1, T, B, W, S, max_query_len, max_context_len, 0]  + the packed ForwardBatch
    ALLOCATE_KV  [2, num_blocks, block_size]
    COPY_BLOCKS  [3, n]                                               + src (n) | dst (n)
    PROFILE      [4, block_size, gpu_memory_utilization * 1e6, max_num_batched_tokens]
    CAPTURE      [5, max_batch_size, max_context_len]        decode CUDA graphs, on every rank
    WARMUP       [6, max_num_seqs]                          compile kernel variants, on every rank
    SHUTDOWN     [9]
    TIERS        [7, n]                                           + n int64 of KV tier records, replayed
    TIER_INIT    [8, json_len, num_hashes]                        + TierInit (JSON bytes) | disk index
                                                                    -> all ranks' MIN of each hash held
    TIER_STAGE   [10, load_id, n]                                 + n sources (4 each) -> MIN staged
    TIER_CHECK   [11, num_loads, num_hashes]                      + live load ids | disk index -> MIN ok
    TIER_LAND    [12, load_id]                 -> MIN of the leading file blocks each rank verified
                                                  (-1: a rank's reads still run; asked again later)

Rank 0 queues the tiers' records as its tiers act and sends them as one TIERS command before its
next command, so every rank runs them at the same place among the forward steps
(gpu_worker/parallel/tp_tiers.py, tp_tier_records.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gpu_worker.forward_batch import ForwardBatch

OP_FORWARD, OP_ALLOCATE_KV, OP_COPY_BLOCKS, OP_PROFILE, OP_CAPTURE, OP_WARMUP, OP_SHUTDOWN = 1, 2, 3, 4, 5, 6, 9
OP_TIERS, OP_TIER_INIT, OP_TIER_STAGE, OP_TIER_CHECK, OP_TIER_LAND = 7, 8, 10, 11, 12
HEADER_LEN = 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- wire format: a ForwardBatch as one header + one int64 payload -------------------------
def pack_batch(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """header [FORWARD, T, B, W, S, max_query_len, max_context_len, 0]; payload, in order:
    input_ids (T) | positions (T) | slot_mapping (T) | query_lens (B) | context_lens (B) |
    query_start_loc (B+1) | block_tables (B*W) | logits_indices (S)."""
    t, b = batch.num_tokens, batch.num_seqs
    w, s = int(batch.block_tables.shape[1]), int(batch.logits_indices.shape[0])
    header = torch.tensor([OP_FORWARD, t, b, w, s, batch.max_query_len, batch.max_context_len, 0],
                          dtype=torch.int64)
    parts = [batch.input_ids, batch.positions, batch.slot_mapping, batch.query_lens, batch.context_lens,
             batch.query_start_loc, batch.block_tables.reshape(-1), batch.logits_indices]
    payload = torch.cat([p.to("cpu", torch.int64) for p in parts])
    return header, payload


def payload_len(header: torch.Tensor) -> int:
    t, b, w, s = (int(v) for v in header[1:5])
    return 3 * t + 3 * b + 1 + b * w + s


def unpack_batch(header: torch.Tensor, payload: torch.Tensor) -> ForwardBatch:
    t, b, w, s, max_q, max_ctx = (int(v) for v in header[1:7])
    sizes = [t, t, t, b, b, b + 1, b * w, s]
    ids, pos, slots, qlens, clens, qsl, tables, logits_idx = payload.split(sizes)
    i32 = torch.int32
    return ForwardBatch(input_ids=ids, positions=pos, query_lens=qlens.to(i32), context_lens=clens.to(i32),
                        query_start_loc=qsl.to(i32), block_tables=tables.to(i32).view(b, w),
                        slot_mapping=slots, logits_indices=logits_idx,
                        max_query_len=max_q, max_context_len=max_ctx)


def make_header(*values: int) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return h


def all_min(value: int, group) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def all_min_each(values: torch.Tensor, group) -> torch.Tensor:
    """Elementwise MIN of an int64 vector over every rank."""
    values = values.to(torch.int64).clone()
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    return values
