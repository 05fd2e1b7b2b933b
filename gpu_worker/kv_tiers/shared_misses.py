"""Shared-tier lookups that found no file, reported to the prefix index so a stale credit heals.

The index credits a store's blocks from its readers' KV events; a removal lost in a gap of one
worker's stream (its snapshot carries no shared blocks: the files are everyone's) would leave a
credit for a file that is gone, and every request routed on it would recompute quietly. So a
lookup that misses is reported as a `BlockRemoved(tier="shared", missing=True)`, which the index
applies only where it credits the block: the first reader routed to a stale credit repairs it.

    note(h) ──► waiting (≤ MAX_MISSES, oldest first) ──MISS_GRACE_S──► take(): stat again;
                                                                        still missing ──► report
                reported (≤ MAX_REPORTS): h not noted again for MISS_REPEAT_S

The grace covers another worker's write: its BlockStored goes out when it queues the write,
before the file exists, and a report racing it would drop a credit that is about to be true. The
repeat window makes the misses of many requests on one stale block one event; the per-take limit
bounds the stats on the engine thread and the events of one flush.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

MISS_GRACE_S = 2.0
MISS_REPEAT_S = 30.0
MAX_MISSES = 1024            # waiting for their grace; more are ignored (a later miss notes them)
MAX_REPORTS = 4096           # remembered as reported, for MISS_REPEAT_S
MISSES_PER_TAKE = 32         # checked (one stat each) per take


class SharedMisses:
    """(engine thread only) The misses of one shared-tier store, waiting or recently reported."""

    def __init__(self) -> None:
        self._waiting: OrderedDict[bytes, float] = OrderedDict()    # block -> noted at
        self._reported: OrderedDict[bytes, float] = OrderedDict()   # block -> reported at

    def note(self, block_hash: bytes, now: float) -> None:
        """A lookup found no file for the block."""
        reported = self._reported.get(block_hash)
        if (reported is not None and now - reported < MISS_REPEAT_S) or block_hash in self._waiting:
            return
        if len(self._waiting) < MAX_MISSES:
            self._waiting[block_hash] = now

    def take(self, now: float, holds: Callable[[bytes], bool], limit: int = MISSES_PER_TAKE) -> list[bytes]:
        """Misses past their grace whose file `holds` still does not find, oldest first; at most
        `limit` checked, the rest at later calls."""
        missing = []
        for _ in range(limit):
            if not self._waiting:
                break
            block_hash, noted = next(iter(self._waiting.items()))
            if now - noted < MISS_GRACE_S:
                break
            del self._waiting[block_hash]
            if holds(block_hash):           # written meanwhile, by this worker or another: no report
                continue
            missing.append(block_hash)
            self._reported[block_hash] = now
            self._reported.move_to_end(block_hash)
            if len(self._reported) > MAX_REPORTS:
                self._reported.popitem(last=False)
        return missing

    def check_integrity(self) -> None:
        assert len(self._waiting) <= MAX_MISSES and len(self._reported) <= MAX_REPORTS, "shared misses unbounded"
