"""`{"method": "mtp"}`: drafts from the model's own multi-token-prediction module
(DeepSeek-V3 style, gpu_worker/models/mtp_module.py), chained k times (vLLM's DeepSeek MTP
proposer, one module reused).

An MTP row at position i reads the target's pre-norm hidden state h_i and the token t_{i+1}, so
it lags the target by one position: its KV at i can be written only once t_{i+1} is known.
Per sequence the proposer keeps one pending row, (p, h_p), for the target's last computed
position p whose next token was not yet known when the target computed it:

    target computed:  0 ........................ p            (num_computed_tokens = p + 1)
    MTP KV written:   0 ................... p-1 | p pending  (h_p kept; t_{p+1} is the token
                                                            sampled, or the next prompt token)

settle() (after every target step): for each sequence of the step, the MTP runs its pending row
(when it is the position just before the step's first row) and every row of the step the
target kept but its last, which becomes the new pending row. Kept: a prefill chunk's or a
decode's rows, a verification's x and accepted drafts (num_computed_tokens after _accept).

propose() (a speculative step, after copy-on-write, before the target's forward):

    token_ids:  | ... computed (c) ... | x | d0 .. dk-1 |
    MTP step 0: pending h_{c-1}, input x at position c-1        -> g, logits -> d0
    MTP step j: g of step j-1, input d_{j-1} at position c-1+j  -> g, logits -> dj

Step 0 writes the true KV at c-1 (the pending row is spent); steps j >= 1 write speculative KV
at c..c+k-2, slots this step allocated, which settle() rewrites with the verified rows before
any later MTP query reads them (a query at position i reads positions <= i, all written by
then). Draws: as the draft model's (proposer.draw_position): greedy the argmax, with
temperature q_j for rejection.py.

Prefix caching: the MTP KV of a cached block is cached with it (same block id), written by the
sequence that computed the block, and reused as is. Every slot but the block's last holds
exactly what a recompute would (h_i and t_{i+1} are both inside the block's hashed tokens); the
last slot's t_{i+1} is the token after the block, which the hash does not cover: a sequence
that hits the block up to there reads its writer's next token there (or nothing, if the writer
stopped first). Recomputing it would need the target's h at that position, which a prefix hit
skips; the stale slot costs acceptance, never correctness (the target verifies every draft),
and it is one key among the context's. The same holds for KV that a KV tier loads and for a
fork's first position: MTP slots stale until rewritten, and no pending row, so such a sequence
proposes from its second computed step on.

A P/D hand-off moves the MTP layer's KV with the target's (handoff_caches: one more layer under
the same block ids; kv_transfer/layout.py). The prefill engine runs the MTP over its prompt as
above (it never proposes: it draws only the first token); a sequence that finishes there with
HANDOFF leaves its pending row (n-1, h_{n-1}) on its request (Request.handoff_hidden), which the
hand-off carries; the decode engine resumes it as that sequence's pending row, so it proposes
from its first decode step, as on one engine:

    prefill engine:  MTP KV 0 ........ n-2 | h_{n-1} -> Offer/Done.last_hidden
    decode engine:   MTP KV 0 ........ n-2 | pending (n-1, h_{n-1}): step 0 of its first
                                             propose() writes n-1 with input t_n (the first token)

A peer move of a decoding sequence (Engine.hold_for_move: hold()) goes the same way with n its
computed tokens (prompt and output but the last token) in place of the prompt's.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gpu_worker.batch_builder import BatchBuilder
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.sampler import Sampler, to_device
from gpu_worker.scheduler import ScheduledSeq
from gpu_worker.outputs import RequestError
from gpu_worker.sequence import HANDOFF, Sequence, SequenceStatus
from gpu_worker.spec_decode.proposer import DraftProposal, ModelProposer, RequestAt, draw_position


class _Pending(NamedTuple):
    position: int              # p: computed by the target, not yet by the MTP
    hidden: torch.Tensor       # (H,) the target's pre-norm h_p


class _StepRows(NamedTuple):
    """One scheduled sequence's rows in the target's step."""
    seq: Sequence
    start: int                 # num_computed_tokens before the step: the position of its first row
    row: int                   # its first row in the step's (T, H) pre-norm states
    count: int                 # rows it had


class _Tokens:
    """The input tokens of one sequence's MTP rows, indexed by position as BatchBuilder reads
    token_ids: [start + r] is row r's input; len() ends at the last row, so it gets a logits row."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __len__(self) -> int:
        return self.start + len(self.tokens)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return self.tokens[i.start - self.start:i.stop - self.start]
        return self.tokens[i - self.start]


