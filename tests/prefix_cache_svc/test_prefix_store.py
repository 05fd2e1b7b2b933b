"""OwnershipStore against a real Redis (embedded valkey): writes, reload, purge; integrity after each."""
from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from prefix_cache_svc.core import PrefixCore
from prefix_cache_svc.store import OwnershipStore, POSITIONS_KEY, WORKERS_KEY, worker_key
from services.embedded_redis import EmbeddedRedis
from services.protocol.kv_events import (
    AllCleared, BlockRemoved, BlockStored, KVEventBatch, MatchRequest, pack_token_ids,
)
from prefix_cache_svc.hashing import block_hash

BS = 4
MODEL = "m"
PROMPT = list(range(1, 17))


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
async def redis(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    yield client
    await client.aclose()


def stored(tokens=PROMPT, tier="gpu"):
    out, parent = [], None
    for i in range(0, len(tokens), BS):
        h = block_hash(parent, MODEL, "", tokens[i:i + BS])
        out.append(BlockStored(h, parent, tokens[i:i + BS], tier))
        parent = h
    return out


def batch(seq, events, worker="w1", epoch=1):
    return KVEventBatch(worker_id=worker, epoch=epoch, seq=seq, ts=0.0, events=events)


def matched(core):
    resp = core.match(MatchRequest(model_id=MODEL, tokens=pack_token_ids(PROMPT)))
    return {m.worker_id: (m.matched_blocks, m.gpu_blocks) for m in resp.workers}


async def feed(core, store, *batches):
    for b in batches:
        core.on_batch(b, 0.0)
    await store.apply(core.drain_changes())


async def test_events_are_written_and_reloaded(redis):
    core, store = PrefixCore(BS), OwnershipStore(redis, BS)
    await store.load(core)
    ev = stored()
    await feed(core, store, batch(0, ev), batch(0, stored(tier="cpu")[:2], worker="w2"),
               batch(1, [BlockRemoved(ev[3].block_hash)]))
    assert await store.owners(ev[0].block_hash) == {("w1", "gpu"), ("w2", "cpu")}
    assert await store.owners(ev[3].block_hash) == set()
    assert await store.known_workers() == {"w1", "w2"}
    assert await redis.hget(POSITIONS_KEY, "w1") == b"1:1"

    again = PrefixCore(BS)
    assert await OwnershipStore(redis, BS).load(again) == 5
    assert matched(again) == matched(core) == {"w1": (3, 3), "w2": (2, 0)}
    assert again.streams["w1"].seq == 1 and again.streams["w2"].epoch == 1
    again.index.check_integrity()
    # the reloaded core resumes the stream without a snapshot
    from prefix_cache_svc.core import Outcome
    assert again.on_batch(batch(2, [BlockRemoved(ev[2].block_hash)]), 0) is Outcome.APPLIED
    again.index.check_integrity()


async def test_clear_tier_and_purge_worker(redis):
    core, store = PrefixCore(BS), OwnershipStore(redis, BS)
    ev = stored()
    await feed(core, store, batch(0, ev + stored(tier="cpu")), batch(0, ev[:1], worker="w2"))
    await feed(core, store, batch(1, [AllCleared("cpu")]))
    assert not await redis.exists(worker_key("w1", "cpu"))
    assert await store.owners(ev[0].block_hash) == {("w1", "gpu"), ("w2", "gpu")}
    assert core.remove_worker("w1") == 4
    await store.apply(core.drain_changes())
    assert await store.known_workers() == {"w2"}
    assert await store.owners(ev[0].block_hash) == {("w2", "gpu")}
    assert await store.owners(ev[1].block_hash) == set()
    assert not await redis.exists(worker_key("w1", "gpu"))
    assert await redis.hget(POSITIONS_KEY, "w1") is None
    reloaded = PrefixCore(BS)
    await OwnershipStore(redis, BS).load(reloaded)
    assert matched(reloaded) == {"w2": (1, 1)}
    reloaded.index.check_integrity()
    core.index.check_integrity()


async def test_new_epoch_purges_old_records(redis):
    core, store = PrefixCore(BS), OwnershipStore(redis, BS)
    ev = stored()
    await feed(core, store, batch(0, ev))
    await feed(core, store, batch(0, ev[:1], epoch=2))
    assert await redis.hlen(worker_key("w1", "gpu")) == 1
    assert await redis.smembers(WORKERS_KEY) == {b"w1"}
    core.index.check_integrity()


async def test_reload_with_another_block_size_ignores_records(redis):
    core, store = PrefixCore(BS), OwnershipStore(redis, BS)
    await store.load(core)
    await feed(core, store, batch(0, stored()))
    other = PrefixCore(8)
    assert await OwnershipStore(redis, 8).load(other) == 0
    assert len(other.index) == 0
    other.index.check_integrity()


async def test_rewrite_after_redis_lost_the_records(redis):
    core, store = PrefixCore(BS), OwnershipStore(redis, BS)
    await store.load(core)
    await feed(core, store, batch(0, stored()), batch(0, stored(tier="cpu")[:2], worker="w2"))
    assert not await store.lost_records()
    await redis.flushdb()                                # Redis restarted without persistence
    assert await store.lost_records()
    assert await store.rewrite(core) == 6
    await feed(core, store, batch(1, [BlockRemoved(stored()[3].block_hash)]))  # writes continue
    again = PrefixCore(BS)
    assert await OwnershipStore(redis, BS).load(again) == 5
    assert matched(again) == matched(core) == {"w1": (3, 3), "w2": (2, 0)}
    assert again.streams["w1"].seq == 1
    again.index.check_integrity()
