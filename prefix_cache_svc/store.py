"""Redis, the store of record for block ownership; the in-memory index is rebuilt from it on restart.

Keys (prefix `kvmesh:pc:`; services/redis_schema.py points here):

    kvmesh:pc:block_size          STRING  tokens per block of every record below (a reload with
                                          another block size ignores the records)
    kvmesh:pc:workers             SET     worker ids that have ownership records
    kvmesh:pc:shared              SET     shared-tier ids that have ownership records (tier
                                          "shared": the id stands in for {worker} below)
    kvmesh:pc:pos                 HASH    worker id -> "epoch:seq" of the last applied KV event batch
    kvmesh:pc:w:{worker}:{tier}   HASH    worker -> blocks: block hash (16 raw bytes) ->
                                          parent hash (16 bytes, empty for a first block) + tokens
                                          (packed little-endian uint32), enough to rebuild the chain
    kvmesh:pc:b:{block hash hex}  SET     block -> owners: "{tier}:{worker}" members (Redis drops
                                          the key when the last owner leaves)

Every write is idempotent (HSET/HDEL/SADD/SREM), so replaying a batch, or two index replicas
applying the same events, leaves the same records. Writes of one event batch go out in one
pipeline. A worker whose registry lease expired is purged: its `w:` hashes are read, each block's
owner member removed, and the worker's keys deleted. A shared tier's records are not any worker's:
a worker's purge leaves them: removal events (a file dropped by some worker) delete them, and a
store no live worker announced for SHARED_UNREAD_S (prefix_cache_svc/main.py) is purged whole.
"""
from __future__ import annotations

import logging

import redis.asyncio as aioredis

from prefix_cache_svc.core import ClearTier, Disown, ForgetShared, ForgetWorker, Own, Position, PrefixCore
from prefix_cache_svc.radix_index import TIER_BIT
from services.protocol.kv_events import SHARED_TIER, TIERS

log = logging.getLogger("kvmesh.prefix_cache.store")

PREFIX = "kvmesh:pc:"
_SCAN_COUNT = 2000


def worker_key(worker_id: str, tier: str) -> str:
    return f"{PREFIX}w:{worker_id}:{tier}"


def block_key(block_hash: bytes) -> str:
    return f"{PREFIX}b:{block_hash.hex()}"


def owner_member(worker_id: str, tier: str) -> str:
    return f"{tier}:{worker_id}"


WORKERS_KEY = PREFIX + "workers"
SHARED_KEY = PREFIX + "shared"
POSITIONS_KEY = PREFIX + "pos"
BLOCK_SIZE_KEY = PREFIX + "block_size"


