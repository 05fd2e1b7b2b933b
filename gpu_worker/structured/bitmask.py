"""The token bitmask of a step's constrained rows, filled on the host and applied on the device.

    rows of the step's draw:   r0 r1 r2 r3 ...        (one per SampleRequest)
    constrained:                   r1    r3           GrammarMask.rows = [1, 3]
    bitmask (R, ceil(V/32)) int32: row r of a constrained draw = its matcher's allowed tokens
                                   (bit v of word v // 32); other rows are never read

A sequence verifying speculative drafts d0..dk-1 owns rows r..r+k (row j: the model after d<j):
row j gets the mask after the matcher accepted d0..dj-1, and the matcher is rolled back after
(fill_draft_rows). A draft the grammar refuses ends the filling: its row's mask excludes it, so
its draw differs from it and no later row is kept.

Filling is xgrammar's (C++, several threads for a batch's rows); the host tensor goes to the
device with one non-blocking copy from pinned memory, and one xgrammar op
(apply_token_bitmask_inplace with indices: a CUDA kernel on the GPU) sets the disallowed
logits to -inf. Nothing here runs for a batch without constrained rows.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch


class GrammarMask(NamedTuple):
    bitmask: torch.Tensor    # (R, ceil(V/32)) int32 on the logits' device
    rows: list[int]          # the draw rows it constrains


class GrammarMaskBuilder:
    """Fills a step's bitmask: the plain constrained rows in one multi-threaded xgrammar call
    (BatchGrammarMatcher), draft-verifying rows one matcher at a time (fill_draft_rows). The host
    buffer (pinned on CUDA) is reused: the next mask is filled only after the matchers accepted
    the tokens of the step that copied it (under async scheduling too: Engine._launch_split reads
    that step back first), and its tokens are read behind its draw, so the copy is done."""

    def __init__(self, vocab: int, device: torch.device, max_threads: int) -> None:
        self.vocab, self.device, self.max_threads = vocab, device, max_threads
        self._batch: Any = None
        self._host: torch.Tensor | None = None          # (capacity, ceil(V/32)) int32

    def build(self, entries: list[tuple[int, Any, list[int]]], num_rows: int) -> GrammarMask:
        """entries: (first draw row, GrammarMatcher, drafts verified: [] when none) of each
        constrained sequence; num_rows: the step's draw rows."""
        import xgrammar
        host = self._rows(num_rows)
        plain = [(row, matcher) for row, matcher, drafts in entries if not drafts]
        rows = [row for row, _ in plain]
        if plain:
            if self._batch is None:
                self._batch = xgrammar.BatchGrammarMatcher(self.max_threads)
            self._batch.batch_fill_next_token_bitmask([m for _, m in plain], host, indices=rows)
        for row, matcher, drafts in entries:
            if drafts:
                rows += fill_draft_rows(matcher, drafts, host, row)
        bitmask = host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        return GrammarMask(bitmask, rows)

    def _rows(self, num_rows: int) -> torch.Tensor:
        """The first num_rows rows of the host buffer, grown (doubled) when short. Rows no
        constrained draw fills are never read: no reset."""
        if self._host is None or self._host.shape[0] < num_rows:
            capacity = max(num_rows, 2 * (0 if self._host is None else self._host.shape[0]), 16)
            self._host = torch.empty((capacity, (self.vocab + 31) // 32), dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        return self._host[:num_rows]


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
    rows: list[int] | torch.Tensor = mask.rows
    if x.is_cuda:   # pinned and non-blocking, as the bitmask: the draw is queued behind the forward
        rows = torch.tensor(rows, dtype=torch.int32).pin_memory().to(x.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(x, mask.bitmask, vocab_size=x.shape[1], indices=rows)
