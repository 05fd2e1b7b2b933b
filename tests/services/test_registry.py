"""Leases, heartbeats and epoch fencing against a real (embedded) Redis."""
from __future__ import annotations

import asyncio

import pytest

from services.embedded_redis import EmbeddedRedis
from services.registry import Registry


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as r:
        yield r.url


async def test_lease_expires_without_heartbeat(redis_url):
    reg = Registry(redis_url, None)
    try:
        lease = await reg.register("worker", "w-exp", addrs={"zmq": "tcp://x:1"}, info={"role": "mixed"}, lease_ms=300)
        assert [r.id for r in await reg.list("worker") if r.id == "w-exp"] == ["w-exp"]
        assert await lease.renew({"running": 3})
        rec = next(r for r in await reg.list("worker") if r.id == "w-exp")
        assert rec.load == {"running": 3} and rec.epoch == lease.epoch
        await asyncio.sleep(0.5)
        assert not [r for r in await reg.list("worker") if r.id == "w-exp"]
    finally:
        await reg.close()


async def test_newer_epoch_fences_the_old_incarnation(redis_url):
    reg = Registry(redis_url, None)
    try:
        old = await reg.register("worker", "w-f", addrs={}, info={}, lease_ms=5000)
        new = await reg.register("worker", "w-f", addrs={}, info={}, lease_ms=5000)
        assert new.epoch == old.epoch + 1
        assert not await old.renew() and old.fenced
        assert await new.renew()
        await old.release()                      # the old one cannot delete the new record
        assert [r.epoch for r in await reg.list("worker") if r.id == "w-f"] == [new.epoch]
        await new.release()
        assert not [r for r in await reg.list("worker") if r.id == "w-f"]
    finally:
        await reg.close()


def test_embedded_redis_starts_and_stops():
    r = EmbeddedRedis().start()
    assert r.ping() and r.alive()
    r.stop()
    assert not r.ping()


def test_membership_grace_and_epochs():
    from services.registry import Membership, ServiceRecord

    m = Membership(grace_s=1.0)
    a1, b1 = ServiceRecord(kind="worker", id="a", epoch=1), ServiceRecord(kind="worker", id="b", epoch=1)
    assert {r.id for r in m.update([a1, b1], 0.0)} == {"a", "b"}
    assert {r.id for r in m.update([a1], 0.5)} == {"a", "b"}      # b missing < grace: kept
    assert {r.id for r in m.update([a1], 1.6)} == {"a"}           # gone for good
    a2 = ServiceRecord(kind="worker", id="a", epoch=2)
    assert [r.epoch for r in m.update([a2], 1.7)] == [2]          # a restart replaces at once


async def test_a_lease_that_lapsed_rejoins_with_the_next_epoch(redis_url):
    """A process paused past its lease must not bring its old epoch back: readers may have failed
    its work. Its next renewal takes a new epoch; a newer start still fences it."""
    reg = Registry(redis_url, None)
    try:
        lease = await reg.register("worker", "w-lapse", addrs={}, info={"role": "mixed"}, lease_ms=300)
        first = lease.epoch
        assert lease.held()
        await asyncio.sleep(0.5)                       # "paused": no heartbeat past the lease
        assert not lease.held()
        assert not [r for r in await reg.list("worker") if r.id == "w-lapse"]
        assert await lease.renew({"running": 0})
        assert lease.epoch == first + 1 and lease.rejoins == 1 and lease.held() and not lease.fenced
        assert [r.epoch for r in await reg.list("worker") if r.id == "w-lapse"] == [first + 1]
        assert await lease.renew() and lease.epoch == first + 1    # an ordinary renewal keeps it

        newer = await reg.register("worker", "w-lapse", addrs={}, info={}, lease_ms=300)
        await asyncio.sleep(0.5)                       # both lapse: the newer start owns the counter
        assert not await lease.renew() and lease.fenced
        assert [r.epoch for r in await reg.list("worker") if r.id == "w-lapse"] == []
        assert await newer.renew() and newer.epoch == first + 3 and newer.rejoins == 1
    finally:
        await reg.close()


