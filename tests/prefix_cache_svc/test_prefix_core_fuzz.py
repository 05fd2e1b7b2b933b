"""PrefixCore against an unreliable channel: simulated workers publish batches that are dropped,
duplicated, delayed or reordered, restart with new epochs, and answer snapshots late. Once the
channel is drained and every requested snapshot answered, the index must equal every worker."""
from __future__ import annotations

import random

import pytest

from prefix_cache_svc.core import Outcome, PrefixCore
from prefix_cache_svc.hashing import block_hash
from services.protocol.kv_events import (
    AllCleared, BlockRemoved, BlockStored, KVEventBatch, Snapshot, SnapshotBlock,
)

BS = 2


class SimWorker:
    """The publisher's contract without sockets: one batch per step, seq per epoch, snapshots."""

    def __init__(self, worker_id: str, rng: random.Random) -> None:
        self.id, self.rng = worker_id, rng
        self.epoch, self.seq = 1, -1
        self.blocks: dict[bytes, tuple[bytes | None, list[int], str]] = {}

    def step(self) -> KVEventBatch | None:
        events = []
        for _ in range(self.rng.randrange(4)):
            r = self.rng.random()
            if r < 0.55 or not self.blocks:
                parent = self.rng.choice([None, *self.blocks]) if self.blocks else None
                tokens, tier = [self.rng.randrange(9) for _ in range(BS)], self.rng.choice(["gpu", "cpu"])
                h = block_hash(parent, "m", "", tokens)   # content-derived, like the engine's
                if h not in self.blocks:
                    self.blocks[h] = (parent, tokens, tier)
                    events.append(BlockStored(h, parent, tokens, tier))
            elif r < 0.97:
                h = self.rng.choice(list(self.blocks))
                events.append(BlockRemoved(h, self.blocks.pop(h)[2]))
            else:
                self.blocks.clear()
                events.append(AllCleared())
        if not events:
            return None
        self.seq += 1
        return KVEventBatch(worker_id=self.id, epoch=self.epoch, seq=self.seq, ts=0.0, events=events)

    def heartbeat(self) -> KVEventBatch:
        return KVEventBatch(worker_id=self.id, epoch=self.epoch, seq=self.seq, ts=0.0)

    def restart(self) -> None:
        self.epoch, self.seq = self.epoch + 1, -1
        self.blocks.clear()

    def snapshot(self) -> Snapshot:
        blocks = [SnapshotBlock(h, p, t, tier) for h, (p, t, tier) in self.blocks.items()]
        return Snapshot(request_id="r", worker_id=self.id, epoch=self.epoch, seq=self.seq,
                        block_size=BS, blocks=blocks)


@pytest.mark.parametrize("seed", range(6))
def test_core_converges_over_a_lossy_channel(seed):
    rng = random.Random(seed)
    core = PrefixCore(BS)
    workers = {w: SimWorker(w, rng) for w in ("a", "b", "c")}
    wire: list = []                     # messages in flight, delivered in (mostly) random order
    asked: set[str] = set()

    def deliver(msg) -> None:
        outcome = core.on_batch(msg, 0.0) if isinstance(msg, KVEventBatch) else core.on_snapshot(msg)
        if outcome is Outcome.NEED_SNAPSHOT:
            asked.add(msg.worker_id)

    for tick in range(600):
        for w in workers.values():
            if rng.random() < 0.01:
                w.restart()
            batch = w.step() or (w.heartbeat() if rng.random() < 0.1 else None)
            if batch is not None and rng.random() > 0.1:               # 10% dropped
                wire.append(batch)
                if rng.random() < 0.05:
                    wire.append(batch)                                  # duplicated
            if w.id in asked and rng.random() < 0.3:                    # answered, delivered later
                asked.discard(w.id)
                wire.append(w.snapshot())
            elif rng.random() < 0.01:
                wire.append(w.snapshot())                               # a periodic consistency check
        while wire and rng.random() < 0.7:
            i = 0 if rng.random() < 0.8 else rng.randrange(len(wire))  # mostly in order
            deliver(wire.pop(i))
        for worker_id in core.snapshot_overdue(float(tick), 0.0):       # lost answers: ask again
            asked.add(worker_id)
        if tick % 50 == 0:
            core.index.check_integrity()

    for _ in range(20):                                                 # quiesce: drain, heartbeat, resync
        while wire:
            deliver(wire.pop(0))
        for w in workers.values():
            deliver(w.heartbeat())
        asked |= {w for w, s in core.streams.items() if s.awaiting_since is not None}
        for worker_id in sorted(asked):
            deliver(workers[worker_id].snapshot())
        asked.clear()
        if all(s.awaiting_since is None for s in core.streams.values()):
            break
    for w in workers.values():
        report = core.compare(w.snapshot())
        assert report.consistent, report
        assert core.streams[w.id].epoch == w.epoch and core.streams[w.id].seq == w.seq
    core.index.check_integrity()
    assert core.stats.gaps > 0 and core.stats.snapshots_applied > 0
