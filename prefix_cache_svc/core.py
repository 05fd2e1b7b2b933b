"""The prefix-cache service's pure core: event batches and snapshots in, index + ownership changes out.

No sockets, no Redis, no clock: the shell (main.py) feeds messages and the time, sends the
snapshot requests the core asks for, and writes `drain_changes()` to Redis (store.py).

Per-worker stream rules (docs/kv_events.md):

    batch (epoch E, seq S) vs stream (epoch e, last applied s):
      E < e                      stale incarnation          -> drop
      E > e, or worker unknown   restart / first sight      -> forget the worker; S == 0 (or a
                                                               heartbeat at -1) starts it, else gap
      S <= s                     duplicate or heartbeat     -> drop (a heartbeat with S > s: gap)
      S == s + 1                 in order                   -> apply
      S >  s + 1                 gap                        -> buffer, ask for a snapshot
    snapshot (E, S):  replace the worker's blocks with it, then apply buffered batches > S.

Shared tier: an event with tier "shared" is about the node's shared KV directory, not the sending
worker: it is applied, in stream order, to the shared-tier id the worker announces (set_readers,
from its registry record), and outlives the worker. A worker's restart, snapshot or removal never
touches shared blocks; a removal from any worker of that id drops the block. A gap can lose such
a removal, so a worker also reports a lookup that found no file (`BlockRemoved.missing`): it drops
the block where the index credits it, and is dropped (no Redis write) where it does not.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from prefix_cache_svc.radix_index import TIER_BIT, RadixIndex, pack_tokens
from services.protocol.kv_events import (
    KV_EVENTS_VERSION, SHARED_TIER, TIERS, AllCleared, BlockRemoved, BlockStored, KVEventBatch, MatchRequest,
    MatchResponse, Snapshot, cache_salt_for,
)

MAX_PENDING = 4096  # batches buffered per worker while its snapshot is awaited


# ---- ownership changes, written to Redis by the shell (store.py) in order -----------------
class Own(NamedTuple):
    worker_id: str       # with tier "shared": the shared-tier id
    block_hash: bytes
    parent_hash: bytes | None
    tokens: bytes  # packed uint32
    tier: str


class Disown(NamedTuple):
    worker_id: str       # with tier "shared": the shared-tier id
    block_hash: bytes
    tier: str


class ClearTier(NamedTuple):
    worker_id: str
    tier: str | None  # None: every tier


class ForgetWorker(NamedTuple):
    worker_id: str


class ForgetShared(NamedTuple):
    shared_id: str


class Position(NamedTuple):
    worker_id: str
    epoch: int
    seq: int


Change = Own | Disown | ClearTier | ForgetWorker | ForgetShared | Position


class Outcome(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"          # already applied, or a heartbeat in sync
    STALE = "stale"                  # from an older epoch
    NEED_SNAPSHOT = "need_snapshot"  # gap or unknown position: the shell must request a snapshot
    BUFFERED = "buffered"            # held until the awaited snapshot arrives
    REJECTED = "rejected"            # wrong protocol version or block size


class ConsistencyReport(NamedTuple):
    worker_id: str
    seq: int
    missing: int   # held by the worker, absent from the index
    extra: int     # in the index, not held by the worker

    @property
    def consistent(self) -> bool:
        return self.missing == 0 and self.extra == 0


@dataclass
class WorkerStream:
    epoch: int
    seq: int                       # last applied; -1: nothing yet in this epoch
    awaiting_since: float | None = None   # when a snapshot was asked for (None: in sync)
    pending: list[KVEventBatch] = field(default_factory=list)
    check: Snapshot | None = None  # a consistency snapshot ahead of `seq`, compared on arrival


@dataclass
class CoreStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    new_epochs: int = 0
    snapshots_applied: int = 0
    rejected: int = 0
    shared_unannounced: int = 0    # shared-tier events from a worker that announces no shared tier
    shared_missing: int = 0        # lookups that found no shared file, reported by a worker
    shared_repaired: int = 0       # of those, blocks the index still credited (now dropped)
    checks: int = 0
    inconsistent: int = 0
    queries: int = 0
    query_blocks: int = 0
    best_matched_blocks: int = 0
    worker_matched_blocks: dict[str, int] = field(default_factory=dict)  # hit rate: / query_blocks


class PrefixCore:
    def __init__(self, block_size: int, max_blocks: int | None = None) -> None:
        self.index = RadixIndex(block_size, max_blocks)
        self.streams: dict[str, WorkerStream] = {}
        self.stats = CoreStats()
        self.last_report: ConsistencyReport | None = None
        self.readers: dict[str, str] = {}     # live worker -> the shared-tier id it announces
        self._changes: list[Change] = []

    @property
    def block_size(self) -> int:
        return self.index.block_size

    def set_readers(self, readers: dict[str, str]) -> None:
        """The live workers that read a shared tier, by id (from the registry, every discovery)."""
        self.readers = dict(readers)
        self.index.set_readers(self.readers)

    def drain_changes(self) -> list[Change]:
        out, self._changes = self._changes, []
        return out

    # ---- event batches -----------------------------------------------------------------
    def on_batch(self, batch: KVEventBatch, now: float) -> Outcome:
        if batch.version != KV_EVENTS_VERSION:
            self.stats.rejected += 1
            return Outcome.REJECTED
        stream = self.streams.get(batch.worker_id)
        if stream is not None and batch.epoch < stream.epoch:
            return Outcome.STALE
        if stream is None or batch.epoch > stream.epoch:
            stream = self._restart(batch.worker_id, batch.epoch, known=stream is not None)
            if batch.seq == -1 and not batch.events:  # a heartbeat before the first batch
                return Outcome.DUPLICATE
            if batch.seq == 0 and batch.events:       # the incarnation's first batch
                return self._apply_in_order(stream, batch)
            return self._gap(stream, batch, now)
        if stream.awaiting_since is not None:
            return self._buffer(stream, batch)
        if batch.seq <= stream.seq:
            return Outcome.DUPLICATE
        if batch.seq == stream.seq + 1 and batch.events:
            return self._apply_in_order(stream, batch)
        return self._gap(stream, batch, now)

    def _restart(self, worker_id: str, epoch: int, known: bool) -> WorkerStream:
        """First sight of this incarnation: whatever the index held for the worker is void."""
        if known:
            self.stats.new_epochs += 1
        self._forget_blocks(worker_id)
        stream = self.streams[worker_id] = WorkerStream(epoch=epoch, seq=-1)
        return stream

    def _apply_in_order(self, stream: WorkerStream, batch: KVEventBatch) -> Outcome:
        for event in batch.events:
            self._apply_event(batch.worker_id, event)
        stream.seq = max(stream.seq, batch.seq)
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self._changes.append(Position(batch.worker_id, stream.epoch, stream.seq))
        self._maybe_check(batch.worker_id, stream)
        return Outcome.APPLIED

    def _apply_event(self, worker_id: str, event) -> None:
        if isinstance(event, (BlockStored, BlockRemoved)) and event.tier == SHARED_TIER:
            owner = self.readers.get(worker_id)
            if owner is None:     # its record names no shared tier: nobody to credit
                self.stats.shared_unannounced += 1
                return
            worker_id = owner
        if isinstance(event, BlockStored):
            try:
                tokens = pack_tokens(event.token_ids)
            except OverflowError:  # a token id outside uint32: not a block of any model we serve
                self.stats.rejected += 1
                return
            if self.index.insert(worker_id, event.block_hash, event.parent_hash, tokens, event.tier):
                self._changes.append(Own(worker_id, event.block_hash, event.parent_hash, tokens, event.tier))
        elif isinstance(event, BlockRemoved) and event.missing:
            self._apply_missing(worker_id, event)
        elif isinstance(event, BlockRemoved):
            self.index.remove(worker_id, event.block_hash, event.tier)
            # Redis is told even when the index had no copy (it may have been evicted from memory only).
            self._changes.append(Disown(worker_id, event.block_hash, event.tier))
        elif isinstance(event, AllCleared) and event.tier != SHARED_TIER:
            # (one worker cannot speak for the shared directory: its files are everyone's)
            self.index.clear(worker_id, event.tier)
            self._changes.append(ClearTier(worker_id, event.tier))

    def _apply_missing(self, owner: str, event: BlockRemoved) -> None:
        """A lookup that found no file: most are blocks never stored (a prompt's first new block),
        so Redis hears only of a credit dropped. (A copy evicted from memory alone keeps its Redis
        record: a restarted index reloads it, and the next miss drops it.)"""
        if event.tier != SHARED_TIER:     # a worker's own tiers change by its removals alone
            return
        self.stats.shared_missing += 1
        if self.index.remove(owner, event.block_hash, SHARED_TIER):
            self.stats.shared_repaired += 1
            self._changes.append(Disown(owner, event.block_hash, SHARED_TIER))

    def _gap(self, stream: WorkerStream, batch: KVEventBatch, now: float) -> Outcome:
        self.stats.gaps += 1
        stream.awaiting_since = now
        self._buffer(stream, batch)
        return Outcome.NEED_SNAPSHOT

    def _buffer(self, stream: WorkerStream, batch: KVEventBatch) -> Outcome:
        if batch.events:
            if len(stream.pending) >= MAX_PENDING:
                stream.pending.pop(0)  # a hole this leaves is found at replay: asks again
            stream.pending.append(batch)
        return Outcome.BUFFERED

    # ---- snapshots ---------------------------------------------------------------------
    def snapshot_overdue(self, now: float, timeout_s: float) -> list[str]:
        """Workers whose requested snapshot has not arrived within timeout_s (ask again)."""
        return [w for w, s in self.streams.items()
                if s.awaiting_since is not None and now - s.awaiting_since >= timeout_s]

    def mark_requested(self, worker_id: str, now: float) -> None:
        stream = self.streams.get(worker_id)
        if stream is not None and stream.awaiting_since is not None:
            stream.awaiting_since = now

    def on_snapshot(self, snap: Snapshot) -> Outcome:
        """A snapshot asked for after a gap: replace the worker's blocks, then catch up."""
        if snap.error or snap.version != KV_EVENTS_VERSION or snap.block_size != self.block_size:
            self.stats.rejected += 1
            return Outcome.REJECTED
        stream = self.streams.get(snap.worker_id)
        if stream is not None and snap.epoch < stream.epoch:
            return Outcome.STALE
        if stream is None or snap.epoch > stream.epoch:
            stream = self._restart(snap.worker_id, snap.epoch, known=stream is not None)
        elif stream.awaiting_since is None:
            return self._on_check_snapshot(stream, snap)
        elif snap.seq < stream.seq:
            return Outcome.STALE  # older than what is applied: keep waiting for a newer one
        self._replace_blocks(snap)
        pending = sorted((b for b in stream.pending if b.seq > snap.seq), key=lambda b: b.seq)
        stream.seq, stream.awaiting_since, stream.pending, stream.check = snap.seq, None, [], None
        self.stats.snapshots_applied += 1
        self._changes.append(Position(snap.worker_id, stream.epoch, stream.seq))
        for batch in pending:  # may reveal another gap: then the worker is asked again
            if batch.seq == stream.seq + 1:
                self._apply_in_order(stream, batch)
            else:
                stream.awaiting_since, stream.pending = 0.0, [b for b in pending if b.seq > stream.seq]
                self.stats.gaps += 1
                return Outcome.NEED_SNAPSHOT
        return Outcome.APPLIED

    def _replace_blocks(self, snap: Snapshot) -> tuple[int, int]:
        """Make the index's copy of the worker equal the snapshot; returns (added, removed) copies."""
        want = _own_tiers(snap)
        have = self.index.blocks_of(snap.worker_id)
        removed = 0
        for h, tiers in have.items():
            for tier in TIERS:
                if tiers & TIER_BIT[tier] and not want.get(h, 0) & TIER_BIT[tier]:
                    self.index.remove(snap.worker_id, h, tier)
                    self._changes.append(Disown(snap.worker_id, h, tier))
                    removed += 1
        added = 0
        for blk in snap.blocks:
            if blk.tier != SHARED_TIER and not have.get(blk.block_hash, 0) & TIER_BIT[blk.tier]:
                self._apply_event(snap.worker_id, BlockStored(blk.block_hash, blk.parent_hash,
                                                               blk.token_ids, blk.tier))
                added += 1
        return added, removed

    # ---- consistency checks ------------------------------------------------------------
    def _on_check_snapshot(self, stream: WorkerStream, snap: Snapshot) -> Outcome:
        """A periodic check's snapshot: compare when the stream reaches its seq, repair if needed."""
        if snap.seq < stream.seq:
            return Outcome.STALE  # the index has moved past it: inconclusive, try next time
        stream.check = snap
        self._maybe_check(snap.worker_id, stream)
        return Outcome.APPLIED

    def _maybe_check(self, worker_id: str, stream: WorkerStream) -> None:
        snap = stream.check
        if snap is None or snap.seq > stream.seq:
            return
        stream.check = None
        if snap.seq < stream.seq:
            return
        report = self.compare(snap)
        self.stats.checks += 1
        self.last_report = report
        if not report.consistent:
            self.stats.inconsistent += 1
            self._replace_blocks(snap)

    def compare(self, snap: Snapshot) -> ConsistencyReport:
        """Differences between a worker's snapshot and the index's view of that worker."""
        want = _own_tiers(snap)
        have = self.index.blocks_of(snap.worker_id)
        missing = sum(bin(t & ~have.get(h, 0)).count("1") for h, t in want.items())
        extra = sum(bin(t & ~want.get(h, 0)).count("1") for h, t in have.items())
        return ConsistencyReport(snap.worker_id, snap.seq, missing, extra)

    # ---- workers leaving ---------------------------------------------------------------
    def remove_worker(self, worker_id: str) -> int:
        """The worker's lease expired: forget its stream and every block it held."""
        self.streams.pop(worker_id, None)
        return self._forget_blocks(worker_id)

    def _forget_blocks(self, worker_id: str) -> int:
        held = self.index.remove_worker(worker_id)
        self._changes.append(ForgetWorker(worker_id))
        return held

    def remove_shared_tier(self, shared_id: str) -> int:
        """No live worker has announced the store for a long time (its node is gone): forget its blocks."""
        held = self.index.remove_shared_tier(shared_id)
        self._changes.append(ForgetShared(shared_id))
        return held

    def restore_position(self, worker_id: str, epoch: int, seq: int) -> None:
        """After a reload from Redis: resume the worker's stream where the store left it."""
        self.streams[worker_id] = WorkerStream(epoch=epoch, seq=seq)

    # ---- queries -----------------------------------------------------------------------
    def match(self, req: MatchRequest) -> MatchResponse:
        if req.block_hashes is not None:
            result = self.index.match_hashes(req.block_hashes, req.tokens)
        else:
            result = self.index.match_tokens(req.tokens, req.model_id,
                                             cache_salt_for(req.tenant_salt, req.cache_salt))
        self._count(result.query_blocks, result.workers)
        return MatchResponse(block_size=self.block_size, query_blocks=result.query_blocks,
                             workers=result.workers)

    def _count(self, query_blocks: int, workers) -> None:
        s = self.stats
        s.queries += 1
        s.query_blocks += query_blocks
        s.best_matched_blocks += workers[0].any_blocks if workers else 0
        for m in workers:
            s.worker_matched_blocks[m.worker_id] = s.worker_matched_blocks.get(m.worker_id, 0) + m.any_blocks


def _own_tiers(snap: Snapshot) -> dict[bytes, int]:
    """The worker's own tiers per block in a snapshot (a shared-tier block is nobody's own)."""
    want: dict[bytes, int] = {}
    for blk in snap.blocks:
        if blk.tier != SHARED_TIER:
            want[blk.block_hash] = want.get(blk.block_hash, 0) | TIER_BIT[blk.tier]
    return want