async def test_a_redis_restart_keeps_the_epoch(redis_url):
    """Redis lost every key (restart without persistence): the live process claims its epoch back
    rather than counting as a lapsed one."""
    reg = Registry(redis_url, None)
    try:
        lease = await reg.register("worker", "w-flush", addrs={}, info={}, lease_ms=5000)
        await reg.redis.flushall()
        assert await lease.renew() and lease.rejoins == 0
        assert [r.epoch for r in await reg.list("worker") if r.id == "w-flush"] == [lease.epoch]
    finally:
        await reg.close()


async def test_concurrent_renewals_of_a_lapsed_lease_rejoin_once(redis_url):
    """Two renewals at once (a worker's drain beside its heartbeat) that both find the record
    expired must take one new epoch, not fence the process with its own second rejoin."""
    reg = Registry(redis_url, None)
    try:
        lease = await reg.register("worker", "w-twice", addrs={}, info={}, lease_ms=300)
        first = lease.epoch
        await asyncio.sleep(0.5)
        assert await asyncio.gather(lease.renew(), lease.renew()) == [True, True]
        assert lease.epoch == first + 1 and lease.rejoins == 1 and not lease.fenced
    finally:
        await reg.close()


def test_membership_waits_a_lease_after_redis_lost_its_data():
    """Every record vanishing at once with a new Redis incarnation is a restart, not deaths: each
    gets `rejoin_s` to come back; without a change, the usual grace applies."""
    from services.registry import Membership, ServiceRecord

    m = Membership(grace_s=0.5, rejoin_s=3.0)
    a, b = ServiceRecord(kind="worker", id="a", epoch=1), ServiceRecord(kind="worker", id="b", epoch=1)
    assert len(m.update([a, b], 0.0, b"one")) == 2
    assert len(m.update([], 1.0, None)) == 2 and m.redis_restarts == 1     # restarted, nobody back yet
    assert len(m.update([a], 1.2, b"two")) == 2                             # a is back; b has until 4.2
    assert len(m.update([a], 3.9, b"two")) == 2
    assert [r.id for r in m.update([a], 4.3, b"two")] == ["a"]              # b never came back: dead
    assert m.redis_restarts == 1
    assert [r.id for r in m.update([], 5.0, b"two")] == ["a"]               # same incarnation: grace only
    assert m.update([], 5.6, b"two") == []


async def test_the_redis_incarnation_changes_when_redis_loses_its_data(redis_url):
    reg = Registry(redis_url, None)
    try:
        await reg.redis.flushall()
        lease = await reg.register("worker", "w-inc", addrs={}, info={}, lease_ms=5000)   # the first writer
        await reg.list("worker")
        before = reg.incarnation
        assert before is not None
        await reg.redis.flushall()                     # what a restart without persistence leaves
        assert await reg.list("worker") == [] and reg.incarnation is None
        assert await lease.renew()                     # the same process writes first again
        assert [r.id for r in await reg.list("worker")] == ["w-inc"] and reg.incarnation not in (None, before)
        after = reg.incarnation
        assert await lease.renew()
        await reg.list("worker")
        assert reg.incarnation == after                # later writes keep it
    finally:
        await reg.close()


async def test_malformed_index_members_and_records_are_skipped(redis_url):
    """What a local process with the password could leave in the discovery keys: an index member
    that is not UTF-8 (its decode raised, so every list() of the kind failed and each service lost
    all of its peers), a record of the wrong JSON shape. The live record is still listed, and the
    index forgets the member that names no record."""
    from services import redis_schema as keys
    reg = Registry(redis_url, None)
    try:
        lease = await reg.register("tokenizer", "t-ok", addrs={}, info={}, lease_ms=5000)
        await reg.redis.sadd(keys.index_key("tokenizer"), b"\xff\xfe", "t-bad")
        await reg.redis.set(keys.record_key("tokenizer", "t-bad"), b'{"kind": 1, "id": [], "epoch": "x"}')
        assert [r.id for r in await reg.list("tokenizer")] == ["t-ok"]
        assert b"\xff\xfe" not in await reg.redis.smembers(keys.index_key("tokenizer"))
        await lease.release()
    finally:
        await reg.close()
