"""Loads beside the step whose blocks include disk or shared-tier files: the files are read on
reader threads (file_reads.py) while the batch goes on, the sequence waiting in `loading`.

    admission      host blocks -> staged at once (before the flush may give their slots away)
                   file blocks -> a ReadBatch (a block whose write is still queued: its bytes)
                   flush
    each schedule  ready(): the reads done? -> settle them in order (the tiers' index, counters
                   and deletes, on the engine's thread) -> the run ends at the first block that
                   is gone or did not verify -> the file blocks up to there staged (H2D on CUDA)
                   -> ready once that copy is done
    then           finish(): both stagings scattered into their blocks, the sequence joins running

    block i of the load     0     1     2     3     4
    tier                    disk  cpu   disk  disk  cpu
    staged                  files host  files files host    (host: at admission; files: at land)
    read fails at 3         ---- loaded ----  computed ...   (cut = 3)

Without tensor parallelism only: a tensor-parallel worker's ranks read their own files and vote
on what all of them read (mirror.stage), synchronously at admission (KVTiers.begin_load).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from gpu_worker.kv_tiers.block_mover import Staged
from gpu_worker.kv_tiers.disk_tier import DiskBlock
from gpu_worker.kv_tiers.file_reads import FileRead, FileReader, ReadBatch
from gpu_worker.sequence import Sequence

if TYPE_CHECKING:
    from gpu_worker.kv_tiers.manager import KVTiers


@dataclass
class FileLoad:
    seq: Sequence
    first: int                          # index of the first loaded block in seq's table
    tiers: list[str]                    # the planned tier of each block
    hashes: list[bytes]
    host: Staged | None                 # the host blocks, in order, staged at admission
    entries: list[DiskBlock | None]     # per file block: the disk index entry its read began on
    reads: ReadBatch                    # per file block, in order
    landed: bool = False
    cut: int = 0                        # once landed: the blocks loaded (a prefix of tiers)
    files: Staged | None = None         # once landed: the file blocks before the cut
    file_tiers: list[str] = field(default_factory=list)


def _queued(payload: memoryview) -> Callable[[], FileRead]:
    """A 'read' of a block whose write is still queued: its bytes, untimed."""
    return lambda: FileRead(payload, None, False, 0.0, 0.0)


class FileLoads:
    def __init__(self, tiers: KVTiers) -> None:
        self.tiers = tiers
        self.reader = FileReader(tiers.mover.block_bytes, tiers.mover.device)

    def holds_files(self, hashes: list[bytes]) -> bool:
        host = self.tiers.host
        return any(host is None or h not in host for h in hashes)

    def begin(self, seq: Sequence, first: int, hashes: list[bytes]) -> FileLoad:
        tiers = self.tiers
        host, disk, shared = tiers.host, tiers.disk, tiers.shared
        sources, pending, kinds, reads, entries = [], [], [], [], []
        for h in hashes:
            block = host.get(h) if host is not None else None
            if block is not None:
                sources.append(host.data[block.slot])
                pending.append(block.offloaded)
                kinds.append("cpu")
                continue
            if disk is not None and h in disk:
                queued, tier, entry = disk.queued_payload(h), "disk", disk.entry(h)
                read = disk.read_file
            elif shared is not None and shared.holds(h):
                queued, tier, entry = shared.queued_payload(h), "shared", None
                read = shared.read_file
            else:
                break
            reads.append(_queued(queued) if queued is not None else (lambda read=read, h=h: read(h)))
            kinds.append(tier)
            entries.append(entry)
        tiers.stats.load_shortfall_blocks += len(hashes) - len(kinds)    # gone since the plan
        batch = self.reader.submit(reads)
        # the host sources are copied out before the flush, which may give their slots away
        staged = tiers.mover.stage(sources, pending) if sources else None
        tiers.flush()
        return FileLoad(seq, first, kinds, hashes[:len(kinds)], staged, entries, batch)

    def ready(self, load: FileLoad) -> bool:
        """Never waits: False while a read or the last copy towards the device runs."""
        if not load.landed:
            if not load.reads.done():
                return False
            self._land(load)
        last = load.files if load.files is not None else load.host
        return last is None or last.copied is None or last.copied.query()

    def _land(self, load: FileLoad) -> None:
        """Settle the reads in order, cut the load at the first block lost, stage the file blocks."""
        tiers = self.tiers
        results = self.reader.collect(load.reads)
        load.landed = True
        payloads, k = [], 0
        for i, tier in enumerate(load.tiers):
            if tier == "cpu":
                continue
            payloads.append(self._settle(load.hashes[i], tier, load.entries[k], results[k]))
            k += 1
        tiers.observe_reads([(t, r) for t, r in zip((t for t in load.tiers if t != "cpu"), results)
                             if r.payload is not None])
        lost = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
        file_index = [i for i, t in enumerate(load.tiers) if t != "cpu"]
        load.cut = file_index[lost] if lost < len(payloads) else len(load.tiers)
        tiers.stats.load_shortfall_blocks += len(load.tiers) - load.cut
        kept = payloads[:lost]
        load.file_tiers = [load.tiers[i] for i in file_index[:lost]]
        if kept:
            shape = tiers.mover.block_shape
            load.files = tiers.mover.stage([_as_block(p, shape) for p in kept], [None] * len(kept))

    def _settle(self, block_hash: bytes, tier: str, entry: DiskBlock | None, result: FileRead):
        tiers = self.tiers
        if tier == "shared":
            return tiers.shared.settle_read(block_hash, result)
        indexed = block_hash in tiers.disk
        payload = tiers.disk.settle_read(block_hash, entry, result)
        if indexed and block_hash not in tiers.disk:     # damaged or removed under it: forgotten everywhere
            tiers.forget_disk(block_hash)
        return payload

    def finish(self, load: FileLoad) -> list[str]:
        """Scatter a ready load's blocks before its cut; returns their tiers."""
        mover = self.tiers.mover
        tiers = load.tiers[:load.cut]
        ids = load.seq.block_table[load.first:load.first + load.cut]
        host_ids = [b for b, t in zip(ids, tiers) if t == "cpu"]
        file_ids = [b for b, t in zip(ids, tiers) if t != "cpu"]
        if host_ids:                                 # the host blocks before the cut: a prefix
            host = load.host
            mover.scatter(Staged(host.data[:len(host_ids)], host.ready, host.per_group), host_ids)
        if file_ids:
            mover.scatter(load.files, file_ids)
        return tiers

    def drop(self, load: FileLoad) -> None:
        """A load that will not land: its reads are cancelled or discarded, its staging freed."""
        if not load.landed:
            self.reader.drop(load.reads)
            load.landed = True
        load.host = load.files = None

    def close(self) -> None:
        self.reader.close()

    def check_integrity(self) -> None:
        self.reader.check_integrity()


def _as_block(payload, shape) -> torch.Tensor:
    """A read's payload as one block (L, 2, bs, n_kv, hd * itemsize), uint8; pinned ones as they are."""
    if isinstance(payload, torch.Tensor):
        return payload.view(shape)
    return torch.frombuffer(payload, dtype=torch.uint8).view(shape)
