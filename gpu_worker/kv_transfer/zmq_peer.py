"""P's connection to one decode worker's KV socket, shared by every hand-off to it.

Several hand-offs to one D may be open at once (streamed ones wait between a prefill's chunks),
so D's answers are sorted by request as they are read: a hand-off waiting for its Accept keeps the
Fail another one's frame drew. Only the answers of requests opened here (open()) are kept, until
close_request(); the rest are stale (a request already ended) and dropped.

Sends never block past their deadline: a D that stops reading fills the send queue (at most
`send_hwm` messages), and the caller gives up at its lease. `cancelled()` is checked every
WAIT_SLICE_S while waiting.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from gpu_worker.kv_transfer.messages import Abort, Accept, Ack, Fail, Refuse, decode, encode
from gpu_worker.kv_transfer.zmq_transport import WAIT_SLICE_S, dealer_to_decode_worker
from services.security.curve import Plane

log = logging.getLogger("kvmesh.kv_transfer")
Answer = Accept | Refuse | Ack | Fail


class KVPeerChannel:
    def __init__(self, address: str, plane: Plane | None = None, send_hwm: int = 64) -> None:
        """`address`: `tcp://host:port`, or `tcp://host:port#worker` as a decode worker advertises it."""
        self.address = address
        self._sock = dealer_to_decode_worker(address, plane, send_hwm)
        self._answers: dict[str, list[Answer]] = {}    # per open request, in arrival order

    def open(self, request_id: str) -> None:
        self._answers.setdefault(request_id, [])

    def close_request(self, request_id: str) -> None:
        self._answers.pop(request_id, None)

    def send(self, parts: list, deadline: float, cancelled: Callable[[], bool]) -> bool:
        """Queue one message unless D's queue stays full past the deadline or cancelled() turns true."""
        while not self._sock.poll(0, zmq.POLLOUT):
            if not self._wait(zmq.POLLOUT, deadline, cancelled):
                return False
        self._sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
        return True

    def abort(self, request_id: str) -> None:
        """Tell D to drop request_id (never blocks: a full queue drops it, and D's idle timeout
        frees the request)."""
        try:
            self._sock.send(encode(Abort(request_id)), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def answer(self, request_id: str, deadline: float, cancelled: Callable[[], bool]) -> Answer | None:
        """D's next answer about request_id; None at the deadline or on cancel."""
        while True:
            self._read_ready()
            queued = self._answers.get(request_id)
            if queued:
                return queued.pop(0)
            if not self._wait(zmq.POLLIN, deadline, cancelled):
                return None

    def failed(self, request_id: str) -> Fail | None:
        """A Fail D sent about request_id mid-stream (never waits)."""
        self._read_ready()
        queued = self._answers.get(request_id) or []
        return next((m for m in queued if isinstance(m, Fail)), None)

    def _read_ready(self) -> None:
        while self._sock.poll(0, zmq.POLLIN):
            try:
                msg = decode(self._sock.recv())
            except ValueError as e:
                log.warning("kv transfer: dropped a malformed answer from %s: %s", self.address, e)
                continue
            if isinstance(msg, (Accept, Refuse, Ack, Fail)) and msg.request_id in self._answers:
                self._answers[msg.request_id].append(msg)

    def _wait(self, event: int, deadline: float, cancelled: Callable[[], bool]) -> bool:
        while not cancelled():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._sock.poll(max(1, int(min(left, WAIT_SLICE_S) * 1000)), event):
                return True
        return False

    def close(self) -> None:
        self._sock.close(0)
