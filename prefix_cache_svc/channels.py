"""The index side of the KV event protocol, on the typed carriers of services/transport.py.

    EventSubscriber   one SUB socket connected to every worker's events address; yields
                      KVEventBatch, drops malformed frames (counted)
    fetch_snapshot    one SnapshotRequest to a worker's ROUTER, its Snapshot reply (or None)

Both are CURVE clients of the prefix-cache role expecting the worker role's key: a worker only
talks to holders of the prefix-cache key, and a record in Redis pointing at an impostor gets a
failed handshake.
"""
from __future__ import annotations

from services.protocol.kv_events import KVEventBatch, Snapshot, SnapshotRequest
from services.security.curve import Plane
from services.transport import Subscriber, request


class EventSubscriber(Subscriber[KVEventBatch]):
    def __init__(self, plane: Plane) -> None:
        super().__init__(KVEventBatch, name="KV events", plane=plane, server_role="worker")


async def fetch_snapshot(addr: str, request_id: str, timeout_s: float, plane: Plane) -> Snapshot | None:
    """Ask one worker's snapshot ROUTER for its blocks; None on timeout, a malformed reply, or a
    reply to another request."""
    snap = await request(addr, SnapshotRequest(request_id=request_id), Snapshot, timeout_s, plane=plane,
                         server_role="worker")
    return snap if snap is not None and snap.request_id == request_id else None
