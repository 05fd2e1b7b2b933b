"""A follower rank's side of the loads beside the step (gpu_worker/kv_tiers/file_loads.py): the
same host slots staged and the same files read (its own shard's) on reader threads of its own,
while it runs rank 0's forwards; the load is cut where every rank agrees.

    rank 0                                   follower rank r
    admission: READ_FILES record  -------->  stage the host slots, submit the file reads
    (forwards go on; the reads run on every rank's kvmesh-kv-read threads)
    reads settled here: TIER_LAND -------->  verified(): -1 while its reads run, else the leading
                                             file blocks that verified here
               <------ MIN over the ranks -------
    MIN >= 0: cut there on every rank        land(): the file blocks before the cut staged
    SCATTER record                -------->  host and file stagings -> their blocks
    RELEASE record (abort, preemption) --->  reads cancelled or discarded, stagings freed

Not ready answers -1 rather than waiting for its reads: a follower waiting inside TIER_LAND would
hold rank 0 (and with it every running request's step) on that rank's disk; with -1 rank 0 asks
again at a later schedule, and the steps go on meanwhile. The vote costs one small all-reduce per
schedule per load whose reads are done on rank 0.

Nothing is decided here: a file missing or failing its check only lowers this rank's answer;
rank 0 forgets a disk block everywhere when it is the one the load was cut at.
"""
from __future__ import annotations

from typing import NamedTuple

from gpu_worker.kv_tiers.block_mover import BlockMover, Staged
from gpu_worker.kv_tiers.disk_tier import DiskTier
from gpu_worker.kv_tiers.file_loads import as_block, queued_read
from gpu_worker.kv_tiers.file_reads import FileRead, FileReader, ReadBatch
from gpu_worker.kv_tiers.mirror import DISK_FILE, HOST_SLOT, BlockSource
from gpu_worker.kv_tiers.shared_tier import SharedTier


class FollowerRead(NamedTuple):
    kinds: list[int]                  # per block of the load: HOST_SLOT, DISK_FILE or SHARED_FILE
    host: Staged | None               # the host blocks, in order, staged at the record
    reads: ReadBatch                  # per file block, in order
    sources: list[BlockSource]


class LandedRead(NamedTuple):
    """A load agreed by every rank: its blocks before the cut, staged, waiting for SCATTER."""
    kinds: list[int]                  # the blocks before the cut
    host: Staged | None
    files: Staged | None

    def scatter(self, mover: BlockMover, block_ids: list[int]) -> None:
        host_ids = [b for b, k in zip(block_ids, self.kinds) if k == HOST_SLOT]
        file_ids = [b for b, k in zip(block_ids, self.kinds) if k != HOST_SLOT]
        if host_ids:                  # the host blocks before the cut: a prefix of the staging
            mover.scatter(Staged(self.host.data[:len(host_ids)], self.host.ready, self.host.per_group), host_ids)
        if file_ids:
            mover.scatter(self.files, file_ids)


def _missing() -> FileRead:
    """A file this rank's index does not hold (forgotten here by a failed write): a miss."""
    return FileRead(None, "not held on this rank", True, 0.0, 0.0)


class FollowerFileLoads:
    def __init__(self, mover: BlockMover, host, offloaded: dict, disk: DiskTier | None,
                 shared: SharedTier | None) -> None:
        self.mover, self.host, self.offloaded = mover, host, offloaded
        self.disk, self.shared = disk, shared
        self.reader = FileReader(mover.block_bytes, mover.device)
        self.reading: dict[int, FollowerRead] = {}        # load id -> reads not agreed yet
        self.settled: dict[int, tuple[list, int]] = {}     # load id -> (payloads, verified), reads done

    def begin(self, load_id: int, sources: list[BlockSource]) -> None:
        """READ_FILES: the host slots staged now (later records may reuse them), the reads started."""
        data, pending, reads = [], [], []
        for s in sources:
            if s.kind == HOST_SLOT:
                data.append(self.host[s.index])
                pending.append(self.offloaded.get(s.index))
            else:
                reads.append(self._read(s))
        batch = self.reader.submit(reads)
        staged = self.mover.stage(data, pending) if data else None
        self.reading[load_id] = FollowerRead([s.kind for s in sources], staged, batch, sources)

    def _read(self, source: BlockSource):
        tier = self.disk if source.kind == DISK_FILE else self.shared
        h = source.block_hash
        if tier is None or (source.kind == DISK_FILE and h not in tier):
            return _missing
        queued = tier.queued_payload(h)
        return queued_read(queued) if queued is not None else (lambda: tier.read_file(h))

    def verified(self, load_id: int) -> int:
        """TIER_LAND's answer: the leading file blocks verified here, or -1 while reads run."""
        if load_id not in self.settled:
            read = self.reading[load_id]
            if not read.reads.done():
                return -1
            results = self.reader.collect(read.reads)
            files = [s for s in read.sources if s.kind != HOST_SLOT]
            for s, r in zip(files, results):
                if s.kind != DISK_FILE and r.payload is None:
                    self.shared.settle_read(s.block_hash, r)      # counted, logged (deleted already)
            payloads = [r.payload for r in results]
            self.settled[load_id] = (payloads, next((i for i, p in enumerate(payloads) if p is None),
                                                    len(payloads)))
        return self.settled[load_id][1]

    def land(self, load_id: int, agreed: int) -> LandedRead:
        """The load cut after `agreed` file blocks (every rank verified those): staged for SCATTER."""
        read = self.reading.pop(load_id)
        payloads, _ = self.settled.pop(load_id)
        file_index = [i for i, k in enumerate(read.kinds) if k != HOST_SLOT]
        cut = file_index[agreed] if agreed < len(file_index) else len(read.kinds)
        files = (self.mover.stage([as_block(p, self.mover.block_shape) for p in payloads[:agreed]],
                                  [None] * agreed) if agreed else None)
        return LandedRead(read.kinds[:cut], read.host, files)

    def drop(self, load_id: int) -> None:
        """RELEASE before the land: queued reads cancelled, running ones discarded."""
        read = self.reading.pop(load_id, None)
        if read is not None and self.settled.pop(load_id, None) is None:
            self.reader.drop(read.reads)

    def close(self) -> None:
        self.reader.close()

    def check_integrity(self) -> None:
        assert set(self.settled) <= set(self.reading), "file reads: a settled load that is not reading"
        self.reader.check_integrity()
