"""Typed ZMQ carriers of the index side of the KV event protocol (PUB/SUB and snapshot requests).

    EventSubscriber   one SUB socket connected to every worker's events address; yields
                      KVEventBatch, drops malformed frames (counted)
    fetch_snapshot    one SnapshotRequest to a worker's ROUTER, its Snapshot reply (or None)

TODO(stack): services/transport.py has PUSH/PULL only; these two belong there as
Subscriber[T] / a request helper once it grows them.
"""
from __future__ import annotations

import logging

import msgspec
import zmq
import zmq.asyncio

from services.protocol.kv_events import (
    ENCODER, KV_EVENT_BATCH_DECODER, SNAPSHOT_DECODER, KVEventBatch, Snapshot, SnapshotRequest,
)
from services.transport import context

log = logging.getLogger("kvmesh.prefix_cache.channels")

_RCVHWM = 100_000


class EventSubscriber:
    def __init__(self) -> None:
        self._sock = context().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.connected: set[str] = set()
        self.dropped = 0

    def connect(self, addr: str) -> None:
        if addr not in self.connected:
            self._sock.connect(addr)
            self.connected.add(addr)

    def disconnect(self, addr: str) -> None:
        if addr in self.connected:
            self.connected.discard(addr)
            try:
                self._sock.disconnect(addr)
            except zmq.ZMQError:
                pass

    async def recv(self) -> KVEventBatch:
        while True:
            frames = await self._sock.recv_multipart()
            batch = self._decode(frames)
            if batch is not None:
                return batch

    def _decode(self, frames: list[bytes]) -> KVEventBatch | None:
        try:
            return KV_EVENT_BATCH_DECODER.decode(frames[-1])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.dropped += 1
            log.warning("dropped a malformed KV event frame (%d bytes): %s", len(frames[-1]), exc)
            return None

    def close(self) -> None:
        self._sock.close(linger=0)


async def fetch_snapshot(addr: str, request_id: str, timeout_s: float) -> Snapshot | None:
    """Ask one worker's snapshot ROUTER for its blocks; None on timeout or a malformed reply.

    A fresh DEALER per request: snapshots are rare, and a late reply to an earlier request can
    never be mistaken for this one.
    """
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        await sock.send(ENCODER.encode(SnapshotRequest(request_id=request_id)))
        if not await sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        snap = SNAPSHOT_DECODER.decode(await sock.recv())
        return snap if snap.request_id == request_id else None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("dropped a malformed snapshot from %s: %s", addr, exc)
        return None
    finally:
        sock.close(linger=0)
