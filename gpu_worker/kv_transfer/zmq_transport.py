"""The plain ZMQ/TCP path of the KV hand-off (CPU runs, CI, hosts without RDMA).

    D  KVReceiverEndpoint: ROUTER bound (loopback by default); poll() between engine steps
       answers Offers, writes BlockFrames, answers Done with Ack/Fail
    P  KVSenderEndpoint:   DEALER connected to one D; send(rid) runs one hand-off to the end
                           and releases P's blocks after D's answer (or a timeout: Abort);
                           send(rid, release=False) leaves the release to the caller (a sender
                           thread: the engine thread frees the blocks)

Every ZMQ message is [header] or, for a BlockFrame, [header, payload]: the header is one msgpack
message of messages.py, the payload the raw KV bytes (sent without a copy). Malformed headers,
unexpected payloads, oversize messages and frames that fail the consumer's checks are dropped
with a rate-limited log line. The sockets are synchronous: D's engine loop serves its endpoint
between steps; P's sender thread (gpu_worker/service/handoff.py) owns its endpoints. Given a
`Plane` (services/security/curve.py) the ROUTER is a CURVE server that lets in only the worker
role and each DEALER a CURVE client of it: authenticated and encrypted like every internal plane. Without one (engine-level tests) it is plaintext, on loopback by default.

A hand-off's deadline is a lease renewed by progress: each message D takes (Offer, frame, Done)
pushes it `timeout_s` further, so a long transfer that moves runs to its end while a D that stops
reading or answering ends it within `timeout_s`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import torch
import zmq

from gpu_worker.kv_transfer import shm
from gpu_worker.kv_transfer.connector import DEFAULT_MAX_FRAME_BYTES, EngineKVConsumer, KVProducer
from gpu_worker.kv_transfer.layout import KVLayoutMismatch
from gpu_worker.kv_transfer.messages import (MAX_HEADER_BYTES, Abort, Accept, Ack, BlockFrame, Done,
                                             Fail, NixlSource, Offer, Refuse, decode, encode)
from gpu_worker.kv_transfer.rate_limit import RateLimitedLog
from services.security.curve import Plane, split_role

log = logging.getLogger("kvmesh.kv_transfer")
WAIT_SLICE_S = 0.05     # a waiting sender checks its `cancelled` callback this often


class KVReceiverEndpoint:
    def __init__(self, consumer: EngineKVConsumer, host: str = "127.0.0.1", port: int = 0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, idle_timeout_s: float = 10.0,
                 plane: Plane | None = None) -> None:
        self.consumer = consumer
        self.idle_timeout_s = idle_timeout_s     # a transfer silent this long is dropped (P died)
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if plane is not None:
            plane.serve(self._sock, ("worker",))   # only prefill workers offer KV
        # a message larger than this never reaches memory: ZMQ drops the connection instead
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + MAX_HEADER_BYTES)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self._dropped = RateLimitedLog(log)
        self.messages_dropped = 0
        self.nixl_reader = None      # nixl_transport.NixlKVReader: D reads the blocks of NIXL offers
        self.shm_host = ""           # shm.host_identity() when same-host P may send shared-memory frames
        self._rings = shm.RingReader()
        self.shm_frames = 0          # frames whose payload came through a shared-memory ring
        self.cache_reader = None     # cuda_ipc.CacheReader: D reads same-host P's cache itself

    @property
    def socket(self) -> zmq.Socket:
        """The bound socket, for a poller that also waits on the engine's inbox."""
        return self._sock

    def poll(self, timeout_ms: int = 0) -> int:
        """Handle every message that arrives within timeout_ms (then every one queued), then drop
        the transfers idle for idle_timeout_s; the count of messages."""
        handled = 0
        while self._sock.poll(timeout_ms if handled == 0 else 0, zmq.POLLIN):
            parts = self._sock.recv_multipart(copy=False)
            self._handle(parts)
            handled += 1
        self.consumer.expire(self.idle_timeout_s)
        if self.cache_reader is not None:
            self.cache_reader.expire()
        return handled

    def _handle(self, parts: list) -> None:
        peer, rest = parts[0].bytes, parts[1:]
        try:
            if not rest:
                raise ValueError("empty message")
            msg = decode(rest[0].bytes)
            inline = isinstance(msg, BlockFrame) and not msg.segment
            if inline != (len(rest) == 2) or len(rest) > 2:
                raise ValueError(f"{type(msg).__name__} with {len(rest) - 1} payload frames")
        except ValueError as e:
            self.messages_dropped += 1
            self._dropped.warning("kv transfer: dropped a malformed message: %s", e)
            return
        if isinstance(msg, Offer):
            answer = self.consumer.accept(msg)
            if isinstance(answer, Accept) and self.shm_host and msg.shm_host == self.shm_host:
                answer = msgspec.structs.replace(answer, shm=True)
            if isinstance(answer, Accept) and msg.cache_source is not None and self.cache_reader is not None \
                    and not self.cache_reader.open(msg.cache_source):
                self.cache_reader.expect(msg.request_id, msg.cache_source.source_id)
                answer = msgspec.structs.replace(answer, reads_cache=True)
            self._reply(peer, answer)
            if msg.nixl_source and isinstance(answer, Accept):
                self._reply(peer, self._read(msg, answer))
        elif isinstance(msg, NixlSource):
            self._connect_source(msg)
        elif isinstance(msg, BlockFrame):
            failed = self._receive_shared(msg) if msg.segment else self.consumer.receive(msg, rest[1].buffer)
            if failed is not None:
                self._reply(peer, failed)
        elif isinstance(msg, Done):
            reads = self.cache_reader is not None and self.cache_reader.reading(msg.request_id)
            self._reply(peer, self.cache_reader.read(msg) if reads else self.consumer.complete(msg))
        elif isinstance(msg, Abort):
            self.consumer.abort(msg.request_id)
        else:
            self.messages_dropped += 1
            self._dropped.warning("kv transfer: dropped an unexpected %s", type(msg).__name__)

    def _receive_shared(self, frame: BlockFrame) -> Fail | None:
        """A frame whose payload is in a shared-memory segment: mapped, unlinked, then checked and
        copied like an inline one. Without shm on this side, or a segment that is not one of ours
        of the frame's size, the request fails."""
        if not self.shm_host:
            return self.consumer.fail(frame.request_id, "shared-memory frame, but shm is off here")
        try:
            with self._rings.read(frame.segment, frame.segment_offset, _frame_bytes(frame),
                                  frame.segment_end) as payload:
                self.shm_frames += 1
                return self.consumer.receive(frame, payload)
        except (OSError, ValueError) as e:
            return self.consumer.fail(frame.request_id, f"shared-memory frame unreadable: {e}")

    def _read(self, offer: Offer, accept: Accept) -> Ack | Fail:
        """A NIXL offer: D reads the blocks it lacks from P's agent itself (no frames), then admits."""
        if self.nixl_reader is None:
            self.consumer.abort(offer.request_id)
            return Fail(offer.request_id, "this decode worker does not read KV with NIXL (--kv-transport)")
        return self.nixl_reader.pull(offer.nixl_source, offer, accept, timeout_s=self.idle_timeout_s)

    def _connect_source(self, msg: NixlSource) -> None:
        if self.nixl_reader is None:
            self._dropped.warning("kv transfer: dropped a NIXL source (this worker does not read with NIXL)")
            return
        from gpu_worker.kv_transfer.nixl_transport import decode_peer
        try:
            self.nixl_reader.connect(decode_peer(msg.peer))
        except ValueError as e:          # malformed, or a layout or cache shape that differs
            self.messages_dropped += 1
            self._dropped.warning("kv transfer: refused a NIXL source: %s", e)

    def _reply(self, peer: bytes, msg) -> None:
        try:
            self._sock.send_multipart([peer, encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("kv transfer: reply to a producer dropped (its queue is full)")

    def close(self) -> None:
        self._sock.close(0)
        self._rings.close()


class KVSenderEndpoint:
    def __init__(self, producer: KVProducer, address: str, send_hwm: int = 64,
                 plane: Plane | None = None) -> None:
        """`address`: `tcp://host:port`, or `tcp://host:port#worker` as a decode worker advertises it."""
        self.producer = producer
        self._sock = dealer_to_decode_worker(address, plane, send_hwm)
        self.bytes_sent = 0                             # payload bytes of the last send()
        self._cancelled: Callable[[], bool] = _never

    def abort(self, request_id: str) -> None:
        """Tell D to stop awaiting or receiving request_id (never blocks: a full queue drops it,
        and D's own idle timeout frees the request)."""
        try:
            self._sock.send(encode(Abort(request_id)), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def send(self, request_id: str, timeout_s: float = 30.0, *, release: bool = True,
             cancelled: Callable[[], bool] | None = None) -> Ack | Fail | Refuse | None:
        """One hand-off: Offer, frames, Done, D's answer; then P's blocks are released (unless
        `release` is False: the caller releases them). None when the request has nothing to hand
        off, D did not answer in time, or `cancelled()` turned true (checked every WAIT_SLICE_S
        while waiting and between frames); D is sent an Abort then."""
        offer = self.producer.offer(request_id)
        if offer is None:
            return None
        self.bytes_sent = 0
        self._cancelled = cancelled or _never
        deadline = time.monotonic() + timeout_s
        try:
            answer = self._answer(request_id, deadline) if self._send([encode(offer)], deadline) else None
            if isinstance(answer, Accept):
                try:
                    answer = self._stream(answer, timeout_s)
                except KVLayoutMismatch as e:          # D's layout differs: nothing was sent
                    self._send([encode(Abort(request_id))], time.monotonic())
                    return Refuse(request_id, str(e))
            if answer is None:
                self._send([encode(Abort(request_id))], time.monotonic())
            return answer
        finally:
            if release:
                self.producer.release(request_id)

    def _wait(self, event: int, deadline: float) -> bool:
        """Poll for `event` until the deadline, in slices; False at the deadline or on cancel."""
        while not self._cancelled():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._sock.poll(max(1, int(min(left, WAIT_SLICE_S) * 1000)), event):
                return True
        return False

    def _send(self, parts: list, deadline: float) -> bool:
        """Queue one message unless D's queue stays full past the deadline (D stopped reading)."""
        if not self._sock.poll(0, zmq.POLLOUT) and not self._wait(zmq.POLLOUT, deadline):
            return False
        self._sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
        return True

    def _stream(self, accept: Accept, timeout_s: float) -> Ack | Fail | None:
        rid = accept.request_id
        deadline = time.monotonic() + timeout_s
        for frame, payload in self.producer.frames(accept):
            if self._cancelled() or not self._send([encode(frame), payload], deadline):
                return None
            self.bytes_sent += len(payload)
            deadline = time.monotonic() + timeout_s      # D took the frame: the lease is renewed
            while self._sock.poll(0, zmq.POLLIN):        # D gave up on it mid-stream?
                early = self._recv()
                if isinstance(early, Fail) and early.request_id == rid:
                    return early
            if time.monotonic() > deadline:
                return None
        if not self._send([encode(self.producer.done(rid))], deadline):
            return None
        return self._answer(rid, deadline)

    def _answer(self, request_id: str, deadline: float):
        """D's next message about request_id (others are stale and skipped); None on timeout or
        cancel."""
        while self._wait(zmq.POLLIN, deadline):
            msg = self._recv()
            if isinstance(msg, (Accept, Refuse, Ack, Fail)) and msg.request_id == request_id:
                return msg
        return None

    def _recv(self):
        try:
            return decode(self._sock.recv())
        except ValueError as e:
            log.warning("kv transfer: dropped a malformed answer: %s", e)
            return None

    def close(self) -> None:
        self._sock.close(0)


def dealer_to_decode_worker(address: str, plane: Plane | None, send_hwm: int) -> zmq.Socket:
    """A DEALER connected to a decode worker's KV socket (CURVE through `plane`; `address` may
    carry the `#worker` role suffix D advertises)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, send_hwm)     # frames queued for D: 64 x 4 MiB by default
    endpoint, _ = split_role(address)
    if plane is not None:
        plane.connect(sock, "worker")
    sock.connect(endpoint)
    return sock


def _frame_bytes(frame: BlockFrame) -> int:
    """The payload size a frame's header claims (its dtype and shape), 0 when they are invalid."""
    dtype = getattr(torch, frame.dtype, None)
    if not isinstance(dtype, torch.dtype) or not frame.shape or any(d < 0 for d in frame.shape):
        return 0
    n = dtype.itemsize
    for d in frame.shape:
        n *= d
    return n if n <= DEFAULT_MAX_FRAME_BYTES else 0


def _never() -> bool:
    return False
