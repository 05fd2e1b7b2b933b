"""Per-worker bookkeeping of one match walk over the radix index (radix_index.py).

The running AND of owner masks per tier group, over worker slots:

    alive[0]: workers holding every block so far on GPU
    alive[1]: ... on GPU or CPU
    alive[2]: ... on any of their own tiers
    alive[3]: ... on their own tiers or in a shared tier they read

A worker's match in a group ends at the first block where its bit drops out. A node's shared
mask names shared-tier slots, not workers: `readers_of(mask)` turns it into the worker slots
that read one of those tiers (only live workers announcing the tier's id), so a shared-tier
block extends the match of exactly those workers.
"""
from __future__ import annotations

from typing import Callable

from services.protocol.kv_events import WorkerMatch


class Walk:
    __slots__ = ("alive", "ends", "readers_of")

    def __init__(self, first_masks: tuple[int, int, int, int], readers_of: Callable[[int], int]) -> None:
        self.readers_of = readers_of
        g, c, d, s = first_masks
        own = g | c | d
        self.alive = [g, g | c, own, own | (readers_of(s) if s else 0)]
        self.ends: tuple[dict[int, int], ...] = ({}, {}, {}, {})  # slot -> matched blocks

    def advance(self, masks: tuple[int, int, int, int], i: int) -> bool:
        """Block i has these owners: workers missing from it matched i blocks. False: none left."""
        g, c, d, s = masks
        own = g | c | d
        now = (g, g | c, own, own | (self.readers_of(s) if s else 0))
        alive = self.alive
        for k in range(4):
            if alive[k] & now[k] != alive[k]:
                _record(self.ends[k], alive[k] & ~now[k], i)
                alive[k] &= now[k]
        return bool(alive[3])

    def result(self, length: int, owner_at: list) -> list[WorkerMatch]:
        """Workers still alive after `length` blocks matched all of them; best first."""
        for k in range(4):
            _record(self.ends[k], self.alive[k], length)
        gpu, gpu_cpu, own, with_shared = self.ends
        out = []
        for slot, n in with_shared.items():
            if n <= 0:
                continue
            m = own.get(slot, 0)
            out.append(WorkerMatch(owner_at[slot], m, gpu.get(slot, 0), gpu_cpu.get(slot, 0),
                                   n if n > m else 0))
        out.sort(key=lambda w: (-w.any_blocks, -w.matched_blocks, -w.gpu_blocks, w.worker_id))
        return out


def _record(ends: dict[int, int], dropped: int, length: int) -> None:
    while dropped:
        low = dropped & -dropped
        ends[low.bit_length() - 1] = length
        dropped ^= low
