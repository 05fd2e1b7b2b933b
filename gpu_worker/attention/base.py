"""The attention interface every backend implements, and the paged KV-cache layout they share.

KV cache layout, per layer (one tensor each for K and V):

    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim)

A token at absolute position p of a sequence lives at slot `block_table[p // block_size] *
block_size + p % block_size`, i.e. k_cache.view(-1, num_kv_heads, head_dim)[slot].
GQA/MQA: query head h reads KV head h // (num_heads // num_kv_heads).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from gpu_worker.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache, then attends causally over each sequence's
    whole context (cached prefix + new tokens)."""

    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,        # (T, num_heads, head_dim)
        k: torch.Tensor,        # (T, num_kv_heads, head_dim), already rotated
        v: torch.Tensor,        # (T, num_kv_heads, head_dim)
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
        v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:          # (T, num_heads, head_dim)
        ...

    def forget_step_state(self) -> None:
        """Drop whatever the layers of one step share (computed by the first layer, reused by the
        rest), so that the next call computes it afresh: a CUDA-graph capture must record that
        work itself. Stateless backends have nothing to drop."""
