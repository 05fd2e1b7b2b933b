"""CURVE on the typed ZMQ carriers: a socket without keys gets nothing through and nothing out, a
valid key of the wrong role is refused per message kind, an impostor server gets no plaintext, and
a flood of bad frames costs one log line."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec
import pytest
import zmq

from services.config import SchedulerConfig
from services.protocol.kv_events import Snapshot, SnapshotRequest
from services.protocol.messages import Abort, SchedulerInbox, Submit, WorkerStatus
from services.protocol.sampling import SamplingParams
from services.security import bundle
from services.security.bundle import TrustError
from services.security.curve import Plane, plane_for, with_role
from services.transport import Publisher, Receiver, Replier, Sender, Subscriber, context, request, tcp_addr

SCHEDULER_SENDERS = {Submit: ("gateway",), Abort: ("gateway", "tokenizer"), WorkerStatus: ("worker",)}


@pytest.fixture(scope="module")
def trust(tmp_path_factory) -> Path:
    return bundle.generate(tmp_path_factory.mktemp("trust") / "trust").root


def plane(trust: Path, role: str) -> Plane:
    return Plane.load(str(trust), role)


def submit(rid: str) -> Submit:
    return Submit(request_id=rid, tenant="t", prompt_token_ids=[1], params=SamplingParams(), reply_addr="a",
                  detok_addr="b", priority=-1000)


async def nothing_within(rx: Receiver, seconds: float) -> bool:
    try:
        msg = await asyncio.wait_for(rx.recv(), seconds)
    except TimeoutError:
        return True
    raise AssertionError(f"received {msg!r}")


async def test_only_allowed_roles_get_their_message_kinds_through(trust):
    rx: Receiver = Receiver(SchedulerInbox, "127.0.0.1", 0, name="scheduler", plane=plane(trust, "scheduler"),
                            senders=SCHEDULER_SENDERS)
    addr = with_role(tcp_addr("127.0.0.1", rx.port), "scheduler")
    keyless = context().socket(zmq.PUSH)
    keyless.setsockopt(zmq.LINGER, 0)
    keyless.connect(tcp_addr("127.0.0.1", rx.port))
    gateway, worker, index = (Sender(addr, plane=plane(trust, r)) for r in ("gateway", "worker", "prefix-cache"))
    try:
        await keyless.send(msgspec.msgpack.encode(submit("keyless")))
        worker.send(submit("worker-key"))             # a valid key, but workers may not submit
        index.send(Abort(request_id="index-key"))     # a role the socket does not let in at all
        await asyncio.sleep(0.5)
        gateway.send(submit("gateway"))
        assert (await asyncio.wait_for(rx.recv(), 5)).request_id == "gateway"
        assert await nothing_within(rx, 0.5)
        assert rx.refused == 1                        # the worker's Submit; the others never got in
        assert rx.dropped == 0
    finally:
        keyless.close(0)
        for s in (gateway, worker, index):
            s.close()
        rx.close()


async def test_an_impostor_server_gets_no_plaintext(trust):
    """A record pointing the scheduler at a socket holding the gateway key, not the worker key:
    the handshake fails and nothing is delivered."""
    impostor: Receiver = Receiver(SchedulerInbox, "127.0.0.1", 0, name="impostor", plane=plane(trust, "gateway"),
                                  senders={Abort: ("scheduler",)})
    sender = Sender(with_role(tcp_addr("127.0.0.1", impostor.port), "worker"), plane=plane(trust, "scheduler"))
    try:
        sender.send(Abort(request_id="secret"))
        assert await nothing_within(impostor, 1.0)
    finally:
        sender.close()
        impostor.close()


async def test_kv_events_and_snapshots_reach_only_the_prefix_cache_role(trust):
    worker = plane(trust, "worker")
    pub: Publisher = Publisher("127.0.0.1", plane=worker, subscribers=("prefix-cache",))
    rep: Replier = Replier(SnapshotRequest, "127.0.0.1", plane=worker, clients=("prefix-cache",))
    events = with_role(tcp_addr("127.0.0.1", pub.port), "worker")
    snapshots = with_role(tcp_addr("127.0.0.1", rep.port), "worker")
    index: Subscriber = Subscriber(SchedulerInbox, plane=plane(trust, "prefix-cache"), server_role="worker")
    keyless: Subscriber = Subscriber(SchedulerInbox, plane=Plane.insecure(), server_role="")
    gateway: Subscriber = Subscriber(SchedulerInbox, plane=plane(trust, "gateway"), server_role="worker")
    for sub in (index, keyless, gateway):
        sub.connect(events)
    answer = lambda req: Snapshot(request_id=req.request_id, worker_id="w", epoch=1, seq=0, block_size=16)  # noqa: E731
    try:
        got = None
        for _ in range(100):                          # PUB/SUB slow joiner: publish until the index hears
            pub.send(Abort(request_id="prompt tokens"))
            try:
                got = await asyncio.wait_for(index.recv(), 0.05)
                break
            except TimeoutError:
                continue
        assert got == Abort(request_id="prompt tokens")
        for sub in (keyless, gateway):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sub.recv(), 0.3)

        async def ask(p: Plane) -> Snapshot | None:
            task = asyncio.create_task(request(snapshots, SnapshotRequest(request_id="q"), Snapshot, 1.0, plane=p,
                                               server_role="worker"))
            for _ in range(40):
                rep.serve(answer, lambda: None, 4)
                await asyncio.sleep(0.025)
            return await task
        assert (await ask(plane(trust, "prefix-cache"))).request_id == "q"
        assert await ask(Plane.insecure()) is None
        assert await ask(plane(trust, "gateway")) is None
    finally:
        for sub in (index, keyless, gateway):
            sub.close()
        pub.close()
        rep.close()


async def test_a_flood_of_malformed_frames_logs_one_line(trust, caplog):
    rx: Receiver = Receiver(SchedulerInbox, "127.0.0.1", 0, name="flooded", plane=plane(trust, "scheduler"),
                            senders=SCHEDULER_SENDERS)
    gateway = Sender(with_role(tcp_addr("127.0.0.1", rx.port), "scheduler"), plane=plane(trust, "gateway"))
    worker = Sender(with_role(tcp_addr("127.0.0.1", rx.port), "scheduler"), plane=plane(trust, "worker"))
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.transport"):
            for i in range(1000):
                gateway._sock.send(b"\xff\x00garbage")
                worker.send(Abort(request_id=str(i)))   # unauthorized: workers may not abort
            gateway.send(Abort(request_id="last"))
            assert (await asyncio.wait_for(rx.recv(), 10)).request_id == "last"
            for _ in range(100):                        # the worker's pipe may still hold some (fair queueing)
                if rx.refused == 1000:
                    break
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(rx.recv(), 0.05)
        assert rx.dropped == 1000 and rx.refused == 1000
        lines = [r.getMessage() for r in caplog.records if r.name == "kvmesh.transport"]
        assert len(lines) == 2, lines                  # one per kind of drop, not one per frame
        assert any("refused a Abort from role worker" in line for line in lines)
    finally:
        gateway.close()
        worker.close()
        rx.close()


def test_a_service_without_trust_material_refuses_to_start():
    cfg = SchedulerConfig(redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(TrustError, match="--trust-dir.*kvmesh keys generate"):
        plane_for(cfg, "scheduler")
    assert not plane_for(SchedulerConfig(redis_url="redis://x:1/0", insecure_internal_planes=True), "scheduler").secure
