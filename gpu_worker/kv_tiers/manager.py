"""KVTiers: the engine's prefix cache below the device, host memory then local disk, and a
directory shared by the node's workers.

    device LRU evicts a cached block --(flush: gather + D2H)--> host tier --(host LRU)--> disk tier
                                                                  |          (no disk: shared tier)
    admission: device prefix hit, then the next blocks found here -+-- load k (policy) ----+
               -> begin_load: stage (H2D / file read) -> flush
                  (beside running sequences, file blocks are read on reader threads: file_loads.py)
               ... a later schedule, once `ready` -> finish_load: scatter into the new blocks

The block manager reports evictions (`on_evict`) while it hands blocks out; their KV is copied
out in `flush`, which runs before anything can overwrite those blocks: at the end of every
schedule (before the step's copy-on-write copies and forward), before a load writes, and after a
KV import reserves blocks; and before each admission's plan the evictions alone go down
(offload_evicted), so that the plan finds the blocks evicted earlier in that schedule. Hashes are
the device's (services/prefix_hash.py), so a lower-tier hit is the same tokens of the same tenant.
Every change of a tier is a KV event with its tier.
"""
from __future__ import annotations

import logging
import os
import time
from typing import NamedTuple

import torch

from gpu_worker.kv_tiers.block_mover import BlockMover, Staged
from gpu_worker.kv_tiers import tier_file
from gpu_worker.kv_tiers.disk_tier import DiskBlock, DiskTier
from gpu_worker.kv_tiers.file_loads import FileLoad, FileLoads
from gpu_worker.kv_tiers.file_reads import FileRead
from gpu_worker.kv_tiers.host_tier import HostBlock, HostTier
from gpu_worker.kv_tiers.load_policy import LoadPlan, LoadPolicy
from gpu_worker.kv_tiers.mirror import DEVICE_BLOCK, DISK_FILE, HOST_SLOT, SHARED_FILE, BlockSource, TierMirror
from gpu_worker.kv_tiers.shared_tier import SharedTier
from gpu_worker.kv_tiers.tier_stats import TierStats
from gpu_worker.kv_transfer.layout import KVLayout
from gpu_worker.sequence import Sequence

log = logging.getLogger("kvmesh.kv_tiers")

GIB = 1 << 30
_PROBE_BLOCKS = 4


class Evicted(NamedTuple):
    block_id: int
    block_hash: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]


class PendingLoad(NamedTuple):
    """A load under way: its blocks are staged (or being copied) towards the device."""
    seq: Sequence
    first: int                                # index of the first loaded block in seq's table
    staged: Staged                            # (n, L, 2, bs, n_kv, hd * itemsize) on the device, per-group events
    tiers: list[str]                          # the tier of each block
    copy_s: float                             # host time spent staging (CPU copies' bandwidth)
    mirror_id: int = -1                       # the load's id on the other tensor-parallel ranks

    @property
    def block_ids(self) -> list[int]:
        return self.seq.block_table[self.first:self.first + len(self.tiers)]


