"""KV event publishing: the block manager's cache changes -> one KVEventBatch per engine step.

    pub = KVEventPublisher(engine.block_manager, worker_id, epoch=lease.epoch, plane=plane, host=cfg.host)
    # advertise pub.events_addr and pub.snapshot_addr in the worker's registry record, then:
    while serving:
        engine.step()
        pub.flush()          # after every step, and every ~50 ms while idle (heartbeats, snapshots)

Wire (docs/kv_events.md): a PUB socket sends one msgpack KVEventBatch per frame, seq 0, 1, 2, ...
within the epoch; an idle publisher repeats its last seq with no events every `heartbeat_s`, so a
subscriber notices a lost last batch. A ROUTER socket answers SnapshotRequest with the block
manager's `cached_block_hashes()`, taken between steps (inside flush), so the Snapshot is exactly
the state after batch `seq`.

Only the prefix-cache role may subscribe or ask for snapshots (CURVE, services/security/curve.py):
both carry token ids, i.e. users' prompts and answers.

Threading: the listener callbacks and flush() must run on the thread that runs engine.step()
(ZMQ sockets and the block manager are single-threaded).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from services.protocol.kv_events import (
    KV_EVENTS_VERSION, AllCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch, Snapshot,
    SnapshotBlock, SnapshotRequest,
)
from services.config import reachable_host
from services.security.curve import Plane, with_role
from services.transport import Publisher, Replier

log = logging.getLogger("kvmesh.worker.kv_events")

_SNDHWM = 10_000          # batches queued per subscriber before PUB drops (the index then resyncs)
_MAX_SNAPSHOTS_PER_FLUSH = 4


class KVEventPublisher:
    """A block-manager listener that batches events per step and serves snapshots."""

    def __init__(self, block_manager, worker_id: str, epoch: int | None = None, *, plane: Plane,
                 host: str = "127.0.0.1", advertise_host: str = "", events_port: int = 0,
                 snapshot_port: int = 0, heartbeat_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.block_manager = block_manager
        self.worker_id = worker_id
        self.epoch = time.time_ns() // 1000 if epoch is None else epoch  # pass the registry lease's epoch
        self.seq = -1                       # last published batch
        self.heartbeat_s = heartbeat_s
        self._clock = clock
        self._pending: list[KVEvent] = []
        self._last_send = float("-inf")  # monotonic time of the last batch or heartbeat
        self._pub: Publisher[KVEventBatch] = Publisher(host, events_port, hwm=_SNDHWM, plane=plane,
                                                       subscribers=("prefix-cache",))
        self._replier: Replier[SnapshotRequest, Snapshot] = Replier(
            SnapshotRequest, host, snapshot_port, name="snapshot requests", plane=plane, clients=("prefix-cache",))
        reach = reachable_host(host, advertise_host)
        self.events_addr = with_role(f"tcp://{reach}:{self._pub.port}", "worker")
        self.snapshot_addr = with_role(f"tcp://{reach}:{self._replier.port}", "worker")
        self.published = 0
        self.snapshots_served = 0
        block_manager.add_listener(self)
        self._announce_held_blocks()

    def _announce_held_blocks(self) -> None:
        """The stream opens with the blocks the engine holds already (a disk tier restored at
        start-up), so the index routes their prefixes here without asking for a snapshot."""
        for h, parent, tokens in self.block_manager.cached_block_hashes():
            self.on_stored(h, parent, tokens)
        lower = getattr(self.block_manager, "lower_tier_block_hashes", None)
        if lower is not None:
            for h, parent, tokens, tier in lower():
                self.on_stored(h, parent, tokens, tier)

    def set_epoch(self, epoch: int) -> None:
        """Adopt the registry lease's epoch (known only after registering this publisher's
        addresses); the stream restarts at seq 0. Call before the first step."""
        self.epoch, self.seq = epoch, -1

    def begin_epoch(self, epoch: int) -> None:
        """A later incarnation of this worker that keeps its cache (its lease lapsed and it rejoined
        with `epoch`): the stream restarts in `epoch` as if batch 0 had been sent, so the index,
        which never sees a batch 0, finds a gap and replaces whatever it held for this worker with a
        snapshot (docs/kv_events.md). Events not yet published are covered by that snapshot."""
        self.epoch, self.seq = epoch, 0
        self._pending = []
        self._last_send = float("-inf")   # the next flush announces the new epoch at once

    # ---- block-manager listener ----------------------------------------------------------
    def on_stored(self, block_hash: bytes, parent: bytes | None, token_ids: list[int], tier: str = "gpu") -> None:
        self._pending.append(BlockStored(block_hash, parent, list(token_ids), tier))

    def on_removed(self, block_hash: bytes, tier: str = "gpu") -> None:
        self._pending.append(BlockRemoved(block_hash, tier))

    def on_missing(self, block_hash: bytes, tier: str) -> None:
        self._pending.append(BlockRemoved(block_hash, tier, missing=True))

    def on_cleared(self, tier: str | None = None) -> None:
        self._pending.append(AllCleared(tier))

    # ---- per step ------------------------------------------------------------------------
    def flush(self) -> int:
        """Publish this step's events as one batch (or a heartbeat when due), then answer snapshot
        requests. Returns the number of events published."""
        now = time.monotonic()
        sent = len(self._pending)
        if self._pending:
            self.seq += 1
            self._send(KVEventBatch(worker_id=self.worker_id, epoch=self.epoch, seq=self.seq,
                                    ts=self._clock(), events=self._pending), now)
            self._pending = []
        elif now - self._last_send >= self.heartbeat_s:
            self._send(KVEventBatch(worker_id=self.worker_id, epoch=self.epoch, seq=self.seq,
                                    ts=self._clock()), now)
        self.snapshots_served += self._replier.serve(self._answer, self._malformed, _MAX_SNAPSHOTS_PER_FLUSH)
        return sent

    def _send(self, batch: KVEventBatch, now: float) -> None:
        if self._pub.send(batch):
            self.published += 1
        else:  # a slow subscriber: it will see the gap and ask for a snapshot
            log.debug("KV event batch %d dropped (subscriber queue full)", batch.seq)
        self._last_send = now

    def _base(self) -> dict:
        return dict(worker_id=self.worker_id, epoch=self.epoch, seq=self.seq,
                    block_size=self.block_manager.block_size)

    def _malformed(self) -> Snapshot:
        return Snapshot(request_id="", error="malformed SnapshotRequest", **self._base())

    def _answer(self, req: SnapshotRequest) -> Snapshot:
        bm = self.block_manager
        base = self._base()
        if req.version != KV_EVENTS_VERSION:
            return Snapshot(request_id=req.request_id, error=f"unsupported version {req.version}", **base)
        blocks = [SnapshotBlock(h, parent, list(tokens)) for h, parent, tokens in bm.cached_block_hashes()]
        lower = getattr(bm, "lower_tier_block_hashes", None)     # an engine's host and disk KV tiers
        if lower is not None:
            blocks += [SnapshotBlock(h, parent, tokens, tier) for h, parent, tokens, tier in lower()]
        return Snapshot(request_id=req.request_id, blocks=blocks, **base)

    def close(self) -> None:
        try:
            self.block_manager.remove_listener(self)
        except (AttributeError, ValueError):
            pass
        self._pub.close()
        self._replier.close()
