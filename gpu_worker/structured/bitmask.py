"""The token bitmask of a step's constrained rows, filled on the host and applied on the device.

    rows of the step's draw:   r0 r1 r2 r3 ...        (one per SampleRequest)
    constrained:                   r1    r3           GrammarMask.rows = [1, 3]
    bitmask (R, ceil(V/32)) int32: row r of a constrained draw = its matcher's allowed tokens
                                   (bit v of word v // 32); other rows are never read

A sequence verifying speculative drafts d0..dk-1 owns rows r..r+k (row j: the model after d<j):
row j gets the mask after the matcher accepted d0..dj-1, and the matcher is rolled back after
(fill_draft_rows). A draft the grammar refuses ends the filling: its row's mask excludes it, so
its draw differs from it and no later row is kept.

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


def build_grammar_mask(entries: list[tuple[int, Any, list[int]]], num_rows: int, vocab: int,
                       device: torch.device) -> GrammarMask:
    """entries: (first draw row, GrammarMatcher, drafts verified: [] when none) of each
    constrained sequence."""
    import xgrammar
    host = xgrammar.allocate_token_bitmask(num_rows, vocab)                    # (R, W) int32, all ones
    rows: list[int] = []
    for row, matcher, drafts in entries:
        rows += fill_draft_rows(matcher, drafts, host, row)
    if device.type == "cuda":
        bitmask = host.pin_memory().to(device, non_blocking=True)
    else:
        bitmask = host
    return GrammarMask(bitmask, rows)


def fill_draft_rows(matcher: Any, drafts: list[int], host: torch.Tensor, row: int) -> list[int]:
    """Fill rows row.. with the masks after each prefix of drafts; the matcher ends where it
    began. Returns the rows filled."""
    filled = [row]
    matcher.fill_next_token_bitmask(host, row)
    advanced = 0
    for j, token in enumerate(drafts):
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        advanced += 1
        if matcher.is_terminated():     # the draft completed the grammar: nothing may follow it
            break
        matcher.fill_next_token_bitmask(host, row + j + 1)
        filled.append(row + j + 1)
    if advanced:
        matcher.rollback(advanced)
    return filled


def apply_grammar_mask(x: torch.Tensor, mask: GrammarMask) -> None:
    """x (R, V) float logits: -inf where a constrained row's grammar disallows the token."""
    import xgrammar
    xgrammar.apply_token_bitmask_inplace(x, mask.bitmask, vocab_size=x.shape[1], indices=mask.rows)