class OwnershipStore:
    def __init__(self, redis: aioredis.Redis, block_size: int) -> None:
        self.redis = redis
        self.block_size = block_size
        self._known: set[tuple[str, str]] = set()  # (WORKERS_KEY or SHARED_KEY, id) added (saves a SADD per block)
        self.writes = 0

    async def apply(self, changes: list) -> None:
        """Write the core's changes in order, pipelined (a purge reads the worker's keys first)."""
        if not changes:
            return
        pipe = self.redis.pipeline(transaction=False)
        for change in changes:
            if isinstance(change, Own):
                self._own(pipe, change)
            elif isinstance(change, Disown):
                pipe.hdel(worker_key(change.worker_id, change.tier), change.block_hash)
                pipe.srem(block_key(change.block_hash), owner_member(change.worker_id, change.tier))
            elif isinstance(change, Position):
                pipe.hset(POSITIONS_KEY, change.worker_id, f"{change.epoch}:{change.seq}")
            elif isinstance(change, (ClearTier, ForgetWorker)):
                await pipe.execute()
                tier = change.tier if isinstance(change, ClearTier) else None
                await self._clear(pipe, change.worker_id, tier)
                if isinstance(change, ForgetWorker):
                    pipe.srem(WORKERS_KEY, change.worker_id)
                    pipe.hdel(POSITIONS_KEY, change.worker_id)
                    self._known.discard((WORKERS_KEY, change.worker_id))
            elif isinstance(change, ForgetShared):
                await pipe.execute()
                await self._clear(pipe, change.shared_id, SHARED_TIER)
                pipe.srem(SHARED_KEY, change.shared_id)
                self._known.discard((SHARED_KEY, change.shared_id))
        self.writes += len(pipe)
        await pipe.execute()

    def _own(self, pipe, change: Own) -> None:
        owners_key = SHARED_KEY if change.tier == SHARED_TIER else WORKERS_KEY
        if (owners_key, change.worker_id) not in self._known:
            pipe.sadd(owners_key, change.worker_id)
            self._known.add((owners_key, change.worker_id))
        pipe.hset(worker_key(change.worker_id, change.tier), change.block_hash,
                  (change.parent_hash or b"") + change.tokens)
        pipe.sadd(block_key(change.block_hash), owner_member(change.worker_id, change.tier))

    async def _clear(self, pipe, worker_id: str, tier: str | None) -> None:
        for t in TIERS if tier is None else (tier,):
            key = worker_key(worker_id, t)
            member = owner_member(worker_id, t)
            async for block_hash, _ in self.redis.hscan_iter(key, count=_SCAN_COUNT):
                pipe.srem(block_key(block_hash), member)
                if len(pipe) >= _SCAN_COUNT:
                    await pipe.execute()
            pipe.delete(key)

    async def known_workers(self) -> set[str]:
        return {m.decode() for m in await self.redis.smembers(WORKERS_KEY)}

    async def known_shared_tiers(self) -> set[str]:
        return {m.decode() for m in await self.redis.smembers(SHARED_KEY)}

    async def owners(self, block_hash: bytes) -> set[tuple[str, str]]:
        """(worker, tier) pairs holding the block, per Redis (for tools and tests)."""
        out = set()
        for m in await self.redis.smembers(block_key(block_hash)):
            tier, _, worker = m.decode().partition(":")
            out.add((worker, tier))
        return out

    async def lost_records(self) -> bool:
        """True when Redis came back without our records (restarted empty, or flushed): the
        block-size marker written by load()/rewrite() is gone."""
        return not await self.redis.exists(BLOCK_SIZE_KEY)

    async def rewrite(self, core: PrefixCore) -> int:
        """Write every ownership the index holds, and every stream position (after lost_records()).

        Each worker's records are read from the index without awaiting; changes the core makes
        meanwhile are queued and written after this returns, so the end state is the index's."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(BLOCK_SIZE_KEY, self.block_size)
        self._known.clear()
        written = 0
        owners = [(w, None) for w in core.index.workers()] + [(s, SHARED_TIER) for s in core.index.shared_tiers()]
        for owner, tier in owners:
            for own in _owns_of(core, owner, tier):
                self._own(pipe, own)
                written += 1
                if len(pipe) >= _SCAN_COUNT:
                    await pipe.execute()
        for worker_id, stream in list(core.streams.items()):
            pipe.hset(POSITIONS_KEY, worker_id, f"{stream.epoch}:{stream.seq}")
        await pipe.execute()
        return written

    async def load(self, core: PrefixCore) -> int:
        """Rebuild the core's index and stream positions from Redis; returns blocks loaded."""
        stored_size = await self.redis.get(BLOCK_SIZE_KEY)
        if stored_size is not None and int(stored_size) != self.block_size:
            log.warning("Redis holds ownership records for block size %s, this index uses %d: "
                        "ignoring them (workers' snapshots will refill the index)",
                        stored_size.decode(), self.block_size)
            return 0
        await self.redis.set(BLOCK_SIZE_KEY, self.block_size)
        loaded = 0
        tok_bytes = 4 * self.block_size
        owners = [(WORKERS_KEY, w, TIERS) for w in sorted(await self.known_workers())]
        owners += [(SHARED_KEY, s, (SHARED_TIER,)) for s in sorted(await self.known_shared_tiers())]
        for owners_key, owner, tiers in owners:
            self._known.add((owners_key, owner))
            for tier in tiers:
                async for block_hash, value in self.redis.hscan_iter(worker_key(owner, tier), count=_SCAN_COUNT):
                    parent = value[:-tok_bytes] or None
                    loaded += core.index.insert(owner, block_hash, parent, value[-tok_bytes:], tier)
        for worker_id, pos in (await self.redis.hgetall(POSITIONS_KEY)).items():
            epoch, _, seq = pos.decode().partition(":")
            core.restore_position(worker_id.decode(), int(epoch), int(seq))
        core.drain_changes()  # loading wrote nothing new
        return loaded


def _owns_of(core: PrefixCore, owner: str, shared: str | None) -> list[Own]:
    """A worker's records (shared None), or a shared tier's (shared "shared")."""
    index, out = core.index, []
    for h, tiers in index.blocks_of(owner, shared or "gpu").items():
        parent, tokens = index.parent_and_tokens(h)
        out.extend(Own(owner, h, parent, tokens, tier) for tier in (*TIERS, SHARED_TIER) if tiers & TIER_BIT[tier])
    return out
