"""The iteration-level scheduler: which sequences compute how many tokens this step.

The one invariant: there is no prefill or decode phase. Every sequence has num_computed_tokens
catching up to num_tokens (= prompt + generated); each step gives it up to that many new
tokens (a whole prompt, a prefill chunk, or the one token sampled last step) within the step's
token and sequence budgets. A sequence samples when it has caught up. The one token that never
catches up is a sequence's last by length: with async scheduling the engine appends each token
as a placeholder before it is read back, and a placeholder that is the request's max_tokens-th
token ends the sequence when it is read, so computing its KV (and drawing a token after it)
would be a wasted step; such a sequence is skipped until the engine finishes it.

Order is (priority, arrival, sample index), smallest first. Running sequences go first, in
that order; when the block pool runs dry the LAST running sequence (lowest priority, latest
arrival) is preempted: its blocks are freed and it goes back to the waiting queue with its
generated tokens, to be recomputed later (prefix-cache hits make that cheap). Waiting
sequences are admitted in order, head of line first, only in steps where no running sequence
ran out of blocks; a waiting sequence that ranks before the last running one may preempt it
to get blocks (priority scheduling). An exported request (KV hand-off) whose first token is
being read back is never the victim: it leaves at the read-back with its blocks held.

Saturated admission: while sequences run and the waiting requests do not all fit in the free
batch slots, waiting sequences are admitted only once `admit_group` slots are free (default
max_num_seqs / 8), not one by one as slots free up. A step that admits a prompt mixes prefill
with decodes and runs eagerly, while pure-decode steps replay CUDA graphs; admitting in groups
keeps most steps of a saturated engine pure decode. An engine with room admits at once.

Held draws: a request whose draw must wait (Request.draw_waits: its grammar is compiling,
gpu_worker/structured/compiling.py) computes every token but its last, so it draws nothing and
holds up no one; a waiting one with only that token left is passed over, not head of line:

    token_ids:  | computed ........... | chunk ...... | x |   x: scheduled once the draw may happen
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

from gpu_worker.block_manager import BlockCopy, BlockManager
from gpu_worker.prefill_rate import PrefillRate
from gpu_worker.sequence import HANDOFF, Request, Sequence, SequenceStatus


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits are sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


def _prompt_logprob_hits(seq: Sequence, hits: list[int], lower: int, block_size: int) -> tuple[list[int], int]:
    """A request making prompt logprobs takes prefix hits (device, then lower tiers) only over the
    prompt tokens whose entries it has (gpu_worker/prompt_logprobs.py): the rest need their rows."""
    limit = seq.request.prompt_lp.cached_limit() // block_size if seq.index == 0 else len(hits) + lower
    hits = hits[:limit]
    return hits, max(0, min(lower, limit - len(hits)))


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)     # copy-on-write, before the forward
    preempted: list[Sequence] = field(default_factory=list)
    # lower-tier loads the forward scatters layer by layer (gpu_worker/kv_tiers/layer_loads.py)
    layer_loads: object | None = None
    step_no: int = 0            # the prefill-rate meter's number of this step (0: not timed)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def _seq_slots(seq: Sequence) -> int:
    """Batch slots a running sequence holds: an unforked request reserves room for all n samples."""
    return seq.request.n if seq.request.needs_fork else 1


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool,
                 admit_group: int | None = None, prefill_rate: PrefillRate | None = None) -> None:
        self.block_manager = block_manager
        # measured from these steps; the KV tiers pass their load policy's (one estimate for both)
        self.prefill_rate = PrefillRate() if prefill_rate is None else prefill_rate
        self.max_num_seqs = max_num_seqs
        self.admit_group = max(1, max_num_seqs // 8) if admit_group is None else max(1, admit_group)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[Sequence] = []   # sorted by sort_key, hold no blocks
        self.running: list[Sequence] = []   # sorted by sort_key, hold blocks
        self.prefilled: list[Sequence] = []  # KV received from a prefill engine, hold blocks:
                                             # join running as batch slots free up
        self.loading: list[Sequence] = []    # KV being loaded from a lower tier (TieredScheduler),
                                             # hold blocks: join running when it has arrived
        self.num_preemptions = 0

    # ---- the loop ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.prefill_rate.step_began()
        out = self._schedule_step()
        prefill = decodes = 0               # one pass over the batch: this runs every step
        for _, n in out.scheduled:
            if n > 1:
                prefill += n
            else:
                decodes += 1                # a decode computes one token
        # the engine reads the step's tokens with this number: the step's time (prefill_rate.py)
        out.step_no = self.prefill_rate.step_scheduled(prefill + decodes, prefill)
        return out

    def _schedule_step(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.admit_prefilled()
        token_budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, token_budget)
        return out

    def _chunk(self, seq: Sequence, num_tokens: int, token_budget: int) -> int:
        """Tokens seq computes this step: all of num_tokens, a chunk of it, or 0 (does not fit,
        or only the token of a held draw is left)."""
        if seq.request.draw_waits:          # the last token's logits would be drawn from: not yet
            num_tokens -= 1
        if self.enable_chunked_prefill:
            return min(num_tokens, token_budget)
        return num_tokens if num_tokens <= token_budget else 0

    def _schedule_running(self, out: SchedulerOutput, token_budget: int) -> int:
        i = 0
        while i < len(self.running) and token_budget > 0:
            seq = self.running[i]
            request = seq.request      # its last token, being read back (an export's is its first)
            if seq.num_output_tokens >= (1 if request.export_kv else request.max_tokens):
                i += 1
                continue
            num_new = self._chunk(seq, seq.num_new_tokens, token_budget)
            if num_new == 0:
                i += 1
                continue
            copies = self.block_manager.allocate_slots(seq, num_new)
            while copies is None and (victim := self._victim(seq)) is not None:
                self._preempt(victim, out)
                copies = self.block_manager.allocate_slots(seq, num_new)
            if copies is None:           # seq itself is the lowest-priority sequence left
                self._preempt(seq, out)
                break
            out.scheduled.append(ScheduledSeq(seq, num_new))
            if copies:
                out.copies.extend(copies)
            token_budget -= num_new
            i += 1
        return token_budget

    def _admit_waiting(self, out: SchedulerOutput, token_budget: int) -> None:
        bm = self.block_manager
        slots = sum(_seq_slots(s) for s in self.running) + sum(_seq_slots(s) for s in self.loading)
        free = self.max_num_seqs - slots
        if (self.running and free < min(self.admit_group, len(self.waiting))
                and self.running[-1].sort_key < self.waiting[0].sort_key):
            return      # saturated: admit a group once enough slots are free (a waiting sequence
                        # that outranks a running one, e.g. a preempted one, is not held back)
        i = 0
        while i < len(self.waiting) and token_budget > 0:
            seq = self.waiting[i]
            if slots + _seq_slots(seq) > self.max_num_seqs or seq in out.preempted:
                break
            hits = bm.lookup_prefix(seq)
            lower = self._lower_tier_blocks(seq, len(hits))
            if seq.request.prompt_lp is not None:   # positions it needs logits of are computed
                hits, lower = _prompt_logprob_hits(seq, hits, lower, bm.block_size)
            todo = seq.num_tokens - (len(hits) + lower) * bm.block_size
            if todo == 1 and seq.request.draw_waits:
                i += 1                             # nothing to compute before its held draw
                continue
            num_new = self._chunk(seq, todo, token_budget)
            if num_new == 0:
                break
            while not bm.allocate_prefill(seq, hits, num_new + lower * bm.block_size):
                victim = self._victim(None)
                if victim is None or victim.sort_key <= seq.sort_key:
                    return                         # else lower priority than seq: make room for it
                token_budget += self._unschedule(victim, out)
                slots -= _seq_slots(victim)
                self._preempt(victim, out)
            self.waiting.pop(i)
            step_tokens = self.max_num_batched_tokens - token_budget + num_new
            if not self._load_lower_tiers(seq, len(hits), lower, step_tokens):
                slots += _seq_slots(seq)           # in self.loading until its blocks arrive: its
                continue                           # slot is kept, it computes nothing this step
            if seq.index == 0 and seq.num_preemptions == 0:
                seq.request.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            slots += _seq_slots(seq)
            token_budget -= num_new

    # ---- hook points of lower KV tiers (gpu_worker/kv_tiers/scheduling.py) ---------------------
    def _lower_tier_blocks(self, seq: Sequence, first: int) -> int:
        """Blocks after seq's first `first` (its device prefix hit) to bring back from a lower
        tier instead of computing them. No side effects: admission may still fail."""
        return 0

    def _load_lower_tiers(self, seq: Sequence, first: int, num_blocks: int, step_tokens: int) -> bool:
        """seq holds its blocks now (out of the waiting queue): start loading the planned ones.
        True: seq joins this step's batch (nothing to load, or a load its forward finishes layer
        by layer: num_computed_tokens advances now); False: seq waits in self.loading while the
        batch goes on (its blocks arrive, num_computed_tokens advances, then it joins). A block
        that is gone by now is computed instead. step_tokens: this step's tokens so far, seq's
        included."""
        return True

    def _victim(self, before: Sequence | None) -> Sequence | None:
        """The lowest-ranked running sequence ranked after `before` (None: any), to preempt. An
        exported request whose first token is being read back (async scheduling) is passed
        over: it leaves at the read-back, its blocks held for the decode engine."""
        for seq in reversed(self.running):
            if seq is before:
                return None
            if not (seq.request.export_kv and seq.num_output_tokens):
                return seq
        return None

    def admit_prefilled(self) -> None:
        """Imported sequences join running as batch slots allow (also before a step's drafts are
        proposed, so that they draft at their first step here)."""
        if not self.prefilled:
            return
        slots = sum(_seq_slots(s) for s in self.running)
        while self.prefilled and slots < self.max_num_seqs:
            seq = self.prefilled.pop(0)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            slots += 1

    @staticmethod
    def _unschedule(seq: Sequence, out: SchedulerOutput) -> int:
        """Take seq out of this step's batch (before it is preempted); returns its tokens."""
        for k, item in enumerate(out.scheduled):
            if item.seq is seq:
                del out.scheduled[k]
                own = set(seq.block_table)
                out.copies = [c for c in out.copies if c.dst not in own]
                return item.num_new_tokens
        return 0

    # ---- membership ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_prefilled(self, seq: Sequence) -> None:
        """A sequence whose blocks hold its prompt's KV (received, not computed here)."""
        seq.status = SequenceStatus.WAITING
        self.prefilled.append(seq)

    def fork(self, parent: Sequence, index: int) -> Sequence:
        """A new running sample sharing parent's blocks (copy-on-write)."""
        child = parent.fork(index)
        self.block_manager.fork(parent, child)
        parent.request.seqs.append(child)
        bisect.insort(self.running, child, key=lambda s: s.sort_key)
        return child

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends seq and frees its blocks, except a HANDOFF: the engine holds those for the
        decode engine until it releases them."""
        if reason == HANDOFF:
            self.running.remove(seq)
        else:
            self._remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def abort(self, request: Request) -> None:
        for seq in request.seqs:
            self.abort_sequence(seq)

    def abort_sequence(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.FINISHED:
            self.finish(seq, "abort")

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
        out.preempted.append(seq)

    def _remove(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.prefilled:
            self.prefilled.remove(seq)
        elif seq in self.loading:
            self.loading.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled or self.loading)
