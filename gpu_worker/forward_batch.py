"""ForwardBatch: what the engine's scheduler hands the model runner for one step.

There is no prefill or decode phase: each scheduled sequence contributes `query_len` new
tokens (a prefill chunk or one decode token) that attend to everything before them.

    sequence i, this step:
    |<------------- context_len = computed_len + query_len ------------->|
    |<---- computed_len (already in KV cache) ---->|<---- query_len ---->|
                                                    ^ positions start here

All tokens of all sequences are flattened into one ragged batch of T = sum(query_lens) rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # (T,) int64, new tokens of every sequence, concatenated
    positions: torch.Tensor      # (T,) int64, absolute position of each new token
    query_lens: torch.Tensor     # (B,) int32, new tokens per sequence this step
    context_lens: torch.Tensor   # (B,) int32, KV length per sequence after this step
    query_start_loc: torch.Tensor  # (B+1,) int32, prefix sums of query_lens
    block_tables: torch.Tensor   # (B, max_blocks) int32, physical block ids, padded with 0
    slot_mapping: torch.Tensor   # (T,) int64, cache slot (block * block_size + offset) per new token
    logits_indices: torch.Tensor  # (S,) int64, rows of T whose logits are wanted (last token of
                                  # each sequence that samples this step)
    max_query_len: int
    max_context_len: int
    # Sequences with query_len 1, when the builder counted them (None: unknown). A prefill-only
    # step (0) skips the decode attention launch: eager steps are host-bound at small sizes.
    num_decode_seqs: int | None = None
    # Every row with query_len > 1 starts at position 0 (no cached prefix), known on the host: the
    # Triton backend may then take its fresh-prompt attention kernel. False when unknown.
    fresh_prefill: bool = False
    # Rows past query_start_loc[-1] are padding (a prefill CUDA graph's bucket): attention leaves
    # no unwritten memory in them (a NaN there would reach real rows through the next layer's V).
    padded_rows: bool = False
    # Lower-tier loads this step's forward scatters layer by layer, each layer's just before it
    # runs (gpu_worker/kv_tiers/layer_loads.py: before_layer(i), finish()); None: none.
    layer_loads: object | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
