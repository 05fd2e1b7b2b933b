"""Service registry in Redis: leases with heartbeat renewal and epoch fencing (keys: redis_schema).

    reg = Registry(redis_url, RedisAuth.of(trust))   # authenticates as redis_client.connect says
    lease = await reg.register("worker", worker_id, addrs={"zmq": ...}, info={...})  # takes an epoch
    await lease.renew(load={...})      # every heartbeat; False: a newer incarnation fenced us out
    lease.held()                       # True until lease_ms after the start of the last renewal
    await reg.list("worker")           # live records (expired ones pruned)
    await lease.release()              # clean shutdown: the record disappears at once

A renewal that finds the record expired (the process was paused or starved past its lease, or
cut off from Redis) does not bring the old epoch back: readers may have declared it dead and
failed its work. The lease takes the next epoch instead (`lease.epoch` changes) and the process
is a new incarnation; a worker drops every request of the old epoch (gpu_worker/service/main.py).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis

from services import redis_client
from services import redis_schema as keys
from services.redis_client import RedisAuth

log = logging.getLogger("kvmesh.registry")


class ServiceRecord(msgspec.Struct, kw_only=True):
    kind: str
    id: str
    epoch: int
    addrs: dict[str, str] = {}       # e.g. zmq: tcp://10.0.0.5:5559, grpc: 10.0.0.5:50053, metrics: ...
    info: dict[str, Any] = {}        # static: model name, max_model_len, role, max_num_seqs, ...
    load: dict[str, Any] = {}        # dynamic: running, waiting, free_blocks, total_blocks, ...
    ts: float = 0.0                  # wall clock of the last renewal


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(ServiceRecord)


class Lease:
    def __init__(self, reg: "Registry", record: ServiceRecord, lease_ms: int) -> None:
        self._reg, self.record, self.lease_ms = reg, record, lease_ms
        self.fenced = False
        self.rejoins = 0                          # times the record had expired and a new epoch was taken
        self.valid_until = float("-inf")          # time.monotonic(): the record certainly lives until then
        # one renewal at a time: two that both found the record expired would both rejoin, and
        # the second, a step behind the counter, would fence this very process
        self._renewing = asyncio.Lock()

    @property
    def epoch(self) -> int:
        return self.record.epoch

    def held(self) -> bool:
        """Whether the record is certainly still in Redis: the last renewal started less than
        lease_ms ago (its PX counts from later than that). Safe from any thread."""
        return time.monotonic() < self.valid_until

    async def renew(self, load: dict[str, Any] | None = None) -> bool:
        """Renew the lease, or rejoin with the next epoch when the record had expired.
        False: fenced, a newer incarnation owns this id; stop serving."""
        if load is not None:
            self.record.load = load
        async with self._renewing:
            started = time.monotonic()
            status = await self._run(self._reg.renew_script, self.record)
            if status == keys.LAPSED:
                status = await self._rejoin()
            if status == keys.RENEWED:
                self.valid_until = started + self.lease_ms / 1000
                return True
        if not self.fenced:
            self.fenced = True
            r = self.record
            log.error("%s %s epoch %d was replaced by a newer incarnation; stop serving", r.kind, r.id, r.epoch)
        return False

    async def claim(self) -> bool:
        """Write the record of a freshly taken epoch (registration)."""
        started = time.monotonic()
        if await self._run(self._reg.claim_script, self.record) != keys.RENEWED:
            return False
        self.valid_until = started + self.lease_ms / 1000
        return True

    async def _rejoin(self) -> bytes:
        old = self.record
        new = msgspec.structs.replace(old, epoch=old.epoch + 1)
        status = await self._run(self._reg.rejoin_script, new, old.epoch)
        if status == keys.RENEWED:
            self.record = new
            self.rejoins += 1
            log.warning("%s %s: the lease of epoch %d lapsed (its record expired); rejoined as epoch %d",
                        old.kind, old.id, old.epoch, new.epoch)
        return status

    async def _run(self, script: Any, record: ServiceRecord, epoch: int | None = None) -> bytes:
        record.ts = time.time()
        return await script(
            keys=[keys.record_key(record.kind, record.id), keys.epoch_key(record.kind, record.id),
                  keys.index_key(record.kind), keys.INCARNATION_KEY],
            # a fresh value each time: only the first write after Redis lost its data sticks (NX)
            args=[str(record.epoch if epoch is None else epoch), _enc.encode(record), self.lease_ms, record.id,
                  secrets.token_hex(8)])

    async def release(self) -> None:
        r = self.record
        try:
            await self._reg.release_script(keys=[keys.record_key(r.kind, r.id), keys.epoch_key(r.kind, r.id)],
                                           args=[str(r.epoch)])
        except Exception as exc:  # shutting down: Redis may already be gone
            log.debug("lease release failed: %s", exc)


class Registry:
    def __init__(self, url: str, auth: RedisAuth | None) -> None:
        if not url:
            raise ValueError("a Redis URL is required (--redis-url / KVMESH_REDIS_URL)")
        self.redis = redis_client.connect(url, auth)
        self.incarnation: bytes | None = None      # the incarnation the last list() read (None: unset)
        self.claim_script = self.redis.register_script(keys.CLAIM_LUA)
        self.renew_script = self.redis.register_script(keys.RENEW_LUA)
        self.rejoin_script = self.redis.register_script(keys.REJOIN_LUA)
        self.release_script = self.redis.register_script(keys.RELEASE_LUA)

    async def register(self, kind: str, id_: str, *, addrs: dict[str, str], info: dict[str, Any],
                       lease_ms: int, load: dict[str, Any] | None = None, wait_s: float = 120.0) -> Lease:
        """Take a new epoch and the lease. Waits up to wait_s for Redis (pods start in any order)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                epoch = int(await self.redis.incr(keys.epoch_key(kind, id_)))
                break
            except (ConnectionError, OSError, aioredis.ConnectionError, aioredis.TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("Redis not reachable yet (%s); retrying", exc)
                await asyncio.sleep(1.0)
        lease = Lease(self, ServiceRecord(kind=kind, id=id_, epoch=epoch, addrs=addrs, info=info,
                                          load=load or {}), lease_ms)
        if not await lease.claim():
            raise RuntimeError(f"{kind} {id_}: lost the epoch race at registration")
        return lease

    async def list(self, kind: str) -> list[ServiceRecord]:
        """Live records of `kind`; also reads the Redis incarnation (`self.incarnation`)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(keys.index_key(kind))
        pipe.get(keys.INCARNATION_KEY)
        members, self.incarnation = await pipe.execute()
        ids, unreadable = [], []
        for m in members:
            try:
                ids.append(m.decode())
            except UnicodeDecodeError:     # not an id any kvmesh process writes: it names no record
                unreadable.append(m)
        if unreadable:
            log.warning("dropping %d malformed %s index members", len(unreadable), kind)
            await self.redis.srem(keys.index_key(kind), *unreadable)
        ids.sort()
        if not ids:
            return []
        values = await self.redis.mget([keys.record_key(kind, i) for i in ids])
        out, gone = [], []
        for id_, raw in zip(ids, values):
            if raw is None:
                gone.append(id_)
                continue
            try:
                out.append(_dec.decode(raw))
            except msgspec.DecodeError:
                log.warning("ignoring a malformed %s record %s", kind, id_)
        if gone:
            await self.redis.srem(keys.index_key(kind), *gone)
        return out

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except Exception:
            return False

    async def close(self) -> None:
        await self.redis.aclose()


def list_records(redis_url: str, kind: str, auth: RedisAuth | None) -> list[ServiceRecord]:
    """Registry.list for synchronous callers (benchmarks, tests): runs its own event loop, so not
    from inside a running one."""
    async def go() -> list[ServiceRecord]:
        reg = Registry(redis_url, auth)
        try:
            return await reg.list(kind)
        finally:
            await reg.close()
    return asyncio.run(go())


class Membership:
    """The live set of one kind, that survives a Redis restart.

        m = Membership(grace_s=2 * heartbeat_s, rejoin_s=lease_s)
        live = m.update(await registry.list(kind), time.monotonic(), registry.incarnation)

    A record missing from successful reads for less than `grace_s` is kept. Failed reads change
    nothing: the caller does not call update, and no time passes for a missing record (a lease
    cannot lapse while Redis itself is unreachable, since nobody can see it lapse). When the Redis
    incarnation changes (redis_schema: Redis lost its data, every record vanished at once, none
    expired), each missing record is kept for `rejoin_s` more: every live process writes its record
    back on its next heartbeat, and one that has not within a lease is dead. A record that comes
    back with a new epoch replaces the old one at once.
    """

    def __init__(self, grace_s: float, rejoin_s: float = 0.0) -> None:
        self.grace_s, self.rejoin_s = grace_s, rejoin_s
        self.records: dict[str, ServiceRecord] = {}
        self._missing_since: dict[str, float] = {}
        self._incarnation: bytes | None = None
        self._rejoin_until = float("-inf")       # Redis lost its data: no record is missed until then
        self.redis_restarts = 0                  # incarnation changes seen

    def update(self, fresh: list[ServiceRecord], now: float, incarnation: bytes | None = None) -> list[ServiceRecord]:
        if incarnation != self._incarnation:
            if self._incarnation is not None or self.records:   # not the first read: Redis lost its data
                self._rejoin_until = now + self.rejoin_s            # (the first writer's value extends it)
            if self._incarnation is not None:
                self.redis_restarts += 1
                log.warning("Redis lost its data (restart); waiting up to %.1f s for every process to register "
                            "again", self.rejoin_s)
            self._incarnation = incarnation
        seen = {r.id for r in fresh}
        for r in fresh:
            self.records[r.id] = r
            self._missing_since.pop(r.id, None)
        for id_ in [i for i in self.records if i not in seen]:
            since = self._missing_since.setdefault(id_, now)
            if now - since >= self.grace_s and now >= self._rejoin_until:
                del self.records[id_]
                del self._missing_since[id_]
        return list(self.records.values())
