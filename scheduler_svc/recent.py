"""Dispatches the prefix-cache index cannot know yet.

A worker publishes a block only after it prefilled it, so for a moment after a dispatch the index
still says nobody holds that prompt, and a burst of requests sharing it would scatter over the
workers (each a miss):

    t0  dispatch A (system prompt S) -> worker 1         index: S nowhere
    t1  request B (also S) asks the index: no match      -> least loaded: worker 2, a miss
    t2  worker 1 publishes S's blocks                    index: S on worker 1

RecentDispatches remembers, for `ttl_s`, which worker each recently dispatched prompt's full
blocks went to (by the engine's chained block hash) and tops up the index's answer with them, as
GPU blocks. After `ttl_s` the index knows (or the blocks are gone) and is the only source again.
"""
from __future__ import annotations

from collections import deque

from services.protocol.kv_events import MatchResponse, WorkerMatch


class RecentDispatches:
    def __init__(self, ttl_s: float = 2.0, max_blocks: int = 200_000) -> None:
        self.ttl_s, self.max_blocks = ttl_s, max_blocks
        self._holders: dict[bytes, dict[str, float]] = {}   # block hash -> {worker id: dispatch time}
        self._order: deque[tuple[float, bytes, str]] = deque()

    def record(self, worker_id: str, block_hashes: list[bytes], now: float) -> None:
        for h in block_hashes:
            self._holders.setdefault(h, {})[worker_id] = now
            self._order.append((now, h, worker_id))
        self._expire(now)

    def forget_worker(self, worker_id: str) -> None:
        for holders in self._holders.values():
            holders.pop(worker_id, None)

    def held(self, block_hashes: list[bytes], now: float) -> dict[str, int]:
        """worker id -> leading blocks of this prompt it was recently sent (fresh entries only)."""
        self._expire(now)
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, h in enumerate(block_hashes, 1):
            holders = self._holders.get(h)
            here = set(holders) if holders else set()
            alive = here if alive is None else alive & here
            if not alive:
                break
            for w in alive:
                out[w] = depth
        return out

    def overlay(self, match: MatchResponse | None, block_hashes: list[bytes], block_size: int,
                now: float) -> MatchResponse | None:
        """The index's answer topped up with recent dispatches (unchanged when there are none)."""
        recent = self.held(block_hashes, now)
        if not recent:
            return match
        have = {w.worker_id: w for w in match.workers} if match is not None and match.available else {}
        for wid, n in recent.items():
            old = have.get(wid)
            if old is None:
                have[wid] = WorkerMatch(wid, n, n, n)
                continue
            total = max(n, old.matched_blocks)      # a shared-tier prefix past it still counts (at its credit)
            have[wid] = WorkerMatch(wid, total, max(n, old.gpu_blocks), max(n, old.gpu_cpu_blocks),
                                    old.shared_blocks if old.shared_blocks > total else 0)
        workers = sorted(have.values(), key=lambda w: (-w.any_blocks, w.worker_id))
        return MatchResponse(block_size=block_size, query_blocks=len(block_hashes), workers=workers)

    def _expire(self, now: float) -> None:
        order, holders = self._order, self._holders
        while order and (now - order[0][0] > self.ttl_s or len(order) > self.max_blocks):
            t, h, w = order.popleft()
            entry = holders.get(h)
            if entry is not None and entry.get(w) == t:
                del entry[w]
                if not entry:
                    del holders[h]

    def __len__(self) -> int:
        return len(self._holders)
