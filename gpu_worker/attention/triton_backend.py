"""Triton paged attention: KV write, then the decode kernel and/or the prefill kernel.

    pure decode batch (max_query_len == 1):  paged_decode_attention over all rows (split-K when the
                                             batch is too small to fill the GPU)
    anything else (prefill, chunked, mixed): paged_decode_attention on the rows with query_len 1
                                             (other rows exit at once; not launched when the
                                             builder counted none), paged_prefill_attention on
                                             the query tiles of the others (numbered on the device
                                             once per step), so no host sync decides who is who;
                                             it reads this step's own keys from the contiguous
                                             k / v rows and only the cached prefix from the cache;
                                             on Hopper, prompts and chunks of up to 8k tokens
                                             take fresh_prefill_attention instead (q and this
                                             step's K/V through TMA, a tile map instead of the
                                             scan; a cached prefix through the block table)

No step does a host sync or depends on tensor values on the host: the grids come from
ForwardBatch's host-side ints (num_seqs, max_query_len, max_context_len), so a pure-decode step
can be captured in a CUDA graph (gpu_worker/cuda_graphs.py) with max_context_len fixed at the
model's maximum.

`rope_kv_write` + `attend` is the same with the rotary embedding fused into the KV write (one
kernel fewer per layer); a model calls them instead of rope_ + forward (`writes_rope_kv`).
The kernels' choices (decode splits and tiles, which prefill kernel) come from the engine's
KernelTuning (gpu_worker/tuning.py), read once here at construction.

A sliding window (Mistral-style: the query at position p sees keys p - W + 1 .. p) is supported
by both kernels. An fp8 KV cache (the caches' dtype float8_e4m3fn) is written and read with the per-tensor
k_scale / v_scale given here (1.0 unless calibrated).
"""
from __future__ import annotations

import torch

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.kernels.fresh_prefill_attention import (CachedPrefix, fresh_config, fresh_prefill_attention,
                                                        fresh_prefill_supported, fresh_tile_map)
from gpu_worker.kernels.kv_cache_write import kv_cache_write
from gpu_worker.kernels.paged_decode_attention import (DecodeSplit, FusedRopeKV, choose_decode_split,
                                                       paged_decode_attention)
from gpu_worker.kernels.paged_prefill_attention import (paged_prefill_attention, prefill_config,
                                                        prefill_tile_starts)
