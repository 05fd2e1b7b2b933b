"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): each prompt token's logprob given the
tokens before it, its rank, and the k most likely tokens at its position, in float32 from the
logits the model makes.

The model projects only each sampling row through the lm_head. A step that holds a prompt chunk
of a request that asks runs its forward keeping every row's final hidden state (eagerly: no CUDA
graph replays it) and projects only that request's rows, PIECE_ROWS at a time:

    prompt:   t0  t1  t2  t3  t4  t5            (P = 6: t0 has no logprob)
    chunk:            |<- c=2, q=3 ->|           positions 2, 3, 4 are rows of this step
    the row at position p -> log_softmax -> the entry of t(p+1)    (p <= P-2; row P-1 samples)

Steps without such a chunk run as they would without this module. Positions served from the
prefix cache have no rows: a request that asks takes a prefix hit only over the tokens whose
entries are made (PromptLogprobState.cached_limit), so a fresh one computes its whole prompt and
a preempted one recomputes from the entries it kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from gpu_worker.outputs import PromptLogprob

PIECE_ROWS = 256     # rows projected at once: (256, V) float32 is ~155 MB at a 152k vocabulary


@dataclass(eq=False)
class PromptLogprobState:
    """A request's prompt logprobs as its prefill makes them (Request.prompt_lp)."""
    k: int                         # top alternatives per token
    prompt: list[int]
    entries: list[PromptLogprob] = field(default_factory=list)   # entries[i]: token i + 1's
    sent: bool = False             # went out on sample 0's first delta

    @property
    def done(self) -> bool:
        return len(self.entries) == len(self.prompt) - 1

    def cached_limit(self) -> int:
        """Leading prompt tokens a prefix-cache hit may serve: those whose rows are no longer needed."""
        return len(self.prompt) if self.done else len(self.entries)

    def put(self, first: int, entries: list[PromptLogprob]) -> None:
        """The entries of tokens first + 1 ...: a recomputed range replaces what it covers."""
        assert first <= len(self.entries), "a prefix hit skipped rows whose entries are missing"
        del self.entries[first:]
        self.entries += entries

    def output(self) -> list[PromptLogprob]:
        """One entry per prompt token, the first without a logprob (vLLM's list starts with None)."""
        return [PromptLogprob(self.prompt[0], None, None, ())] + self.entries


class PromptRows(NamedTuple):
    """One request's rows in a step: its positions first .. first + len(rows) - 1."""
    state: PromptLogprobState
    first: int         # prompt position of the first row
    rows: range        # rows of the step's (T, H) hidden states


def plan_rows(scheduled: list) -> list[PromptRows]:
    """The rows of `scheduled` (ScheduledSeq, in batch order) whose logprobs a request still needs."""
    out, row = [], 0
    for seq, num_new in scheduled:
        state = seq.request.prompt_lp
        if state is not None and seq.index == 0 and not state.done:
            c = seq.num_computed_tokens
            n = max(0, min(c + num_new, len(state.prompt) - 1) - c)
            if n:
                out.append(PromptRows(state, c, range(row, row + n)))
        row += num_new
    return out


def fill(plans: list[PromptRows], hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Each plan's entries from the step's final hidden states (T, H); `head`: (r, H) -> (r, V) float32."""
    for plan in plans:
        p0, n = plan.first, len(plan.rows)
        ids = plan.state.prompt[p0 + 1:p0 + 1 + n]
        entries: list[PromptLogprob] = []
        for s in range(0, n, PIECE_ROWS):
            e = min(s + PIECE_ROWS, n)
            rows = hidden[plan.rows.start + s:plan.rows.start + e]                 # (r, H)
            entries += _entries(head(rows), ids[s:e], plan.state.k)
        plan.state.put(p0, entries)


def _entries(logits: torch.Tensor, ids: list[int], k: int) -> list[PromptLogprob]:
    """(r, V) logits of rows whose next tokens are `ids` -> their entries (vLLM's rank: how many
    tokens are at least as likely, itself included)."""
    lp = torch.log_softmax(logits.float(), dim=-1)                            # (r, V)
    idx = torch.tensor(ids, dtype=torch.long, device=lp.device)[:, None]      # (r, 1)
    own = lp.gather(1, idx)                                                   # (r, 1)
    rank = (lp >= own).sum(dim=-1)                                            # (r,)
    own_l, rank_l = own[:, 0].tolist(), rank.tolist()
    if k == 0:
        return [PromptLogprob(t, v, r, ()) for t, v, r in zip(ids, own_l, rank_l)]
    top = lp.topk(k, dim=-1)                                                  # (r, k) each
    top_v, top_i = top.values.tolist(), top.indices.tolist()
    return [PromptLogprob(t, v, r, tuple(zip(ti, tv)))
            for t, v, r, ti, tv in zip(ids, own_l, rank_l, top_i, top_v)]
