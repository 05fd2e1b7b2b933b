"""What KVTiers tells the other ranks of a tensor-parallel worker: every data operation of the
tiers, so each rank repeats it on its own shard of the KV heads.

Rank 0 decides (LRUs, slots, policies, which files exist); the other ranks hold the same host
slots and the same file names and only repeat the copies, in rank 0's order relative to the
forward steps. With one rank there is nothing to repeat: `TierMirror` itself does nothing, and
gpu_worker/parallel/tp_tiers.py's TPTierMirror sends each call to the followers.

    offload        device blocks -> host slots          (the flush of evicted blocks)
    disk_write     a host slot or a device block -> its block's file
    disk_forget    delete one block's file;  disk_clear: every file
    shared_write   a host slot or a device block -> its block's file in the shared tier (each
                   rank: its own shard's subdirectory; a file already there is kept)
    stage          host slots / files -> a load's staging, agreed by every rank (a file may be
                   missing or not verify on one of them: the load stops at the first block any
                   rank lacks)
    read_files     a load beside the step: host slots staged, file reads started on each rank's
                   reader threads;  agree_read (later): the MIN over the ranks of the leading
                   file blocks verified, once every rank's reads are done
    scatter        a staged load -> its device blocks;  release: a load dropped before that
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from gpu_worker.kv_tiers.disk_tier import DiskBlock
    from gpu_worker.kv_tiers.manager import KVTiers

HOST_SLOT, DEVICE_BLOCK, DISK_FILE, SHARED_FILE = 0, 1, 2, 3
FILE_KINDS = (DISK_FILE, SHARED_FILE)


class BlockSource(NamedTuple):
    """Where a block's bytes are read from: a host slot, a device block, or its file (disk
    tier or shared tier)."""
    kind: int                 # HOST_SLOT | DEVICE_BLOCK | DISK_FILE | SHARED_FILE
    index: int                # the slot or the block id (-1 for a file)
    block_hash: bytes | None = None     # a file's block


class TierMirror:
    """One rank: nothing to repeat anywhere else."""

    #: loads may land layer by layer inside the forward (layer_loads.py); False: whole, before it
    layered_loads = True

    def attach(self, tiers: KVTiers) -> None:
        """Called once the tiers exist, before any other call."""

    def offload(self, block_ids: list[int], slots: list[int]) -> None:
        pass

    def disk_write(self, source: BlockSource, block_hash: bytes, block: DiskBlock) -> None:
        pass

    def disk_forget(self, block_hash: bytes) -> None:
        pass

    def shared_write(self, source: BlockSource, block_hash: bytes, block: DiskBlock) -> None:
        pass

    def disk_clear(self) -> None:
        pass

    def stage(self, sources: list[BlockSource]) -> tuple[int, int]:
        """-> (the load's id, how many of the sources every rank staged)."""
        return -1, len(sources)

    def read_files(self, sources: list[BlockSource]) -> int:
        """Every other rank stages the same host slots and starts reading the same files (its
        own shard's) now; -> the load's id."""
        return -1

    def agree_read(self, load_id: int, verified: int) -> int:
        """-> the leading file blocks every rank verified (the MIN of `verified`, this rank's),
        or -1 while another rank's reads still run (ask again at a later schedule)."""
        return verified

    def scatter(self, load_id: int, block_ids: list[int]) -> None:
        pass

    def release(self, load_id: int) -> None:
        pass

    def check(self, tiers: KVTiers) -> None:
        """Every other rank's tiers hold what rank 0's do (AssertionError otherwise)."""
