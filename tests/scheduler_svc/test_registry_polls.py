"""The scheduler's shell polls the registry from two places (its membership loop, and a Submit that
finds no eligible worker): one poll at a time, so a read taken before a worker restarted is never
applied after a read taken since."""
from __future__ import annotations

import asyncio

from scheduler_svc.main import SchedulerService
from services.config import SchedulerConfig
from services.registry import ServiceRecord
from services.security.curve import Plane


def _record(epoch: int) -> ServiceRecord:
    return ServiceRecord(kind="worker", id="worker-0", epoch=epoch,
                         addrs={"zmq": f"tcp://127.0.0.1:{9000 + epoch}#worker"}, info={"role": "mixed"})


class _Registry:
    """Answers the first read (taken before the restart) late, and the second (after it) at once."""

    incarnation = b"one Redis"

    def __init__(self) -> None:
        self.reads = 0

    async def list(self, kind: str) -> list[ServiceRecord]:
        self.reads += 1
        if self.reads == 1:
            await asyncio.sleep(0.2)
            return [_record(1)]
        return [_record(2)]


async def test_a_stale_registry_read_never_overtakes_a_fresh_one():
    service = SchedulerService(SchedulerConfig(insecure_internal_planes=True), Plane.insecure())
    service.registry = _Registry()
    stale = asyncio.create_task(service._poll_workers())
    await asyncio.sleep(0.05)                   # the stale read is under way
    await service._poll_workers()               # a fresh one, taken after the restart
    await stale
    assert service.core.workers["worker-0"].epoch == 2
    service.senders.close()


class _Records:
    incarnation = b"one Redis"

    def __init__(self, records: list[ServiceRecord]) -> None:
        self.records = records

    async def list(self, kind: str) -> list[ServiceRecord]:
        return self.records


async def test_a_malformed_worker_record_is_ignored_not_fatal_to_the_poll():
    """A record whose fields have the wrong types (written by hand, or by another version) raised
    from view_of: every poll failed, so the scheduler stopped seeing workers come and go (no
    failover), and a Submit that polled when no worker was eligible ended the receive loop."""
    service = SchedulerService(SchedulerConfig(insecure_internal_planes=True), Plane.insecure())
    bad = [ServiceRecord(kind="worker", id=f"bad-{i}", epoch=1, addrs={"zmq": "tcp://127.0.0.1:9100#worker"},
                         info=info, load=load)
           for i, (info, load) in enumerate([({"max_num_seqs": "many"}, {}), ({}, {"running": [1]}),
                                             ({"block_size": None}, {})])]
    service.registry = _Records([_record(1), *bad])
    await service._poll_workers()
    assert set(service.core.workers) == {"worker-0"}
    service.senders.close()