from gpu_worker.kernels.rope_kv_write import rope_kv_write
from gpu_worker.tuning import KernelTuning


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    writes_rope_kv = True
    pins_decode_splits = True

    def __init__(self, sliding_window: int | None = None, decode_num_splits: int | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0, tuning: KernelTuning = KernelTuning()):
        self.sliding_window = sliding_window
        self.decode_tuning = tuning.decode_attention
        # Pure-decode steps whose decode kernel is split: RoPE and the KV write inside it
        # (decode_rope_attend), one launch instead of two per layer. On the H200, batch-1 decode
        # graph ms fused vs separate: 8k context (split) bf16 4.61 vs 4.67, fp8 3.18 vs 3.23;
        # 128 context unsplit (8 programs) bf16 4.47 vs 4.45, fp8 3.15 vs 3.00, hence separate
        # there. Short contexts run several programs per KV head too (choose_short_split) and
        # fuse: 4.42 -> 4.15 ms at 128 context.
        self.fuse_rope_decode = tuning.fuse_rope_decode
        # Steps whose prefills are all fresh (ForwardBatch.fresh_prefill) and at most 8,192 tokens
        # long (fresh_config), without a sliding window, on rows TMA can read (Hopper):
        # kernels/fresh_prefill_attention.py instead of paged_prefill_attention (1.14x its speed on
        # 8 x 2k prompts, 1.33x on 32 x 512, 1.07x on 1 x 8k).
        self.fresh_prefill = tuning.fresh_prefill
        # ... and steps with chunks behind a cached prefix too, the prefix read through the block
        # table (1.00-1.03x v2 at the same tiles; with PREFIX_CONFIG's 128 x 128 tiles 1.06-1.10x
        # v2's defaults on 512-2k chunks behind 1.5-6k tokens); not for chunks of <= 16 tokens
        # (v2's 16-row tiles).
        self.fresh_prefix = tuning.fresh_prefix
        # fp8 KV caches (float8_e4m3fn): stored = value / scale, per tensor; ignored otherwise.
        self.k_scale, self.v_scale = k_scale, v_scale
        # (query_start_loc, (kernel, tokens per tile), tile numbering) of the current step:
        # computed by the first layer, reused by the rest (_step_tiles)
        self._tiles: tuple | None = None
        # A fixed split count with the kernel's default tiles (eager GPU steps pin it: a bounded
        # set of compiled variants); None: choose_decode_split per step (CUDA-graph captures,
        # whose max_context_len is the graph's bound, and the CPU).
        self.decode_num_splits = decode_num_splits

    def decode_split(self, batch: ForwardBatch, q: torch.Tensor, k_cache: torch.Tensor) -> DecodeSplit:
        """How this step's decode kernel splits each context (decode_num_splits says which way)."""
        if self.decode_num_splits:
            return DecodeSplit(self.decode_num_splits)
        n_kv = k_cache.shape[2]
        return choose_decode_split(batch.num_seqs, n_kv, batch.max_context_len, q.device, q.shape[1] // n_kv,
                                   k_cache.dtype, self.decode_tuning)

    def forget_step_state(self) -> None:
        self._tiles = None

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
        # q (T, nh, D); k, v (T, nkv, D), k already rotated; caches (num_blocks, block_size, nkv, D)
        kv_cache_write(k, v, k_cache, v_cache, batch.slot_mapping, self.k_scale, self.v_scale)
        return self.attend(q, k_cache, v_cache, batch, scale, k, v)

    @staticmethod
    def _decode_query_start_loc(batch: ForwardBatch) -> torch.Tensor | None:
        """query_start_loc for the decode kernel, or None where row b of q is sequence b's query
        (a pure-decode step: T == B, every query_len 1): one dependent load fewer per program."""
        if batch.is_pure_decode and batch.num_tokens == batch.num_seqs:
            return None
        return batch.query_start_loc

    def rope_kv_write(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                      slot_mapping: torch.Tensor) -> None:
        """The rotary embedding fused into the KV write: q and k arrive unrotated and are rotated
        in place; one kernel instead of rope_ + kv_cache_write. `attend` follows."""
        rope_kv_write(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                      self.k_scale, self.v_scale)

    def decode_rope_attend(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, batch: ForwardBatch,
                           scale: float) -> torch.Tensor:
        """A pure-decode step's RoPE, KV write and attention -> (T, nh, D): q and k arrive
        unrotated (views of the qkv output). One kernel when the decode kernel runs several
        programs per KV head (split, or blocks of fewer query heads: DecodeSplit.fine) and
        head_dim is a power of two (q and k then stay unrotated in memory), else rope_kv_write
        then attend (fuse_rope_decode says why)."""
        out = torch.empty_like(q)
        if batch.num_tokens == 0:
            return out
        split = self.decode_split(batch, q, k_cache)
        head_dim = q.shape[-1]
        fusable = (head_dim & (head_dim - 1)) == 0 and cos_sin_cache[0].numel() == head_dim
        if not split.fine or not fusable:          # (the fused kernel pairs d with d +- head_dim / 2)
            self.rope_kv_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, batch.slot_mapping)
            return self.attend(q, k_cache, v_cache, batch, scale, k, v)
        paged_decode_attention(
            q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale,
            max_context_len=batch.max_context_len, query_start_loc=self._decode_query_start_loc(batch),
            out=out, num_splits=split.num_splits, block_n=split.block_n,
            heads_per_program=split.heads_per_program, num_warps=split.num_warps,
            sliding_window=self.sliding_window, k_scale=self.k_scale, v_scale=self.v_scale,
            rope=FusedRopeKV(positions, cos_sin_cache, k, v, batch.slot_mapping), tuning=self.decode_tuning)
        return out

    def attend(self, q, k_cache, v_cache, batch: ForwardBatch, scale: float, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Attention over caches that already hold this step's K/V -> (T, nh, D). k, v: this step's
        K (rotated) / V rows (T, nkv, D), aligned with q's: the prefill kernel reads this step's
        keys from them (raw values: with an fp8 cache, unquantized) and only the cached prefix
        from the cache."""
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        # (T, nh, D). Padding rows (no kernel writes them) are zeroed: the prefill kernels' last key
        # tile reads the padding's V, masked (p = 0), and 0 x NaN from unwritten memory is NaN.
        out = torch.zeros_like(q) if batch.padded_rows else torch.empty_like(q)
        if batch.num_tokens == 0:
            return out
        if batch.num_decode_seqs != 0:                                    # rows with query_len 1
            split = self.decode_split(batch, q, k_cache)
            paged_decode_attention(
                q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale,
                max_context_len=batch.max_context_len, query_start_loc=self._decode_query_start_loc(batch),
                out=out, num_splits=split.num_splits, block_n=split.block_n,
                heads_per_program=split.heads_per_program, num_warps=split.num_warps,
                sliding_window=self.sliding_window, tuning=self.decode_tuning, **scales)
        if batch.is_pure_decode:
            return out
        behind = not batch.fresh_prefill                    # some chunk may have a cached prefix
        cfg = fresh_config(batch.max_query_len, batch.max_context_len if behind else 0)
        if (cfg is not None and self.fresh_prefill and self.sliding_window is None
                and (not behind or (self.fresh_prefix and batch.max_query_len > 16))
                and fresh_prefill_supported(q, k, v)):                    # rows with query_len > 1
            tiles = self._step_tiles(batch, "fresh", cfg.block_m, lambda: fresh_tile_map(
                batch.query_start_loc, cfg.block_m, batch.num_tokens, skip_decode_rows=True))
            prefix = CachedPrefix(k_cache, v_cache, batch.block_tables, batch.context_lens,
                                  self.k_scale, self.v_scale) if behind else None
            return fresh_prefill_attention(q, k, v, batch.query_start_loc, scale, max_query_len=batch.max_query_len,
                                           out=out, skip_decode_rows=True, tiles=tiles, config=cfg, prefix=prefix)
        group = q.shape[1] // k_cache.shape[2]
        cfg = prefill_config(batch.max_query_len, q.shape[2], group)
        tile_tokens = cfg.tile_tokens(group)
        tile_starts = self._step_tiles(batch, "paged", tile_tokens, lambda: prefill_tile_starts(
            batch.query_start_loc, tile_tokens, skip_decode_rows=True))
        paged_prefill_attention(
            q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.query_start_loc, scale,
            max_query_len=batch.max_query_len, out=out, skip_decode_rows=True,
            sliding_window=self.sliding_window, tile_starts=tile_starts, k_new=k, v_new=v, config=cfg,
            **scales)
        return out

    def _step_tiles(self, batch: ForwardBatch, kernel: str, tile_tokens: int, make):
        """This step's query-tile numbering for `kernel`: made by the first layer (make()), reused
        by the others (the same query_start_loc tensor and tile size)."""
        key = (kernel, tile_tokens)
        if self._tiles is None or self._tiles[0] is not batch.query_start_loc or self._tiles[1] != key:
            self._tiles = (batch.query_start_loc, key, make())
        return self._tiles[2]
