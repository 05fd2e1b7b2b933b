"""Vocab-parallel embedding and lm_head: the vocabulary rows are split over ranks.

The vocabulary is padded to a multiple of the rank count (pad rows are zero and their logits
are cut off), so every rank holds Vp = ceil(V / N) rows:

    rank r owns token ids [r*Vp, (r+1)*Vp)
    embedding: look up the ids this rank owns, zeros elsewhere, all-reduce   (T, H)
    lm_head:   local logits (S, Vp), all-gather along the vocab -> (S, N*Vp)[:, :V]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.parallel.state import ParallelContext, all_gather_last_dim, all_reduce
from gpu_worker.parallel.tp_linear import Shard


def padded_vocab_per_rank(vocab_size: int, world_size: int) -> int:
    return -(-vocab_size // world_size)


def vocab_shard(vocab_size: int, ctx: ParallelContext) -> Shard:
    """Checkpoint rows of this rank (the last rank's may be fewer than Vp: the rest is padding)."""
    per = padded_vocab_per_rank(vocab_size, ctx.world_size)
    start = min(vocab_size, ctx.rank * per)
    return Shard(0, start, min(vocab_size, start + per))


class VocabParallelEmbedding(nn.Module):
    """weight (Vp, H): rows [r*Vp, (r+1)*Vp) of the padded table."""

    def __init__(self, vocab_size: int, hidden: int, ctx: ParallelContext, dtype: torch.dtype | None = None):
        super().__init__()
        self.ctx, self.vocab_size = ctx, vocab_size
        self.per_rank = padded_vocab_per_rank(vocab_size, ctx.world_size)
        self.start = ctx.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:     # (T,) -> (T, H)
        if not self.ctx.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)   # (T, H)
        x = x.masked_fill(outside[:, None], 0)
        return all_reduce(x, self.ctx)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                          ctx: ParallelContext) -> torch.Tensor:
    """hidden (S, H), this rank's lm_head rows weight (Vp, H) -> full (S, V) float32 logits."""
    local = (hidden @ weight.t()).float()                 # (S, Vp)
    return all_gather_last_dim(local, ctx)[:, :vocab_size]  # (S, V)