class _MtpView(NamedTuple):
    """What BatchBuilder reads of a sequence, for MTP rows of it."""
    token_ids: _Tokens
    num_computed_tokens: int   # the first row's position
    block_table: list[int]


def _view(seq: Sequence, first: int, n: int) -> tuple[_MtpView, int]:
    """Rows at positions first .. first+n-1, row i's input t_{i+1} (all known)."""
    return _MtpView(_Tokens(first, seq.token_ids[first + 1:first + n + 1]), first, seq.block_table), n


class MtpProposer(ModelProposer):
    reads_prenorm = True      # the target's pre-norm states (ModelRunner.forward_with_prenorm)

    def __init__(self, runner: Any, block_size: int, device: torch.device) -> None:
        self.runner = runner                  # spec_decode/mtp_runner.py: MtpRunner
        self.builder = BatchBuilder(block_size, device)
        self.sampler = Sampler()
        self.pending: dict[Sequence, _Pending] = {}
        self._step: tuple[torch.Tensor, list[_StepRows]] | None = None   # the last target forward's

    # ---- hooks around the target's step ----------------------------------------------------
    def forward(self, runner: Any, batch: ForwardBatch, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        out = runner.forward_with_prenorm(batch)
        rows, at = [], 0
        for seq, q in scheduled:
            rows.append(_StepRows(seq, seq.num_computed_tokens, at, q))
            at += q
        self._step = (out.prenorm, rows)      # (T, H), read by settle()
        return out.logits

    def settle(self) -> None:
        """The MTP catches up on the step's kept rows (module docstring); drops finished sequences
        (also with no step to catch up on: async scheduling's last step ends them after its launch)."""
        if self._step is None:
            self._drop_finished()
            return
        prenorm, rows = self._step
        self._step = None
        spent: list[torch.Tensor] = []        # pending rows run now, (H,) each
        picks: list[tuple[bool, int]] = []    # per MTP row: (from spent, index)
        views: list[tuple[_MtpView, int]] = []
        keep: list[tuple[Sequence, int, int]] = []   # new pending: (seq, position, prenorm row)
        for r in rows:
            seq = r.seq
            pending = self.pending.pop(seq, None)
            kept = min(seq.num_computed_tokens - r.start, r.count)
            # a prefill that just ended for a hand-off still writes its prompt's MTP KV (module docstring)
            if (seq.status is SequenceStatus.FINISHED and seq.finish_reason != HANDOFF) or kept <= 0:
                continue
            first = r.start
            if pending is not None and pending.position == r.start - 1:
                picks.append((True, len(spent)))
                spent.append(pending.hidden)
                first -= 1
            picks += [(False, r.row + j) for j in range(kept - 1)]
            n = r.start + kept - 1 - first
            if n:
                views.append(_view(seq, first, n))
            keep.append((seq, r.start + kept - 1, r.row + kept - 1))
        if keep:
            # to_device: no host sync, so an async step's catch-up does not wait for its forward
            index = to_device([k[2] for k in keep], prenorm.device)
            for (seq, position, _), h in zip(keep, prenorm.index_select(0, index)):           # (K, H)
                self.pending[seq] = _Pending(position, h)
        self._drop_finished()
        if views:
            self.runner.forward(self.builder.build(views), _gather(prenorm, spent, picks))

    def _drop_finished(self) -> None:
        """Forget finished sequences' pending rows; a prompt's last, of a sequence that finished
        for a hand-off, goes with it (Request.handoff_hidden)."""
        for seq in [s for s in self.pending if s.status is SequenceStatus.FINISHED]:
            if seq.finish_reason == HANDOFF:
                self.hold(seq)
            else:
                del self.pending[seq]

    def hold(self, seq: Sequence) -> None:
        """seq finished for a hand-off (a prefill's, or a decoding request's peer move): the
        pending row of its last computed position goes with it (Request.handoff_hidden), so the
        peer writes the MTP KV there and drafts from its first step (resume)."""
        pending = self.pending.pop(seq, None)
        if pending is not None and pending.position == seq.num_computed_tokens - 1:
            seq.request.handoff_hidden = pending.hidden

    def can_propose(self, seq: Sequence) -> bool:
        """Only with h of the position before its uncomputed token at hand."""
        pending = self.pending.get(seq)
        return pending is not None and pending.position == seq.num_computed_tokens - 1

    # ---- drafts ----------------------------------------------------------------------------
    def propose(self, drafts: dict[Sequence, list[int]], request_at: RequestAt) -> DraftProposal:
        """Draw every draft by k chained MTP steps (module docstring). A sequence without its
        pending row (never: Speculator.propose asks can_propose) keeps its placeholders, which
        verify as point-mass drafts."""
        q: dict[Sequence, list[torch.Tensor]] = {}
        active = [(seq, draft) for seq, draft in drafts.items() if self.can_propose(seq)]
        hidden = torch.stack([self.pending.pop(seq).hidden for seq, _ in active]) if active else None   # (A, H)
        for j in range(max((len(d) for _, d in active), default=0)):
            views = []
            for seq, draft in active:
                at = seq.num_tokens - len(draft) - 1 + j              # c + j: the input token's index
                views.append((_MtpView(_Tokens(at - 1, [seq.token_ids[at]]), at - 1, seq.block_table), 1))
            g = self.runner.forward(self.builder.build(views), hidden)                     # (A, H)
            draw_position(self.sampler, self.runner.logits(g), active, j, request_at, q)
            alive = [i for i, (_, draft) in enumerate(active) if len(draft) > j + 1]
            if not alive:
                break
            if len(alive) < len(active):
                active = [active[i] for i in alive]
                g = g.index_select(0, torch.tensor(alive, dtype=torch.long, device=g.device))
            hidden = g
        return DraftProposal({seq: torch.stack(rows) for seq, rows in q.items()})

    # ---- a P/D hand-off (module docstring) --------------------------------------------------
    def handoff_caches(self) -> list:
        return list(self.runner.kv_caches)

    def resume_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """The prefill engine's h_{n-1} on this device; RequestError unless it is one (H,) row
        of the model's dtype."""
        target = self.runner.target
        if hidden.dtype != target.dtype or tuple(hidden.shape) != (target.config.hidden_size,):
            raise RequestError(f"invalid last_hidden: {str(hidden.dtype).removeprefix('torch.')}"
                               f"{list(hidden.shape)} where the MTP layer reads "
                               f"{str(target.dtype).removeprefix('torch.')}[{target.config.hidden_size}]")
        return hidden.to(self.runner.device)

    def resume(self, seq: Sequence, state: torch.Tensor) -> None:
        """seq's MTP KV arrived up to position c-2 (c: its computed tokens, a prompt's or a moved
        request's prompt and output but the last): h_{c-1} is its pending row."""
        self.pending[seq] = _Pending(seq.num_computed_tokens - 1, state)

    # ---- the KV cache ---------------------------------------------------------------------
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.runner.copy_blocks(src, dst)

    def close(self) -> None:
        self.pending.clear()
        self._step = None
        self.runner.close()


def _gather(prenorm: torch.Tensor, spent: list[torch.Tensor], picks: list[tuple[bool, int]]) -> torch.Tensor:
    """(M, H): row m is spent[i] or prenorm[i] as picks[m] = (from spent, i) says (no copy of
    the whole step's states: a long prefill's are large)."""
    dev = prenorm.device
    hidden = prenorm.new_empty((len(picks), prenorm.shape[1]))                               # (M, H)
    for pool, from_spent in ((prenorm, False), (torch.stack(spent) if spent else None, True)):
        at = [m for m, (s, _) in enumerate(picks) if s == from_spent]
        if at:
            index = to_device([picks[m][1] for m in at], dev)
            hidden.index_copy_(0, to_device(at, dev), pool.index_select(0, index))
    return hidden
