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
    writes_rope_kv: bool = False
    """Whether the backend has rope_kv_write + attend (RoPE fused into the KV write), which a
    model then calls instead of rope + forward."""
    fuse_rope_decode: bool = False
    """Whether a pure-decode step may go to decode_rope_attend (RoPE, KV write and attention in
    one kernel where that is faster)."""
    decode_num_splits: int | None = None
    """Backends whose decode kernel splits contexts: a fixed split count for eager steps (the
    runner pins it; None: chosen per step). `pins_decode_splits` says whether the backend has one."""
    pins_decode_splits: bool = False

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

    # Optional: backends that set writes_rope_kv / fuse_rope_decode implement these.
    def rope_kv_write(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping) -> None:
        """Rotate q, k in place (unrotated views of the qkv output) and write k, v into the cache."""
        raise NotImplementedError(f"the {self.name} backend has no fused rope_kv_write")

    def attend(self, q, k_cache, v_cache, batch: ForwardBatch, scale: float, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Attention over caches that already hold this step's K/V -> (T, nh, D)."""
        raise NotImplementedError(f"the {self.name} backend has no attend")

    def decode_rope_attend(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, batch: ForwardBatch,
                           scale: float) -> torch.Tensor:
        """A pure-decode step's RoPE, KV write and attention -> (T, nh, D)."""
        raise NotImplementedError(f"the {self.name} backend has no decode_rope_attend")
