"""The scheduler of an engine with lower KV tiers: the base loop plus the tiers' hook points.

    schedule():  step_began (the previous step's time -> prefill rate)
                 base schedule, whose admission asks plan() and then load() per sequence
                 step_scheduled (evicted blocks go down a tier before the step writes)
"""
from __future__ import annotations

from gpu_worker.kv_tiers.manager import KVTiers
from gpu_worker.scheduler import Scheduler, SchedulerOutput
from gpu_worker.sequence import Sequence


class TieredScheduler(Scheduler):
    def __init__(self, tiers: KVTiers, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tiers = tiers

    def schedule(self) -> SchedulerOutput:
        self.tiers.step_began(bool(self.running))
        out = super().schedule()
        prefill = sum(n for _, n in out.scheduled if n > 1)      # a decode computes one token
        self.tiers.step_scheduled(out.num_tokens, prefill)
        return out

    def _lower_tier_blocks(self, seq: Sequence, first: int) -> int:
        return self.tiers.plan(seq, first).num_blocks

    def _load_lower_tiers(self, seq: Sequence, first: int, num_blocks: int) -> None:
        self.tiers.load(seq, first, num_blocks)
