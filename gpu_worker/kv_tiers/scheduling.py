"""The scheduler of an engine with lower KV tiers: the base loop plus the tiers' hook points.

    _schedule_step() (inside Scheduler.schedule(), which times steps for the prefill rate):
                 loads that arrived: scatter into their blocks, their sequences join running
                 base schedule, whose admission asks plan() and then begin_load() per sequence:
                     joins_step: the sequence runs in this step, its load copied layer group by
                       layer group and scattered by the forward before each layer (out.layer_loads)
                     else: it waits in `loading`, its copy under way (and its disk or shared
                       files read on reader threads: file_loads.py), while this step's batch
                       runs without it
                 step_scheduled (evicted blocks go down a tier before the step writes)

A load that joins its step overlaps the prompt's own forward: the prompt's first token comes a
step sooner, and only the first layer group's copy is exposed (when nothing else runs, or when
the copy is predicted to fit under the step's compute: LoadPolicy.joins_step). A load beside the
step overlaps at least the step that admitted it (on CUDA its H2D runs on the tiers' load stream
beside that step's forward; a copy still running at the next schedule keeps its sequence
waiting, never the batch). Off CUDA the copies are done at admission, and the same decision and
the same per-layer scatters run. A load with file blocks joins its step only when nothing else
runs (nobody waits for its reads). With tensor parallelism (TierMirror.layered_loads False) a load
that joins its step lands whole after the schedule, before the forward, on every rank: the
followers' forwards have no per-layer hooks.
"""
from __future__ import annotations

import bisect

from gpu_worker.kv_tiers.file_loads import FileLoad
from gpu_worker.kv_tiers.layer_loads import LayerLoads
from gpu_worker.kv_tiers.manager import KVTiers, PendingLoad
from gpu_worker.scheduler import Scheduler, SchedulerOutput, _seq_slots
from gpu_worker.sequence import Sequence, SequenceStatus

_IDLE_WAIT_S = 0.005      # an engine with only loads waiting for their files blocks this long per schedule


class TieredScheduler(Scheduler):
    def __init__(self, tiers: KVTiers, *args, **kwargs) -> None:
        # the policy prices recomputing with the rate this scheduler's steps measure
        super().__init__(*args, prefill_rate=tiers.policy.prefill, **kwargs)
        self.tiers = tiers
        self._loads: dict[int, PendingLoad | FileLoad] = {}   # id(seq) -> its load, for seqs in self.loading
        self._joining: list[PendingLoad] = []         # loads this step's forward scatters, layer by layer

    def _schedule_step(self) -> SchedulerOutput:
        if self.loading and not self.running:    # nothing to run until a file read lands
            self.tiers.wait_reads(_IDLE_WAIT_S)
            self.prefill_rate.step_began()       # the wait was idle time, not this step's
        if self.loading:
            self._admit_loaded()
        out = super()._schedule_step()
        landing: list[PendingLoad] = []
        if self._joining and self.tiers.mirror.layered_loads:
            out.layer_loads = LayerLoads(self.tiers.mover, self._joining)
        else:                     # tensor parallel: the other ranks land their loads whole
            landing = self._joining
        self._joining = []
        self.tiers.step_scheduled()
        for load in landing:      # after the flush: blocks evicted into its destinations went down first
            self.tiers.scatter(load)
        return out

    def _lower_tier_blocks(self, seq: Sequence, first: int) -> int:
        # Blocks evicted earlier in this schedule (a running sequence's next block, an earlier
        # admission) are in neither the device's hash map nor a tier until they go down: a
        # prefix the device let go of in this very schedule would be computed again (a chat's
        # whole history, where its first block went). They go down before the plan.
        self.tiers.offload_evicted()
        return self.tiers.plan(seq, first).num_blocks

    def _load_lower_tiers(self, seq: Sequence, first: int, num_blocks: int, step_tokens: int) -> bool:
        if self.tiers.joins_step(seq, step_tokens, bool(self.running)):
            load = self.tiers.begin_load(seq, first, num_blocks, groups=self.tiers.mover.block_shape[0])
            if load is not None:
                self.tiers.join_layered(load)
                self._joining.append(load)
            return True
        load = self.tiers.begin_load_beside(seq, first, num_blocks)
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
        # aborted while loading, or preempted in the schedule that admitted it (its blocks are
        # freed, nothing may land there): its staging is dropped
        dropped = [load for load in self._joining if load.seq is seq]
        if (load := self._loads.pop(id(seq), None)) is not None:
            dropped.append(load)
        self._joining = [load for load in self._joining if load.seq is not seq]
        for load in dropped:
            self.tiers.drop_load(load)
        super()._remove(seq)
