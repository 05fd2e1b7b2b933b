"""Speculative steps: propose drafts, fit them into the scheduled step, verify, roll back.

One speculative step of a decoding sequence with c computed tokens and last token x:

    token_ids:  | ... computed (c) ... | x | d0 d1 .. dk-1 |      drafts appended before schedule()
    this step:                          |<---- 1 + k ----->|      query tokens, KV slots allocated
    logits rows:                        | r0 r1 ..... rk   |      row j: the model after d<j
    draws:                                s0 s1 ..... sk          s_j drawn from row j

The batch: where no prefill chunk shares the step, each verifying sequence's 1 + k query tokens
are 1 + k decode rows of their own (batch_builder.build_decode_rows), which replay the decode
CUDA graphs; else one extend chunk (build(..., num_drafts)). The logits rows are the same.

a = the longest prefix with s_j == d_j. Kept: x, d0..da-1 (KV final: num_computed = c + 1 + a);
appended: s0..sa (= d0..da-1, then the model's own token). Blocks past the computed tokens are
freed; only then are full blocks registered in the prefix cache, so no draft's KV is published.

Why this is exact. Each row j is drawn by the ordinary sampler with the request's parameters
(penalties see the output up to d<j; min_tokens, logit_bias, top-k/top-p/min-p) and the draw
key (seed, sample index, output position) a non-speculative step at that position would use.
Greedy: s_j is the argmax the plain step would take, so the output is identical. Sampling with
temperature: the n-gram draft is a point mass q = delta(d_j). Accepting d_j exactly when the
target's own draw s_j equals it accepts with probability p(d_j) = min(1, p(d_j) / q(d_j)), and
on rejection s_j is distributed as p conditioned on s_j != d_j, i.e. norm(max(0, p - q)):
the rule of Leviathan et al. and Chen et al. for this q. Every emitted token is thus a draw from
the target's processed distribution at its position (the same draw as without speculation, up
to the rounding differences between a one-token and a multi-token forward).

draft_model (draft_model.py) proposes with a smaller model instead, mtp (mtp.py) with the
model's own multi-token-prediction module: propose() appends placeholders (so that schedule()
allocates slots for them), and once the step's blocks are final, fill() has the proposer draw
them. Greedy: the proposer proposes its argmax; the verification above is exact. Sampling: its
q is no point mass, so such sequences verify by speculative sampling against q (rejection.py)
instead of the equality test.

A sequence whose drafts keep failing backs off for exponentially more steps (backoff.py), so
that under async scheduling its steps launch ahead again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu_worker.scheduler import SchedulerOutput
from gpu_worker.sequence import Sequence
from gpu_worker.spec_decode.backoff import Backoff, BackedOff
from gpu_worker.spec_decode.draft_model import DraftModel
from gpu_worker.spec_decode.proposer import PLACEHOLDER, DraftProposal, ModelProposer
from gpu_worker.spec_decode.ngram import ngram_may_match, propose_ngram
from services.speculative import SpeculativeConfig


@dataclass
class SpecStats:
    proposed: int = 0        # draft tokens verified
    accepted: int = 0        # of those, accepted
    verify_steps: int = 0    # sequence-steps that verified at least one draft
    accepted_per_pos: list[int] = field(default_factory=list)   # [j]: drafts accepted at position j
    decode_row_steps: int = 0   # verification steps run as decode rows (batch_builder.build_decode_rows)
    extend_steps: int = 0       # ... and on the extend path (a prefill chunk in the step, or
                                # Engine.verify_as_decode_rows off)
    backoffs: int = 0           # times a sequence backed off (backoff.py)
    backoff_steps: int = 0      # sequence-steps those back-offs took drafts off for (fewer where
                                # a sequence ended first)

    def record(self, num_drafts: int, accepted: int) -> None:
        """One sequence-step that verified num_drafts drafts and accepted the first `accepted`."""
        self.proposed += num_drafts
        self.accepted += accepted
        self.verify_steps += 1
        if accepted > len(self.accepted_per_pos):
            self.accepted_per_pos += [0] * (accepted - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def as_dict(self, method: str, num_speculative_tokens: int) -> dict:
        steps = max(self.verify_steps, 1)
        per_pos = (self.accepted_per_pos + [0] * num_speculative_tokens)[:num_speculative_tokens]
        return {"method": method, "proposed": self.proposed, "accepted": self.accepted,
                "verify_steps": self.verify_steps, "accepted_per_pos": per_pos,
                "decode_row_steps": self.decode_row_steps, "extend_steps": self.extend_steps,
                "backoffs": self.backoffs, "backoff_steps": self.backoff_steps,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                # tokens a verifying sequence gained per step: accepted drafts + the model's own
                "mean_accepted_length": 1.0 + self.accepted / steps if self.verify_steps else 0.0}


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: ModelProposer | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer     # draft_model / mtp: the model that draws; None: n-gram
        self.stats = SpecStats()
        self.backoff = Backoff(config.backoff_max_steps)
        # the sequence for which may_propose said yes (the engine gave up the step ahead for it):
        # the next propose() charges it with a back-off if it finds no draft (a miss). Only it:
        # may_propose stops at the first "maybe", and a sequence that could not draft cost nothing
        self._settled_for: Sequence | None = None

    @property
    def reads_prenorm(self) -> bool:
        """Every target forward keeps its pre-norm states (mtp): only graphs that keep them too."""
        return self.proposer is not None and self.proposer.reads_prenorm

    def stats_dict(self) -> dict:
        return self.stats.as_dict(self.config.method, self.config.num_speculative_tokens)

    def propose(self, running: list[Sequence]) -> dict[Sequence, list[int]]:
        """Append drafts to each eligible running sequence's token_ids; returns them by sequence.
        Eligible: caught up but for its last sampled token, past its first output token, not a
        prefill for another engine, not opted out (SamplingParams.speculative), its draws not held
        (Request.draw_waits: an imported request whose grammar compiles), with room for the drafts
        and one token more (max_tokens, max_model_len), and one the proposer can serve (mtp: its
        pending row at hand), and not backing off (backoff.py). Nothing when more sequences run
        than disable_by_batch_size. draft_model / mtp: placeholders that fill() replaces."""
        cfg = self.config
        settled_for, self._settled_for = self._settled_for, None
        if len(running) > cfg.disable_by_batch_size:
            return {}
        drafts: dict[Sequence, list[int]] = {}
        for seq in running:
            room = self._room(seq)
            if room == 0:
                continue
            if self.proposer is None:
                draft = propose_ngram(seq.token_ids, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                if not draft and seq is settled_for:
                    self._backed_off(self.backoff.missed(seq))
            elif self.proposer.can_propose(seq):
                draft = [PLACEHOLDER] * room
            else:
                continue
            if draft:
                seq.token_ids.extend(draft)
                drafts[seq] = draft
        return drafts

    def verified(self, seq: Sequence, num_drafts: int, accepted: int) -> None:
        """seq verified its num_drafts drafts (still in token_ids) and accepted the first
        `accepted`: the stats, and a back-off where its drafts keep failing."""
        self.stats.record(num_drafts, accepted)
        next_tokens = seq.num_tokens - num_drafts + accepted + 1     # x, the accepted, the model's own
        self._backed_off(self.backoff.verified(seq, num_drafts, accepted, next_tokens))

    def _backed_off(self, backed: BackedOff | None) -> None:
        if backed is not None:
            self.stats.backoffs += 1
            self.stats.backoff_steps += backed.steps

    def _room(self, seq: Sequence) -> int:
        """How many drafts seq may take now (propose()'s eligibility); 0: none."""
        request = seq.request
        if (seq.num_new_tokens != 1 or seq.num_output_tokens < 1 or request.export_kv
                or not request.params.speculative or request.draw_waits or self.backoff.waiting(seq)):
            return 0
        return max(0, min(self.config.num_speculative_tokens, request.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens - 1))

    def may_propose(self, running: list[Sequence], pending: int) -> bool:
        """Whether propose() could draft for any of `running` once the in-flight step's tokens
        are known (async scheduling; their last token is still `pending` on the device): the
        engine then settles that step first, since drafts continue from the last token. False
        lets the step launch one step ahead. The same eligibility as propose(); n-gram: a match
        of length >= prompt_lookup_min ending at the unknown token needs the known tokens'
        last prompt_lookup_min - 1 to occur earlier, followed by a token (ngram_may_match). A
        sequence backing off counts for nothing; True makes the next propose() charge the sequence
        that said "maybe" with a miss if it finds no draft."""
        self._settled_for = self._may_propose(running, pending)
        return self._settled_for is not None

    def _may_propose(self, running: list[Sequence], pending: int) -> Sequence | None:
        """The first of `running` that may draft (None: none may)."""
        cfg = self.config
        if len(running) > cfg.disable_by_batch_size:
            return None
        for seq in running:
            if self._room(seq) == 0:
                continue
            if self.proposer is not None:
                if self.proposer.can_propose(seq):
                    return seq
            elif seq.token_ids[-1] != pending:
                if propose_ngram(seq.token_ids, 1, cfg.prompt_lookup_min, cfg.prompt_lookup_max):
                    return seq
            elif ngram_may_match(seq.token_ids[:-1], cfg.prompt_lookup_min):
                return seq
        return None

    @staticmethod
    def fit(out: SchedulerOutput, drafts: dict[Sequence, list[int]]) -> dict[Sequence, list[int]]:
        """Drafts as scheduled: a sequence scheduled for fewer tokens (budget) keeps the drafts
        that fit; one not scheduled (or preempted) loses them. Returns the sequences that verify."""
        scheduled = {id(seq): q for seq, q in out.scheduled}
        kept: dict[Sequence, list[int]] = {}
        for seq, draft in drafts.items():
            base = seq.num_tokens - len(draft)            # tokens before the drafts
            fits = scheduled.get(id(seq), 1) - 1 if seq.num_computed_tokens == base - 1 else 0
            if fits < len(draft):
                del seq.token_ids[base + fits:]
                draft = draft[:fits]
            if draft:
                kept[seq] = draft
        return kept

    def fill(self, drafts: dict[Sequence, list[int]], request_at) -> DraftProposal | None:
        """draft_model / mtp: the proposer draws the scheduled drafts (after copy-on-write, before
        the target's batch is built). None for n-gram drafts (already final)."""
        if self.proposer is None:
            return None
        return self.proposer.propose(drafts, request_at)

    # ---- hooks around every step of the target (proposer.py) ------------------------------
    def forward(self, runner, batch, scheduled) -> torch.Tensor:
        """The target's forward of a step -> logits (a draft model then writes its KV for the
        same tokens; mtp keeps the pre-norm states for settle())."""
        if self.proposer is None:
            return runner.forward(batch)
        return self.proposer.forward(runner, batch, scheduled)

    def catch_up(self, seq: Sequence, first: int, chunk: int) -> None:
        """An imported sequence's positions first.. hold only the target's KV (proposer.py)."""
        if self.proposer is not None:
            self.proposer.catch_up(seq, first, chunk)

    def handoff_caches(self) -> list:
        """The proposer's KV that a P/D hand-off moves with the target's (mtp's layer)."""
        return self.proposer.handoff_caches() if self.proposer is not None else []

    def resume_state(self, hidden):
        """A hand-off's last prompt hidden state, checked (RequestError) for resume()."""
        return self.proposer.resume_state(hidden) if self.proposer is not None else None

    def resume(self, seq: Sequence, state) -> None:
        """seq was prefilled elsewhere: mtp drafts from its first step (proposer.py)."""
        if self.proposer is not None and state is not None:
            self.proposer.resume(seq, state)

    def hold(self, seq: Sequence) -> None:
        """seq just left the batch to move to a peer with its KV (Engine.hold_for_move)."""
        if self.proposer is not None:
            self.proposer.hold(seq)

    def settle(self) -> None:
        """After the step's tokens are final (mtp: its KV catches up)."""
        if self.proposer is not None:
            self.proposer.settle()

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if self.proposer is not None:
            self.proposer.copy_blocks(src, dst)

    def warmup(self, max_num_seqs: int, max_query_len: int) -> None:
        if self.proposer is not None:
            self.proposer.warmup(max_num_seqs, max_query_len)

    def close(self) -> None:
        if self.proposer is not None:
            self.proposer.close()


def build_proposer(config: SpeculativeConfig, runner, block_size: int, device) -> ModelProposer | None:
    """The proposer over `runner` (EngineSetup.draft_runner: the draft's ModelRunner, or the
    MtpRunner); None for n-gram."""
    if runner is None:
        return None
    if config.method == "mtp":
        from gpu_worker.spec_decode.mtp import MtpProposer
        return MtpProposer(runner, block_size, device)
    return DraftModel(runner, block_size, device)
