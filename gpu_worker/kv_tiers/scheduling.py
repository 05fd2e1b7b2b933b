"""The scheduler of an engine with lower KV tiers: the base loop plus the tiers' hook points.

    schedule():  step_began (the previous step's time -> prefill rate)
                 loads that arrived: scatter into their blocks, their sequences join running
                 base schedule, whose admission asks plan() and then begin_load() per sequence:
                     a sequence with blocks to load waits in `loading`, its copy under way,
                     while this step's batch runs without it
                 step_scheduled (evicted blocks go down a tier before the step writes)

A load therefore overlaps at least the step that admitted it (on CUDA its H2D runs on the
tiers' load stream beside that step's forward; a copy still running at the next schedule keeps
its sequence waiting, never the batch). Off CUDA the copies are done at admission and the
sequence joins at the next schedule.
"""
from __future__ import annotations

import bisect

from gpu_worker.kv_tiers.manager import KVTiers, PendingLoad
from gpu_worker.scheduler import Scheduler, SchedulerOutput, _seq_slots
from gpu_worker.sequence import Sequence, SequenceStatus


class TieredScheduler(Scheduler):
    def __init__(self, tiers: KVTiers, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tiers = tiers
        self._loads: dict[int, PendingLoad] = {}      # id(seq) -> its load, for seqs in self.loading

    def schedule(self) -> SchedulerOutput:
        self.tiers.step_began(bool(self.running))
        if self.loading:
            self._admit_loaded()
        out = super().schedule()
        prefill = sum(n for _, n in out.scheduled if n > 1)      # a decode computes one token
        self.tiers.step_scheduled(out.num_tokens, prefill)
        return out

    def _lower_tier_blocks(self, seq: Sequence, first: int) -> int:
        return self.tiers.plan(seq, first).num_blocks

    def _load_lower_tiers(self, seq: Sequence, first: int, num_blocks: int) -> bool:
        load = self.tiers.begin_load(seq, first, num_blocks)
        if load is None:
            return True
        self._loads[id(seq)] = load
        self.loading.append(seq)
        return False

    def _admit_loaded(self) -> None:
        """Sequences whose loads arrived join running, in arrival order, as batch slots allow."""
        slots = sum(_seq_slots(s) for s in self.running)
        for seq in list(self.loading):
            load = self._loads[id(seq)]
            if slots + _seq_slots(seq) > self.max_num_seqs or not self.tiers.ready(load):
                continue
            del self._loads[id(seq)]
            self.loading.remove(seq)
            self.tiers.finish_load(load)
            if seq.index == 0 and seq.num_preemptions == 0:
                seq.request.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            slots += _seq_slots(seq)

    def _remove(self, seq: Sequence) -> None:
        self._loads.pop(id(seq), None)        # aborted while loading: its staging is dropped
        super()._remove(seq)
