"""The whole service in-process: a worker's publisher registered in Redis, PrefixCacheService
following it, PrefixClient asking over gRPC; restart reloads from Redis; an expired lease purges;
a stopped index fails open."""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prefix_fakes import FakeBlockManager, planes

from gpu_worker.kv_events import KVEventPublisher
from services.prefix_client import PrefixClient
from prefix_cache_svc.config import PrefixCacheConfig
from prefix_cache_svc import main as prefix_main
from prefix_cache_svc.main import PrefixCacheService
from services.embedded_redis import EmbeddedRedis
from services.protocol.kv_events import SHARED_TIER, SHARED_TIER_INFO, cache_salt_for
from services.redis_client import RedisAuth
from services.registry import Registry
from services.security import bundle
from services.transport import grpc_channel

BS = 4
PROMPT = list(range(1, 21))  # 5 blocks
SALT = cache_salt_for("tenant-a", "")


@pytest.fixture(scope="module")
def redis_server():
    """Locked with the trust directory's password, which the in-process service (given the
    prefix-cache plane) authenticates with."""
    with EmbeddedRedis(password=auth().password) as server:
        yield server


def auth() -> RedisAuth:
    return RedisAuth.from_dir(planes().trust_dir)


def scheduler_trust() -> bundle.Trust:
    """Match answers the scheduler only (mutual TLS)."""
    return bundle.load(planes().trust_dir, "scheduler")


def config(url: str) -> PrefixCacheConfig:
    return PrefixCacheConfig(redis_url=url, port=0, metrics_port=-1, block_size=BS, lease_ms=1500,
                             heartbeat_ms=200, discovery_interval_s=0.1, snapshot_timeout_s=0.5,
                             consistency_check_s=0.5, store_check_s=0.1)


