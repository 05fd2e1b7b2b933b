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

With tensor parallelism every rank does the same on its own shard's files: the admission tells
the followers (mirror.read_files: a record sent before the step's forward) to stage the same host
slots and start the same reads on their reader threads; once rank 0's reads are settled, each
schedule asks the ranks (mirror.agree_read) how many leading file blocks they verified, and the
MIN is where the load is cut on every rank, or -1 while a rank still reads (asked again at the next
schedule: a follower never blocks the step on its disk). Nothing is staged from the files on any
rank before that agreement.

    rank 0          reads done -> settled -> verified v0 --agree_read--> MIN(v0, v1, ...) = cut
    follower r      reads (beside its forwards)     ---> v_r, or -1 while they run
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from gpu_worker.kv_tiers.block_mover import Staged
from gpu_worker.kv_tiers.disk_tier import DiskBlock
from gpu_worker.kv_tiers.file_reads import FileRead, FileReader, ReadBatch
from gpu_worker.kv_tiers.mirror import DISK_FILE, HOST_SLOT, SHARED_FILE, BlockSource
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
    mirror_id: int = -1                 # the load's id on the other tensor-parallel ranks
    payloads: list | None = None        # once settled here: per file block, its payload or None
    verified: int = -1                  # once settled here: the leading file blocks verified here
    landed: bool = False
    cut: int = 0                        # once landed: the blocks loaded (a prefix of tiers)
    files: Staged | None = None         # once landed: the file blocks before the cut
    file_tiers: list[str] = field(default_factory=list)


def queued_read(payload: memoryview) -> Callable[[], FileRead]:
    """A 'read' of a block whose write is still queued: its bytes, untimed."""
    return lambda: FileRead(payload, None, False, 0.0, 0.0)


class FileLoads:
    def __init__(self, tiers: KVTiers) -> None:
        self.tiers = tiers
        self.reader = FileReader(tiers.mover.block_bytes, tiers.mover.device)
        self.awaiting_ranks: set[int] = set()     # id() of loads read here, not yet on another rank

    def holds_files(self, hashes: list[bytes]) -> bool:
        host = self.tiers.host
        return any(host is None or h not in host for h in hashes)

    def begin(self, seq: Sequence, first: int, hashes: list[bytes]) -> FileLoad:
        tiers = self.tiers
        host, disk, shared = tiers.host, tiers.disk, tiers.shared
        sources, pending, kinds, reads, entries, where = [], [], [], [], [], []
        for h in hashes:
            block = host.get(h) if host is not None else None
            if block is not None:
                sources.append(host.data[block.slot])
                pending.append(block.offloaded)
                kinds.append("cpu")
                where.append(BlockSource(HOST_SLOT, block.slot))
                continue
            if disk is not None and h in disk:
                queued, tier, entry = disk.queued_payload(h), "disk", disk.entry(h)
                read, kind = disk.read_file, DISK_FILE
            elif shared is not None and shared.holds(h):
                queued, tier, entry = shared.queued_payload(h), "shared", None
                read, kind = shared.read_file, SHARED_FILE
            else:
                break
            reads.append(queued_read(queued) if queued is not None else (lambda read=read, h=h: read(h)))
            kinds.append(tier)
            entries.append(entry)
            where.append(BlockSource(kind, -1, h))
        tiers.stats.load_shortfall_blocks += len(hashes) - len(kinds)    # gone since the plan
        batch = self.reader.submit(reads)
        # the host sources are copied out before the flush, which may give their slots away (the
        # other ranks copy theirs at the same point: their record goes before the flush's)
        staged = tiers.mover.stage(sources, pending) if sources else None
        mirror_id = tiers.mirror.read_files(where)
        tiers.flush()
        return FileLoad(seq, first, kinds, hashes[:len(kinds)], staged, entries, batch, mirror_id)

    def ready(self, load: FileLoad) -> bool:
        """Never waits: False while a read (on any rank) or the last copy towards the device runs."""
        if not load.landed:
            if load.payloads is None:
                if not load.reads.done():
                    return False
                self._settle_reads(load)
            agreed = self.tiers.mirror.agree_read(load.mirror_id, load.verified)
            if agreed < 0:                   # another rank still reads: asked again next schedule
                self.awaiting_ranks.add(id(load))
                return False
            self.awaiting_ranks.discard(id(load))
            self._land(load, agreed)
        last = load.files if load.files is not None else load.host
        return last is None or last.copied is None or last.copied.query()

    def _settle_reads(self, load: FileLoad) -> None:
        """Settle this rank's reads in order (index, counters, deletes): -> load.payloads, verified."""
        tiers = self.tiers
        results = self.reader.collect(load.reads)
        payloads, k = [], 0
        for i, tier in enumerate(load.tiers):
            if tier == "cpu":
                continue
            payloads.append(self._settle(load.hashes[i], tier, load.entries[k], results[k]))
            k += 1
        tiers.observe_reads([(t, r) for t, r in zip((t for t in load.tiers if t != "cpu"), results)
                             if r.payload is not None])
        load.payloads = payloads
        load.verified = next((i for i, p in enumerate(payloads) if p is None), len(payloads))

    def _land(self, load: FileLoad, agreed: int) -> None:
        """Cut the load at the first file block some rank lost (`agreed` of them verified
        everywhere), stage the file blocks before it."""
        tiers = self.tiers
        load.landed = True
        file_index = [i for i, t in enumerate(load.tiers) if t != "cpu"]
        if agreed < load.verified and load.tiers[file_index[agreed]] == "disk":
            lost = load.hashes[file_index[agreed]]      # another rank lacks it: gone everywhere (a
            if lost in tiers.disk:                      # shared file is no one's: a miss, no more)
                tiers.forget_disk(lost)
        load.cut = file_index[agreed] if agreed < len(file_index) else len(load.tiers)
        tiers.stats.load_shortfall_blocks += len(load.tiers) - load.cut
        kept, load.payloads = load.payloads[:agreed], []     # the read buffers go with the staging
        load.file_tiers = [load.tiers[i] for i in file_index[:agreed]]
        if kept:
            shape = tiers.mover.block_shape
            load.files = tiers.mover.stage([as_block(p, shape) for p in kept], [None] * len(kept))

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
        self.tiers.mirror.scatter(load.mirror_id, ids)
        return tiers

    def drop(self, load: FileLoad) -> None:
        """A load that will not land: its reads are cancelled or discarded, its staging freed, on
        every rank."""
        if not load.landed:
            if load.payloads is None:
                self.reader.drop(load.reads)
            self.awaiting_ranks.discard(id(load))
            load.landed = True
        load.host = load.files = None
        self.tiers.mirror.release(load.mirror_id)

    def close(self) -> None:
        self.reader.close()

    def check_integrity(self) -> None:
        self.reader.check_integrity()


def as_block(payload, shape) -> torch.Tensor:
    """A read's payload as one block (L, 2, bs, n_kv, hd * itemsize), uint8; pinned ones as they are."""
    if isinstance(payload, torch.Tensor):
        return payload.view(shape)
    return torch.frombuffer(payload, dtype=torch.uint8).view(shape)
