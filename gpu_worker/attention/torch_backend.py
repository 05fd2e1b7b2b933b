"""Plain-torch paged attention: the reference every faster backend is tested against.

Per step: scatter this step's K/V rows into the cache at `slot_mapping`, then for each sequence
gather its whole context from its block table and attend causally, in fp32.

    sequence i:  context (ctx = context_lens[i] tokens, read from blocks block_tables[i, :n])
    |<------------ cached prefix ------------>|<--- query_len new tokens --->|
                                               ^ query j sits at ctx - query_len + j and sees
                                                 keys 0 .. ctx - query_len + j

Correctness over speed: a Python loop over sequences, works on CPU and GPU.
"""
from __future__ import annotations

import torch

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.forward_batch import ForwardBatch


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, sliding_window: int | None = None):
        # Mistral-style window: query at position p sees keys p - window + 1 .. p.
        self.sliding_window = sliding_window

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping)

        out = torch.zeros_like(q)                                        # (T, nh, D)
        starts = batch.query_start_loc.tolist()
        ctx_lens = batch.context_lens.tolist()
        for i, ctx in enumerate(ctx_lens):
            qs, qe = starts[i], starts[i + 1]
            if qe == qs or ctx == 0:
                continue
            n_blocks = -(-ctx // block_size)
            blocks = batch.block_tables[i, :n_blocks].to(torch.long)
            keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]    # (ctx, nkv, D)
            vals = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]    # (ctx, nkv, D)
            keys = keys.float().repeat_interleave(group, dim=1)                 # (ctx, nh, D)
            vals = vals.float().repeat_interleave(group, dim=1)                 # (ctx, nh, D)
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), keys) * scale  # (nh, ql, ctx)
            scores.masked_fill_(~self._mask(qe - qs, ctx, q.device), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[qs:qe] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)  # (ql, nh, D)
        return out

    def _mask(self, query_len: int, ctx: int, device) -> torch.Tensor:
        """(ql, ctx) bool, True where query j may attend key p."""
        q_pos = torch.arange(ctx - query_len, ctx, device=device)[:, None]      # (ql, 1)
        k_pos = torch.arange(ctx, device=device)[None, :]                       # (1, ctx)
        allowed = k_pos <= q_pos
        if self.sliding_window is not None:
            allowed &= k_pos > q_pos - self.sliding_window
        return allowed


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter (T, nkv, D) rows into the caches; slots < 0 (padding rows) are skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))
