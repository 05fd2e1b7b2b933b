"""Drain to disk: a worker told to leave writes its hot KV to the node's shared tier, where any
worker on the node finds it (a conversation moved to another worker loads its history), or without
one to its own disk tier, so the next worker on the same directory (the same pod restarted, the
same volume) starts warm.

    device blocks in use, then cached ones most recently used first  \\  skipped when already on
    host-tier blocks most recently used first                          /  the tier; at most its
                                                                         size; until the deadline

Newest first, so a short grace keeps the blocks most likely to be asked for again. Device blocks
are read in batches (one gather and device-to-host copy each); host blocks are written from
their slots once their own offload copy is done. Runs on the engine's thread between steps.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

import torch

from gpu_worker.kv_tiers.disk_tier import DiskBlock
from gpu_worker.kv_tiers.manager import KVTiers
from gpu_worker.kv_tiers.mirror import DEVICE_BLOCK, HOST_SLOT, BlockSource

log = logging.getLogger("kvmesh.kv_tiers")

_BATCH_BLOCKS = 32           # device blocks read per gather
_PROGRESS_EVERY = 2_000      # blocks between two progress lines


class DrainResult(NamedTuple):
    written: int             # blocks queued and then settled on disk
    left: int                # blocks not written: the deadline or the disk's size came first
    seconds: float


def drain_to_disk(tiers: KVTiers, deadline: float) -> DrainResult:
    """Write the device's and the host tier's cached blocks to the shared tier when the engine has
    one (any worker on the node loads them, this one restarted too), else to its disk tier,
    newest first, until time.monotonic() passes `deadline`; waits for the writes. Neither tier:
    nothing to do."""
    t0 = time.monotonic()
    target = _target(tiers)
    if target is None:
        return DrainResult(0, 0, 0.0)
    device = [b for b in tiers.block_manager.blocks_newest_first() if not target.holds(b.hash)]
    host = [(h, b) for h, b in reversed(tiers.host.hashes()) if not target.holds(h)] if tiers.host is not None else []
    room = target.room
    written = 0
    for start in range(0, min(len(device), room), _BATCH_BLOCKS):
        if time.monotonic() >= deadline or not target.enabled():
            break
        batch = device[start:min(start + _BATCH_BLOCKS, room)]
        staged = tiers.mover.offload_to_memory([b.block_id for b in batch])   # (n, L, 2, bs, n_kv, hd * isz)
        for block, data in zip(batch, staged):
            target.write(block.hash, DiskBlock(block.parent, block.token_ids), data,
                         BlockSource(DEVICE_BLOCK, block.block_id))
        written = _progress(written, len(batch), t0)
    for block_hash, block in host[:max(room - written, 0)]:
        if time.monotonic() >= deadline or not target.enabled():
            break
        tiers.mover.wait_offloaded(block.offloaded)
        target.write(block_hash, DiskBlock(block.parent, block.token_ids), tiers.host.data[block.slot],
                     BlockSource(HOST_SLOT, block.slot))
        written = _progress(written, 1, t0)
    written -= target.settle()    # the blocks whose write failed (dropped by the tier)
    result = DrainResult(written, len(device) + len(host) - written, time.monotonic() - t0)
    log.info("KV drain to the %s tier: wrote %d cached blocks in %.2f s (%d left: deadline or size)",
             target.name, result.written, result.seconds, result.left)
    return result


class _Target(NamedTuple):
    """Where a drain writes: the shared tier or the disk tier, behind one face."""
    name: str
    holds: Callable[[bytes], bool]
    room: int                                 # blocks at most
    write: Callable[[bytes, DiskBlock, torch.Tensor, BlockSource], None]
    enabled: Callable[[], bool]
    settle: Callable[[], int]                 # waits for the writes; -> how many failed


def _target(tiers: KVTiers) -> _Target | None:
    shared, disk = tiers.shared, tiers.disk
    if shared is not None:
        def settle_shared() -> int:       # a failed shared write is counted there (shared_write_errors)
            shared.drain()
            return 0
        return _Target("shared", shared.holds, max(shared.max_bytes // shared.file_bytes, 0),
                       tiers.write_shared, lambda: True,
                       settle_shared)
    if disk is None or not disk.writes_on:
        return None
    errors = disk.backoff.num_errors

    def settle_disk() -> int:
        disk.drain()
        tiers.poll_disk()
        return disk.backoff.num_errors - errors
    return _Target("disk", disk.__contains__, disk.max_blocks, tiers.write_disk, lambda: disk.writes_on,
                   settle_disk)


def _progress(written: int, more: int, t0: float) -> int:
    if (written + more) // _PROGRESS_EVERY > written // _PROGRESS_EVERY:
        log.info("KV drain to disk: %d blocks written (%.1f s)", written + more, time.monotonic() - t0)
    return written + more
