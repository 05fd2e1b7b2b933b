"""Typed ZMQ carriers drop malformed frames and keep going; gRPC carries msgspec structs."""
from __future__ import annotations

import asyncio
import time

import grpc
import msgspec
import pytest
import zmq

from services.protocol.messages import Abort, SchedulerInbox, Submit, TokenizeReply, TokenizeRequest, WorkerStatus
from services.protocol.sampling import SamplingParams
from services.security.curve import Plane
from services.transport import (
    Method, Publisher, Receiver, Sender, Subscriber, add_health, context, grpc_channel, grpc_server, set_serving,
    tcp_addr, unary_handler, unary_stub)

INSECURE = Plane.insecure()
ANYONE = {Submit: (), Abort: (), WorkerStatus: ()}   # the table is not consulted without CURVE


async def test_malformed_frames_are_dropped_not_fatal():
    rx: Receiver = Receiver(SchedulerInbox, "127.0.0.1", 0, name="test", plane=INSECURE, senders=ANYONE)
    raw = context().socket(zmq.PUSH)
    raw.connect(tcp_addr("127.0.0.1", rx.port))
    tx: Sender = Sender(tcp_addr("127.0.0.1", rx.port), plane=INSECURE)
    try:
        await raw.send(b"\xff\x00garbage")
        await raw.send(msgspec.msgpack.encode({"t": "abort"}))                      # missing field
        await raw.send(msgspec.msgpack.encode({"t": "abort", "request_id": "x", "version": 99}))  # other version
        await raw.send_multipart([b"a", b"b"])
        await raw.send(msgspec.msgpack.encode(Abort(request_id="ok")))   # same pipe: arrives after the junk
        msg = await asyncio.wait_for(rx.recv(), 5)
        assert msg == Abort(request_id="ok")
        assert rx.dropped == 4
        sub = Submit(request_id="s", tenant="t", prompt_token_ids=[1], params=SamplingParams(), reply_addr="a",
                     detok_addr="b")
        tx.send(sub)
        assert await asyncio.wait_for(rx.recv(), 5) == sub
    finally:
        raw.close(0)
        tx.close()
        rx.close()


async def test_receiver_wakes_per_message_and_never_spins():
    """recv() (a reader on the socket's edge-triggered ZMQ_FD) returns a queued message at once,
    wakes for one that arrives while it waits, drains a burst in order, survives a cancelled wait,
    and a message arriving while nobody waits neither gets lost nor keeps the loop busy."""
    rx: Receiver = Receiver(SchedulerInbox, "127.0.0.1", 0, name="test", plane=INSECURE, senders=ANYONE)
    tx: Sender = Sender(tcp_addr("127.0.0.1", rx.port), plane=INSECURE)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(rx.recv(), 0.2)            # nothing yet: the wait is cancelled
        tx.send(Abort(request_id="a"))
        assert await asyncio.wait_for(rx.recv(), 5) == Abort(request_id="a")
        waiting = asyncio.create_task(rx.recv())
        await asyncio.sleep(0.05)
        tx.send(Abort(request_id="b"))
        assert await asyncio.wait_for(waiting, 5) == Abort(request_id="b")
        for i in range(500):
            tx.send(Abort(request_id=str(i)))
        assert [(await asyncio.wait_for(rx.recv(), 5)).request_id for _ in range(500)] == [str(i) for i in range(500)]
        tx.send(Abort(request_id="late"))                     # nobody is waiting for it
        cpu = time.process_time()
        await asyncio.sleep(0.3)
        assert time.process_time() - cpu < 0.1, "the loop kept calling the reader"
        assert await asyncio.wait_for(rx.recv(), 5) == Abort(request_id="late")
    finally:
        tx.close()
        rx.close()


async def test_subscriber_drops_a_malformed_frame_and_keeps_going():
    pub: Publisher = Publisher("127.0.0.1", plane=INSECURE, subscribers=())
    raw = zmq.Context.instance().socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
    sub: Subscriber = Subscriber(SchedulerInbox, name="test", plane=INSECURE, server_role="")
    sub.connect(tcp_addr("127.0.0.1", pub.port))
    sub.connect(tcp_addr("127.0.0.1", raw_port))
    try:
        for _ in range(100):                       # PUB/SUB slow joiner: send until both links are up
            raw.send(msgspec.msgpack.encode(Abort(request_id="raw")))
            pub.send(Abort(request_id="typed"))
            got = set()
            try:
                while len(got) < 2:
                    got.add((await asyncio.wait_for(sub.recv(), 0.05)).request_id)
            except asyncio.TimeoutError:
                continue
            break
        assert got == {"raw", "typed"}
        while True:                                # drain the repeats of the warm-up
            try:
                await asyncio.wait_for(sub.recv(), 0.05)
            except asyncio.TimeoutError:
                break
        assert sub.dropped == 0
        raw.send(b"\xff\x00garbage")
        raw.send(msgspec.msgpack.encode(Abort(request_id="ok")))   # same pipe: arrives after the junk
        assert await asyncio.wait_for(sub.recv(), 5) == Abort(request_id="ok")
        assert sub.dropped == 1
    finally:
        raw.close(0)
        sub.close()
        pub.close()


def test_send_without_peer_never_blocks():
    tx: Sender = Sender("tcp://127.0.0.1:9", plane=INSECURE)  # nobody there
    try:
        for _ in range(10):
            tx.send(Abort(request_id="x"))
    finally:
        tx.close()


async def test_grpc_with_msgspec_and_health():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def tokenize(req: TokenizeRequest, ctx) -> TokenizeReply:
        if not req.prompt:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty")
        return TokenizeReply(prompt_token_ids=[len(req.prompt)], detok_addr="d", vocab_size=5)

    server, port = grpc_server("127.0.0.1", 0, None)
    server.add_generic_rpc_handlers([unary_handler(
        "kvmesh.T", {"Tokenize": Method(tokenize, TokenizeRequest, frozenset({"gateway"}))}, None)])
    health = await add_health(server)
    await server.start()
    await set_serving(health, True)
    try:
        async with grpc_channel(f"127.0.0.1:{port}", None, "tokenizer") as ch:
            stub = unary_stub(ch, "kvmesh.T", "Tokenize", TokenizeReply)
            assert (await stub(TokenizeRequest(prompt="abc"))).prompt_token_ids == [3]
            try:
                await stub(TokenizeRequest(prompt=""))
                raise AssertionError("expected INVALID_ARGUMENT")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
