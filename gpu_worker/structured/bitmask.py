"""The token bitmask of a step's constrained rows, filled on the host and applied on the device.

    rows of the step's draw:   r0 r1 r2 r3 ...        (one per SampleRequest)
    constrained:                   r1    r3           GrammarMask.rows = [1, 3]
    bitmask (R, ceil(V/32)) int32: row r of a constrained draw = its matcher's allowed tokens
                                   (bit v of word v // 32); other rows are never read

Filling is xgrammar's fill_next_token_bitmask per constrained row (C++); the host tensor goes to
the device with one non-blocking copy from pinned memory, and one xgrammar op
(apply_token_bitmask_inplace with indices: a CUDA kernel on the GPU) sets the disallowed
logits to -inf. Nothing here runs for a batch without constrained rows.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch


class GrammarMask(NamedTuple):
    bitmask: torch.Tensor    # (R, ceil(V/32)) int32 on the logits' device
    rows: list[int]          # the draw rows it constrains


def build_grammar_mask(matchers: list[tuple[int, Any]], num_rows: int, vocab: int,
                       device: torch.device) -> GrammarMask:
    """matchers: (draw row, GrammarMatcher) of each constrained row."""
    import xgrammar
    host = xgrammar.allocate_token_bitmask(num_rows, vocab)                    # (R, W) int32, all ones
    for row, matcher in matchers:
        matcher.fill_next_token_bitmask(host, row)
    if device.type == "cuda":
        bitmask = host.pin_memory().to(device, non_blocking=True)
    else:
        bitmask = host
    return GrammarMask(bitmask, [row for row, _ in matchers])


def apply_grammar_mask(x: torch.Tensor, mask: GrammarMask) -> None:
    """x (R, V) float logits: -inf where a constrained row's grammar disallows the token."""
    import xgrammar
    xgrammar.apply_token_bitmask_inplace(x, mask.bitmask, vocab_size=x.shape[1], indices=mask.rows)