async def eventually(check, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def worker(redis_url: str, worker_id: str, info: dict | None = None, publisher: list | None = None):
    """A worker as the prefix index sees it: a registry lease naming its KV event addresses
    (`info`: more of its record; `publisher`: gets its KVEventPublisher)."""
    bm = FakeBlockManager(BS)
    pub = KVEventPublisher(bm, worker_id, plane=planes().worker, heartbeat_s=0.05)
    if publisher is not None:
        publisher.append(pub)
    reg = Registry(redis_url, auth())
    lease = await reg.register("worker", worker_id, lease_ms=600, info={"block_size": BS, **(info or {})},
                               addrs={"kv_events": pub.events_addr, "kv_snapshot": pub.snapshot_addr})
    pub.set_epoch(lease.epoch)
    alive = {"renew": True}

    async def loop():
        while True:
            pub.flush()
            if alive["renew"]:
                await lease.renew()
            await asyncio.sleep(0.01)
    task = asyncio.create_task(loop())
    try:
        yield bm, alive
    finally:
        task.cancel()
        await reg.close()
        pub.close()


async def test_service_end_to_end(redis_server):
    cfg = config(redis_server.url)
    svc = PrefixCacheService(cfg, planes().index)
    await svc.start()
    client = PrefixClient(svc.grpc_addr, scheduler_trust(), timeout_s=2.0)
    try:
        assert await client.connect(5.0)       # TCP + TLS ahead of the first Match
        async with worker(redis_server.url, "w1") as (bm, alive):
            bm.store_prompt(PROMPT, salt=SALT)

            async def w1_blocks():
                m = await client.match("m", PROMPT + [0, 0], tenant_salt="tenant-a")
                return m.blocks_for("w1") and m.blocks_for("w1").matched_blocks == 5 and m

            m = await eventually(w1_blocks)
            assert m.available and m.query_blocks == 5 and m.block_size == BS
            assert (await client.match("m", PROMPT)).workers == []       # another tenant: no hit
            await eventually(lambda: _owners(svc, bm))                    # written to Redis
            keys = [k async for k in svc.redis.scan_iter("kvmesh:pc:*")]    # Redis lost our records
            await svc.redis.delete(*keys)
            await eventually(lambda: _owners(svc, bm))                    # rewritten from memory
            async with grpc_channel(svc.grpc_addr, scheduler_trust(), "prefix-cache") as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

            await svc.stop()                                               # restart: reload from Redis
            svc = PrefixCacheService(cfg, planes().index)
            await svc.start()
            assert svc.core.index.num_blocks_of("w1") == 5
            client2 = PrefixClient(svc.grpc_addr, scheduler_trust(), timeout_s=2.0)
            assert (await client2.match("m", PROMPT, tenant_salt="tenant-a")).best_blocks == 5
            await eventually(lambda: _checked(svc))                        # periodic consistency check
            assert svc.core.stats.inconsistent == 0

            alive["renew"] = False                                         # the lease expires: purge
            await eventually(lambda: _purged(svc, client2))

            async def forgotten_in_redis():      # the purge reaches Redis at the writer's next tick
                return await svc.store.known_workers() == set()
            await eventually(forgotten_in_redis)
            await client2.close()
        svc.core.index.check_integrity()
    finally:
        await svc.stop()
        await client.close()
    t0 = time.monotonic()                                                  # index down: fail open
    down = PrefixClient(svc.grpc_addr, scheduler_trust(), timeout_s=0.2, cooldown_s=5.0)
    assert not (await down.match("m", PROMPT)).available
    assert not (await down.match("m", PROMPT)).available                  # breaker open: instant
    assert time.monotonic() - t0 < 1.5 and down.failures == 1
    await down.close()


async def _owners(svc, bm):
    first = bm.cached_block_hashes()[0][0]
    return await svc.store.owners(first) == {("w1", "gpu")}


async def _checked(svc):
    return svc.core.stats.checks >= 1


async def _purged(svc, client):
    return not svc.core.index.workers() and (await client.match("m", PROMPT, tenant_salt="tenant-a")).workers == []


async def test_client_breaker_retries_after_cooldown():
    from services.ports import free_port

    client = PrefixClient(f"127.0.0.1:{free_port()}", scheduler_trust(), timeout_s=0.1, cooldown_s=0.05)
    assert not await client.connect(0.2)                                              # nobody listens
    assert not (await client.match("m", PROMPT)).available
    assert not (await client.match("m", PROMPT)).available and client.failures == 1   # breaker open
    await asyncio.sleep(0.06)
    assert not (await client.match("m", PROMPT)).available and client.failures == 2   # tried again
    await client.close()


async def test_a_redis_restart_keeps_the_index_while_workers_register_again(redis_server):
    """Redis lost its data (a restart without persistence): the index keeps each worker's blocks
    for a lease while the worker writes its record back, instead of purging it as dead; a worker
    that never comes back is purged once that lease has passed."""
    svc = PrefixCacheService(config(redis_server.url), planes().index)
    await svc.start()
    try:
        async with worker(redis_server.url, "w-keep") as (bm, alive):
            bm.store_prompt(PROMPT, salt=SALT)
            await eventually(lambda: _holds(svc, "w-keep"))
            alive["renew"] = False                     # slow to register again after the restart
            await svc.redis.flushall()
            deadline = time.monotonic() + 0.8          # 8 discovery rounds, within the 1.5 s lease
            while time.monotonic() < deadline:
                assert svc.core.index.num_blocks_of("w-keep") == 5
                await asyncio.sleep(0.05)
            alive["renew"] = True
            await eventually(lambda: _holds(svc, "w-keep"))
            await asyncio.sleep(0.3)
            assert svc.core.index.num_blocks_of("w-keep") == 5 and svc.registered.redis_restarts >= 1
            alive["renew"] = False                     # now it dies: purged after its lease
            await eventually(lambda: _gone(svc, "w-keep"), 5.0)
    finally:
        await svc.stop()


async def _holds(svc, worker_id: str) -> bool:
    return svc.core.index.num_blocks_of(worker_id) == 5 and worker_id in svc.workers


async def _gone(svc, worker_id: str) -> bool:
    return svc.core.index.num_blocks_of(worker_id) == 0


async def test_workers_announcing_a_shared_store_are_credited_with_its_blocks(redis_server, monkeypatch):
    """The store id travels in the registry record; the shared blocks one worker reports are
    matched for every worker announcing the id (over gRPC), outlive that worker, and a worker with
    another id gets nothing; a store no worker announces for SHARED_UNREAD_S is purged."""
    monkeypatch.setattr(prefix_main, "SHARED_UNREAD_S", 1.0)
    store, other = "5" * 32, "6" * 32
    cfg = config(redis_server.url)
    svc = PrefixCacheService(cfg, planes().index)
    await svc.start()
    client = PrefixClient(svc.grpc_addr, scheduler_trust(), timeout_s=2.0)
    pubs: list = []
    try:
        async with worker(redis_server.url, "w1", {SHARED_TIER_INFO: store}, pubs) as (bm1, alive1), \
                worker(redis_server.url, "w2", {SHARED_TIER_INFO: store}), \
                worker(redis_server.url, "w3", {SHARED_TIER_INFO: other}):
            await eventually(lambda: _following(svc, ("w1", "w2", "w3")))   # events from now on arrive
            written = FakeBlockManager(BS)                                 # w1 wrote these files
            written.store_prompt(PROMPT, salt=SALT)
            for h, parent, tokens in written.cached_block_hashes():
                pubs[0].on_stored(h, parent, tokens, SHARED_TIER)

            async def credited():
                m = await client.match("m", PROMPT + [0, 0], tenant_salt="tenant-a")
                return {w.worker_id: (w.matched_blocks, w.any_blocks) for w in m.workers}

            await eventually(lambda: _equals(credited, {"w1": (0, 5), "w2": (0, 5)}))
            alive1["renew"] = False                                        # w1 dies: the files stay
            await eventually(lambda: _equals(credited, {"w2": (0, 5)}))
            assert await svc.store.known_shared_tiers() == {store}
            await asyncio.sleep(1.2)                                       # read all along: kept
            assert svc.core.index.shared_tiers() == [store]
        await eventually(lambda: _store_purged(svc))                      # every reader gone, then the wait
        assert not [k async for k in svc.redis.scan_iter("kvmesh:pc:w:*")]
        svc.core.index.check_integrity()
    finally:
        await svc.stop()
        await client.close()


async def _equals(get, want):
    return await get() == want


async def _following(svc, workers):
    """Each worker's heartbeat has arrived and its stream is in sync; each one's store id is known."""
    return all(w in svc.core.streams and svc.core.streams[w].awaiting_since is None for w in workers) and \
        set(svc.core.readers) == set(workers)


async def _store_purged(svc):
    return not svc.core.index.shared_tiers() and not await svc.store.known_shared_tiers()
