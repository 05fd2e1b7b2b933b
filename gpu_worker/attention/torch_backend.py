"""Plain-torch paged attention: the reference every faster backend is tested against.

Per step: scatter this step's K/V rows into the cache at `slot_mapping`, then for each sequence
gather its whole context from its block table and attend causally, in fp32.

    sequence i:  context (ctx = context_lens[i] tokens, read from blocks block_tables[i, :n])
    |<------------ cached prefix ------------>|<--- query_len new tokens --->|
                                               ^ query j sits at ctx - query_len + j and sees
                                                 keys 0 .. ctx - query_len + j

An fp8 cache (float8_e4m3fn) holds value / scale (k_scale, v_scale: one per tensor), saturated
to the format's range; reads multiply the scale back in, and the maths stays in fp32.

Correctness over speed: a Python loop over sequences, works on CPU and GPU.
"""
from __future__ import annotations

import torch

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.forward_batch import ForwardBatch


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
        # Mistral-style window: query at position p sees keys p - window + 1 .. p.
        self.sliding_window = sliding_window
        # fp8 KV caches: stored = value / scale, per tensor; ignored for other cache dtypes.
        self.k_scale, self.v_scale = k_scale, v_scale

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping, self.k_scale, self.v_scale)
        k_scale, v_scale = (self.k_scale, self.v_scale) if is_fp8(k_cache.dtype) else (1.0, 1.0)

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
            keys = (keys.float() * k_scale).repeat_interleave(group, dim=1)     # (ctx, nh, D)
            vals = (vals.float() * v_scale).repeat_interleave(group, dim=1)     # (ctx, nh, D)
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


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter (T, nkv, D) rows into the caches; slots < 0 (padding rows) are skipped. An fp8
    cache stores value / scale, saturated to its range (the scales are unused otherwise)."""
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    for rows, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(-1, cache.shape[2], cache.shape[3])                    # (slots, nkv, D)
        if is_fp8(cache.dtype):
            fmax = torch.finfo(cache.dtype).max
            rows = (rows.float() / scale).clamp(-fmax, fmax).to(cache.dtype)
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)         # no fp8 index_copy_ on CPU
        flat.index_copy_(0, slots, rows.to(flat.dtype))