class KVTiers:
    def __init__(self, block_manager, kv_caches, layout: KVLayout, *, cpu_bytes: int, disk_dir: str | None,
                 disk_bytes: int, policy: str, mirror: TierMirror | None = None, shared_dir: str | None = None,
                 shared_bytes: int = 0, shared_key: bytes | None = None) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.mover = BlockMover(kv_caches)
        self.layout = layout
        bb = self.mover.block_bytes
        self.host = HostTier(self.mover.host_blocks(cpu_bytes // bb)) if cpu_bytes >= bb else None
        file_bytes = bb + tier_file.file_overhead(self.block_size)
        self.disk = (DiskTier(disk_dir, disk_bytes // file_bytes, layout, bb)
                     if disk_dir and disk_bytes >= file_bytes else None)
        # the lowest tier: other workers' blocks to load, ours when they leave the private tiers
        self.shared = (SharedTier(shared_dir, shared_bytes, layout, bb, shared_key)
                       if shared_dir and shared_bytes >= file_bytes else None)
        self.policy = LoadPolicy(policy, bb, self.block_size)
        self.stats = TierStats()
        self._evicted: list[Evicted] = []
        self._planned: tuple[Sequence, LoadPlan, list[str]] | None = None   # the last plan, until its load
        self.mirror = mirror if mirror is not None else TierMirror()
        self.mirror.attach(self)            # before anything the other ranks must repeat
        # loads beside the step read their files on reader threads (every rank: file_loads.py)
        self.file_loads = FileLoads(self) if self.disk is not None or self.shared is not None else None
        self.measure_bandwidth()
        block_manager.attach_lower_tiers(self)

    # ---- events --------------------------------------------------------------------------
    def _stored(self, block_hash: bytes, parent: bytes | None, token_ids: tuple[int, ...], tier: str) -> None:
        for listener in self.block_manager.listeners:
            listener.on_stored(block_hash, parent, list(token_ids), tier)

    def _removed(self, block_hash: bytes, tier: str) -> None:
        for listener in self.block_manager.listeners:
            listener.on_removed(block_hash, tier)

    def _missing(self, block_hash: bytes) -> None:
        for listener in self.block_manager.listeners:
            listener.on_missing(block_hash, "shared")

    # ---- offload -------------------------------------------------------------------------
    def on_evict(self, block_id: int, block_hash: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> None:
        """The block manager is about to hand out a cached block: its KV is still there until flush."""
        self._evicted.append(Evicted(block_id, block_hash, parent, token_ids))

    def flush(self) -> None:
        """Copy every block evicted since the last flush down a tier (host, else disk)."""
        if self.mover.cuda:
            for num_bytes, seconds in self.mover.finished_copies():   # host <-> device, both ways
                self.policy.observe_copy("cpu", num_bytes, seconds)
        if self.disk is not None:
            self.poll_disk()
        if self.shared is not None:
            for num_bytes, seconds in self.shared.poll():
                self.policy.observe_copy("shared", num_bytes, seconds)
            for block_hash in self.shared.take_gone():
                self._removed(block_hash, "shared")
            for block_hash in self.shared.take_missing():
                self._missing(block_hash)
        if self.file_loads is not None:
            self.file_loads.reader.pump()
        self.offload_evicted()

    def offload_evicted(self) -> None:
        """flush's offload alone: the blocks evicted since the last flush go down a tier (their
        KV is intact until the step's copy-on-write copies and forward, which follow the schedule)."""
        if not self._evicted:
            return
        evicted, self._evicted = self._evicted, []
        if self.host is not None:
            self._offload_to_host(evicted)
        else:
            self._offload_below_host(evicted)

    def _offload_to_host(self, evicted: list[Evicted]) -> None:
        host = self.host
        fresh = [e for e in evicted if host.get(e.block_hash) is None]     # get(): a held one is touched
        overflow, fresh = fresh[:-host.num_slots], fresh[-host.num_slots:]   # the most recently used fit
        if overflow:
            self._offload_below_host(overflow)                            # the rest skips the host tier
        if not fresh:
            return
        slots = [self._host_slot() for _ in fresh]
        t = time.perf_counter()
        done = self.mover.offload([e.block_id for e in fresh], host.data, slots)
        self.mirror.offload([e.block_id for e in fresh], slots)
        if done is None:
            self.policy.observe_copy("cpu", len(fresh) * self.mover.block_bytes, time.perf_counter() - t)
        for e, slot in zip(fresh, slots):
            host.put(e.block_hash, HostBlock(slot, e.parent, e.token_ids, done))
            self._stored(e.block_hash, e.parent, e.token_ids, "cpu")
        self.stats.offloaded_blocks["cpu"] += len(fresh)

    def _host_slot(self) -> int:
        """A free host slot, demoting the LRU host block to disk (or dropping it) when none is."""
        slot = self.host.free_slot()
        if slot is not None:
            return slot
        block_hash, block = self.host.pop_lru()
        self._removed(block_hash, "cpu")
        if self._disk_on():
            if block_hash not in self.disk:
                self.mover.wait_offloaded(block.offloaded)
                self.write_disk(block_hash, DiskBlock(block.parent, block.token_ids), self.host.data[block.slot],
                                BlockSource(HOST_SLOT, block.slot))
        elif self.shared is not None:
            self.mover.wait_offloaded(block.offloaded)
            self.write_shared(block_hash, DiskBlock(block.parent, block.token_ids), self.host.data[block.slot],
                              BlockSource(HOST_SLOT, block.slot))
        return block.slot

    def _disk_on(self) -> bool:
        return self.disk is not None and self.disk.writes_on

    def _offload_below_host(self, evicted: list[Evicted]) -> None:
        """Blocks the host tier cannot take go to the disk tier, or without one to the shared tier
        (a private disk tier keeps its own LRU: the shared tier then gets what a drain writes)."""
        if self._disk_on():
            fresh, write = [e for e in evicted if e.block_hash not in self.disk], self.write_disk
        elif self.shared is not None:
            fresh, write = evicted, self.write_shared     # a block already there is skipped by the writer
        else:
            return
        if not fresh:
            return
        staged = self.mover.offload_to_memory([e.block_id for e in fresh])   # (n, L, 2, bs, n_kv, hd * isz)
        for e, block in zip(fresh, staged):
            write(e.block_hash, DiskBlock(e.parent, e.token_ids), block, BlockSource(DEVICE_BLOCK, e.block_id))

    def write_shared(self, block_hash: bytes, block: DiskBlock, data: torch.Tensor, source: BlockSource) -> None:
        """Queue a block's file in the shared tier; `data` (host bytes, read from `source`) is
        copied. Its KV event has tier "shared": the prefix index files it under the store's id, not
        this worker (a failed write is reported gone by a later flush)."""
        self.shared.write(block_hash, block, bytearray(data.reshape(-1).numpy()))
        self.mirror.shared_write(source, block_hash, block)
        self.stats.offloaded_blocks["shared"] += 1
        self._stored(block_hash, block.parent, block.token_ids, "shared")

    def write_disk(self, block_hash: bytes, block: DiskBlock, data: torch.Tensor, source: BlockSource) -> None:
        """Queue a block's file; `data` (host bytes, read from `source`) is copied, so its slot may
        be reused at once."""
        disk = self.disk
        while disk.is_full():
            gone = disk.pop_lru()
            self.mirror.disk_forget(gone)
            self._removed(gone, "disk")
        disk.write(block_hash, block, bytearray(data.reshape(-1).numpy()))
        self.mirror.disk_write(source, block_hash, block)
        self.stats.offloaded_blocks["disk"] += 1
        self._stored(block_hash, block.parent, block.token_ids, "disk")

    def poll_disk(self) -> list[bytes]:
        """Settle the disk tier's background writes (their times feed the bandwidth estimate) and
        step its check of the directory; the blocks it dropped (a failed write, a file deleted
        outside kvmesh) are forgotten on every rank and reported removed. Returns those blocks."""
        for num_bytes, seconds in self.disk.poll():
            self.policy.observe_copy("disk", num_bytes, seconds)
        dropped = self.disk.take_dropped()
        for block_hash in dropped:
            self.mirror.disk_forget(block_hash)
            self._removed(block_hash, "disk")
        return dropped

    # ---- reload --------------------------------------------------------------------------
    def plan(self, seq: Sequence, first: int) -> LoadPlan:
        """How many blocks of seq after its first `first` (the device's hit) to load; no side
        effect but noting a shared-tier miss (the index may credit that file: it is reported if it
        stays missing). Never the block of the last prompt token: its logits are needed."""
        limit = (seq.num_tokens - 1) // self.block_size
        tiers: list[str] = []
        for block_hash in seq.block_hashes[first:limit]:
            if self.host is not None and block_hash in self.host:
                tiers.append("cpu")
            elif self.disk is not None and block_hash in self.disk:
                tiers.append("disk")
            elif self.shared is not None and self.shared.holds(block_hash):   # a stat, past the private hits
                tiers.append("shared")
            else:
                if self.shared is not None:
                    self.shared.note_miss(block_hash)
                break
        if not tiers:
            return LoadPlan(0, 0.0, 0.0)
        plan = self.policy.choose(tiers, seq.num_tokens - first * self.block_size)
        self._planned = (seq, plan, tiers)
        return plan

    def _count_decision(self, seq: Sequence) -> None:
        """Metrics of the plan of an admitted sequence (a plan whose admission failed is not counted)."""
        planned, self._planned = self._planned, None
        if planned is None or planned[0] is not seq:
            return
        _, plan, tiers = planned
        available = len(tiers)
        decision = "recompute" if plan.num_blocks == 0 else "load" if plan.num_blocks == available else "split"
        self.stats.decisions[decision] += 1
        self.stats.recomputed_tier_tokens += (available - plan.num_blocks) * self.block_size
        self.stats.predicted_load_s.observe(plan.load_s)
        self.stats.predicted_recompute_s.observe(plan.recompute_s)

    def joins_step(self, seq: Sequence, step_tokens: int, others_running: bool) -> bool:
        """Whether seq's planned load runs inside this step, layer by layer under its forward
        (LoadPolicy.joins_step), rather than beside it, seq joining a later step. Beside running
        sequences, a load with file blocks never joins: its files are read beside the steps."""
        planned = self._planned
        if planned is None or planned[0] is not seq:
            return self.policy.joins_step(0.0, step_tokens, others_running)
        _, plan, tiers = planned
        if others_running and self.file_loads is not None and any(t != "cpu" for t in tiers[:plan.num_blocks]):
            return False
        return self.policy.joins_step(plan.load_s, step_tokens, others_running)

    def begin_load(self, seq: Sequence, first: int, num_blocks: int, groups: int = 1) -> PendingLoad | None:
        """Start bringing blocks first..first+num_blocks of seq back into its block table (already
        allocated): the sources are read and copied towards the device (CUDA: on the load stream,
        in `groups` layer groups, while the batch goes on). None when none is found (one gone or
        not verifying ends the run: the rest is computed). Then either finish_load once `ready`,
        or join_load and a forward that scatters it layer by layer (layer_loads.LayerLoads)."""
        self._count_decision(seq)
        if not num_blocks:
            return None
        sources, pending, tiers, where = self._read_sources(seq.block_hashes[first:first + num_blocks])
        load_id, agreed = self.mirror.stage(where)
        if agreed < len(sources):           # another rank lacks this block's file: it goes everywhere
            if where[agreed].kind == DISK_FILE:             # (host slots are on every rank; a shared
                self.forget_disk(where[agreed].block_hash)  # file is no one's: a miss, nothing more)
            sources, pending, tiers = sources[:agreed], pending[:agreed], tiers[:agreed]
        self.stats.load_shortfall_blocks += num_blocks - len(sources)
        # Order matters: the sources are copied out first (the flush may reuse their host slots),
        # then the blocks evicted for this sequence, which may be its destinations, go down a tier
        # (the gather of the flush runs on the step stream, before any scatter of this load).
        t = time.perf_counter()
        staged = self.mover.stage(sources, pending, min(groups, self.mover.layer_groups(len(sources)))) \
            if sources else None
        copy_s = time.perf_counter() - t
        self.flush()
        if staged is None:
            return None
        return PendingLoad(seq, first, staged, tiers, copy_s, load_id)

    def begin_load_beside(self, seq: Sequence, first: int, num_blocks: int) -> PendingLoad | FileLoad | None:
        """begin_load for a load that runs beside the step: one with disk or shared-tier blocks
        reads their files on reader threads (file_loads.py) and is ready at a later schedule."""
        hashes = seq.block_hashes[first:first + num_blocks]
        if self.file_loads is None or not num_blocks or not self.file_loads.holds_files(hashes):
            return self.begin_load(seq, first, num_blocks)
        self._count_decision(seq)
        return self.file_loads.begin(seq, first, hashes)

    def ready(self, load: PendingLoad | FileLoad) -> bool:
        """The load's reads and its copy towards the device are done (the copy always is, off
        CUDA); never waits."""
        if isinstance(load, FileLoad):
            return self.file_loads.ready(load)
        return load.staged.copied is None or load.staged.copied.query()

    def wait_reads(self, timeout_s: float) -> None:
        """Block until a file read finishes or timeout_s passes: for an engine whose only work is
        sequences waiting for their files (instead of spinning on empty steps)."""
        if self.file_loads is not None and not self.file_loads.reader.wait_any(timeout_s) \
                and self.file_loads.awaiting_ranks:
            time.sleep(timeout_s)         # read here, still read on another rank: no spin on the vote

    def observe_reads(self, reads: list[tuple[str, FileRead]]) -> None:
        """A load's file reads, timed on the reader threads: per tier, its bytes over the span from
        the first read's start to the last one's end (the pool's reads overlap)."""
        for tier in {t for t, _ in reads}:
            timed = [r for t, r in reads if t == tier and r.end > r.start]     # queued bytes are not
            if timed:
                span = max(r.end for r in timed) - min(r.start for r in timed)
                self.policy.observe_copy(tier, len(timed) * self.mover.block_bytes, span)

    def finish_load(self, load: PendingLoad | FileLoad) -> int:
        """Scatter a started load into its blocks (ordered after its copy), advancing the
        sequence's num_computed_tokens; returns the blocks loaded. The loaded blocks join the
        device's prefix cache when the engine registers the sequence's computed blocks."""
        if isinstance(load, FileLoad):
            return self._join(load.seq, self.file_loads.finish(load))
        t = time.perf_counter()
        self.scatter(load)
        if not self.mover.cuda and set(load.tiers) == {"cpu"}:     # CUDA copies are timed on the device
            n = len(load.tiers)
            self.policy.observe_copy("cpu", n * self.mover.block_bytes, load.copy_s + time.perf_counter() - t)
        return self.join_load(load)

    def scatter(self, load: PendingLoad) -> None:
        """A staged load -> its device blocks, every layer, on every rank."""
        self.mover.scatter(load.staged, load.block_ids)
        self.mirror.scatter(load.mirror_id, load.block_ids)

    def drop_load(self, load: PendingLoad | FileLoad) -> None:
        """A load that will not be scattered (its sequence left): its reads and staging go, on
        every rank."""
        if isinstance(load, FileLoad):
            self.file_loads.drop(load)
        else:
            self.mirror.release(load.mirror_id)

    def join_layered(self, load: PendingLoad) -> int:
        """join_load for a load whose scatter the step's forward does, layer by layer."""
        if not self.mover.cuda and set(load.tiers) == {"cpu"}:
            self.policy.observe_copy("cpu", len(load.tiers) * self.mover.block_bytes, load.copy_s)
        return self.join_load(load)

    def join_load(self, load: PendingLoad) -> int:
        """Count a load's blocks as computed: their KV is in the blocks, or will be before each
        layer reads them (a forward scattering them layer by layer). Returns the blocks loaded."""
        return self._join(load.seq, load.tiers)

    def _join(self, seq: Sequence, tiers: list[str]) -> int:
        n = len(tiers)
        for tier in tiers:
            self.stats.loaded_blocks[tier] += 1
        seq.num_computed_tokens += n * self.block_size
        self.block_manager.prefix_hit_tokens += n * self.block_size
        return n

    def _read_sources(self, hashes: list[bytes]) -> tuple[list[torch.Tensor], list, list[str], list[BlockSource]]:
        sources, pending, tiers, where = [], [], [], []
        for block_hash in hashes:
            block = self.host.get(block_hash) if self.host is not None else None
            if block is not None:
                sources.append(self.host.data[block.slot])
                pending.append(block.offloaded)
                tiers.append("cpu")
                where.append(BlockSource(HOST_SLOT, block.slot))
                continue
            payload, tier, kind = self._read_disk(block_hash), "disk", DISK_FILE
            if payload is None:
                payload, tier, kind = self._read_shared(block_hash), "shared", SHARED_FILE
            if payload is None:
                break
            sources.append(payload)
            pending.append(None)
            tiers.append(tier)
            where.append(BlockSource(kind, -1, block_hash))
        return sources, pending, tiers, where

    def forget_disk(self, block_hash: bytes) -> None:
        """A block's file is gone or did not verify (here or on another rank): forgotten everywhere."""
        self.disk.forget(block_hash)
        self.mirror.disk_forget(block_hash)
        self._removed(block_hash, "disk")

    def _read_disk(self, block_hash: bytes) -> torch.Tensor | None:
        disk = self.disk
        if disk is None or block_hash not in disk:
            return None
        payload = disk.read(block_hash)
        if payload is None:                      # did not verify: deleted
            self.forget_disk(block_hash)
            return None
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.mover.block_shape)

    def _read_shared(self, block_hash: bytes) -> torch.Tensor | None:
        """A shared file gone or not verifying is a miss: the block is recomputed."""
        payload = self.shared.read(block_hash) if self.shared is not None else None
        if payload is None:
            return None
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.mover.block_shape)

    # ---- rates ---------------------------------------------------------------------------
    def step_scheduled(self) -> None:
        """End of a schedule: offloads go out before the step overwrites anything."""
        self.flush()

    def measure_bandwidth(self) -> None:
        """Start-up estimates of each tier's bandwidth from a few real block copies: device
        blocks are only read, into host slots that are still free, and the disk probe file is
        deleted."""
        n = min(_PROBE_BLOCKS, self.block_manager.num_blocks,
                self.host.num_slots if self.host is not None else _PROBE_BLOCKS)
        ids = list(range(n))
        t = time.perf_counter()
        if self.host is not None:
            self.mover.wait_offloaded(self.mover.offload(ids, self.host.data, ids))
            staged = self.host.data[:n]
        else:
            staged = self.mover.offload_to_memory(ids)
        self.policy.observe_copy("cpu", n * self.mover.block_bytes, time.perf_counter() - t)
        if self.disk is not None:                # one file written and read back, then deleted
            probe = b"\x00" * 16
            self.disk.write(probe, DiskBlock(None, (0,) * self.block_size), bytearray(staged[0].reshape(-1).numpy()))
            self.disk.drain()
            for num_bytes, seconds in self.disk.poll():     # a failed write dropped the probe
                self.policy.observe_copy("disk", num_bytes, seconds)
            self.disk.take_dropped()                        # the probe only: it was never announced
            if probe in self.disk:
                self.disk.read(probe)
            self.disk.forget(probe)
            self.disk.drain()
            self.poll_disk()
        if self.shared is not None:              # a probe of a name of its own: workers probe at once
            probe = os.urandom(16)
            self.shared.write(probe, DiskBlock(None, (0,) * self.block_size), bytearray(staged[0].reshape(-1).numpy()))
            self.shared.drain()
            self.shared.read(probe)
            self.shared.forget(probe)
            self.shared.drain()
            for num_bytes, seconds in self.shared.poll():
                self.policy.observe_copy("shared", num_bytes, seconds)

    # ---- maintenance ---------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every lower-tier block (the caller announces AllCleared for every tier). The
        shared tier's files are every worker's: they stay."""
        self._evicted = []
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self.disk.clear()
            self.mirror.disk_clear()

    def snapshot(self) -> list[tuple[bytes, bytes | None, list[int], str]]:
        """Every lower-tier block as (hash, parent, token_ids, tier)."""
        out = []
        if self.host is not None:
            out += [(h, b.parent, list(b.token_ids), "cpu") for h, b in self.host.hashes()]
        if self.disk is not None:
            out += [(h, b.parent, list(b.token_ids), "disk") for h, b in self.disk.hashes()]
        return out

    def stats_dict(self) -> dict:
        s = self.stats
        return {
            "cpu_blocks": len(self.host) if self.host is not None else 0,
            "cpu_capacity_blocks": self.host.num_slots if self.host is not None else 0,
            "disk_blocks": len(self.disk) if self.disk is not None else 0,
            # writes on (off for a back-off after persistent write failures: blocks on disk still load)
            "disk_enabled": bool(self.disk is not None and self.disk.writes_on),
            "disk_corrupt_files": self.disk.num_corrupt if self.disk is not None else 0,
            "disk_write_errors": self.disk.backoff.num_errors if self.disk is not None else 0,
            "disk_vanished_files": self.disk.num_vanished if self.disk is not None else 0,
            "disk_restored_blocks": self.disk.num_restored if self.disk is not None else 0,
            # the files at rank 0's last scan (every worker's, not this worker's: the whole directory,
            # or with tensor parallelism rank 0's subdirectory); corrupt files: rank 0's
            "shared_blocks": self.shared.estimate.files if self.shared is not None else 0,
            "shared_corrupt_files": self.shared.num_corrupt if self.shared is not None else 0,
            "shared_write_errors": self.shared.num_write_errors if self.shared is not None else 0,
            "offloaded_blocks": dict(s.offloaded_blocks), "loaded_blocks": dict(s.loaded_blocks),
            "decisions": dict(s.decisions), "recomputed_tier_tokens": s.recomputed_tier_tokens,
            "load_shortfall_blocks": s.load_shortfall_blocks,
            "bandwidth_bytes_per_s": dict(self.policy.bandwidth),
            "prefill_tokens_per_s": self.policy.prefill_rate or 0.0,
            "predicted_load_s": s.predicted_load_s.as_dict(),
            "predicted_recompute_s": s.predicted_recompute_s.as_dict(),
        }

    def close(self) -> None:
        """Finish the disk and shared tiers' queued writes and stop their threads."""
        if self.file_loads is not None:
            self.file_loads.close()
        if self.disk is not None:
            self.disk.close()
        if self.shared is not None:
            self.shared.close()

    def check_integrity(self) -> None:
        if self.host is not None:
            self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()
        if self.shared is not None:
            self.shared.check_integrity()
        if self.file_loads is not None:
            self.file_loads.check_integrity()
        self.mirror.check(self)
