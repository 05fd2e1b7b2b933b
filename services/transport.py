"""Typed ZMQ and gRPC carriers for the messages of services/protocol (no service touches zmq or
msgpack directly).

    Receiver[T]   PULL socket, bound; yields decoded T sent by a role allowed to send it
    SyncReceiver  the same for a thread that blocks (the worker's engine thread)
    Sender[T]     PUSH socket, connected to one address; never blocks (drops + counts when full)
    SenderPool[T] one Sender per destination address, connected lazily (reply-to addresses)
    Publisher[T]  PUB socket, bound; never blocks (a slow subscriber's queue drops)
    Subscriber[T] SUB socket connected to many publishers; yields decoded T; drops malformed frames
    Replier[Q, R] ROUTER socket, bound, answered between steps by a thread that never blocks
    request()     one request over a fresh DEALER, its decoded reply (or None on timeout/garbage)

Every ZMQ carrier takes the process's `Plane` (services/security/curve.py): CURVE with this
role's keys, or explicitly none. A bound socket names the roles that may connect; a receiver
also names, per message kind, the roles that may send it (`senders`) and drops the rest. Dropped
frames (malformed, another protocol version, an unauthorized sender) are counted and logged at
most once per 10 s per socket.

gRPC methods carry the same msgspec Structs through custom (de)serializers: `unary_handler` on the
server side (each Method names the roles that may call it), `unary_stub` on the client side;
`grpc_server` / `grpc_channel` use mutual TLS given a trust directory's material
(services/security/tls.py); `add_health` adds the standard grpc.health.v1 service, also on a
plaintext health-only probe port for Kubernetes probes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Collection, Generic, Iterable, Mapping, NamedTuple, TypeVar

import grpc
import msgspec
import zmq
import zmq.asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services import metrics
from services.logging import RateLimitedLog
from services.protocol.messages import PROTOCOL_VERSION
from services.security import tls
from services.security.bundle import Trust
from services.security.curve import Plane, split_role

T = TypeVar("T")
Q = TypeVar("Q")
R = TypeVar("R")
log = logging.getLogger("kvmesh.transport")

Senders = Mapping[type, Collection[str]]   # message kind -> the roles that may send it

_HWM = 100_000
_ctx: zmq.asyncio.Context | None = None


def context() -> zmq.asyncio.Context:
    global _ctx
    if _ctx is None:
        _ctx = zmq.asyncio.Context()
    return _ctx


def tcp_addr(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def _bind(sock: Any, host: str, port: int) -> int:
    """Bind `sock` to host:port (a random free port when 0); the bound port."""
    sock.setsockopt(zmq.LINGER, 0)
    if port:
        sock.bind(tcp_addr(host, port))
        return port
    return sock.bind_to_random_port(f"tcp://{host}")


def _connect(sock: Any, addr: str, plane: Plane, server_role: str) -> str:
    """Connect `sock` as a CURVE client to `addr` (`tcp://host:port`, optionally `#role`), expecting
    `server_role` there (default: the role the address names). Returns the plain endpoint."""
    endpoint, named = split_role(addr)
    role = server_role or named
    if plane.secure and not role:
        raise ValueError(f"{addr} names no role, so its CURVE public key is unknown (expected tcp://host:port#role)")
    plane.connect(sock, role)
    sock.connect(endpoint)
    return endpoint


_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError)
# A bound socket closes the connection of a peer that sends a larger frame. Far above any message of
# the stack (a Submit of a 1M-token prompt is ~5 MB); a peer with a valid key still cannot make a
# process buffer gigabytes.
MAX_FRAME_BYTES = 16 << 20


class _Inbox(Generic[T]):
    """What a bound receiving socket accepts: one frame, decodable as `msg_type`, of this protocol
    version, of a kind its sender's role may send."""

    def __init__(self, msg_type: Any, name: str, plane: Plane, senders: Senders) -> None:
        self.decoder = msgspec.msgpack.Decoder(msg_type)
        self.name = name or str(msg_type)
        self.plane = plane
        self.senders = {kind: frozenset(roles) for kind, roles in senders.items()}
        self.malformed = RateLimitedLog(log, self.name)
        self.unauthorized = RateLimitedLog(log, self.name)

    @property
    def roles(self) -> set[str]:
        """Every role that may connect (sends at least one kind)."""
        return set().union(*self.senders.values())

    def accept(self, frames: list) -> T | None:
        """The message in `frames` (bytes, or zmq.Frame when secure), or None (counted, logged)."""
        if len(frames) != 1:
            self._drop("malformed")
            self.malformed.warn("dropped a %d-part message", len(frames))
            return None
        frame = frames[0]
        body = frame.buffer if isinstance(frame, zmq.Frame) else frame
        try:
            msg = self.decoder.decode(body)
        except _DECODE_ERRORS as exc:
            self._drop("malformed")
            self.malformed.warn("dropped a malformed frame (%d bytes): %s", len(body), exc)
            return None
        if getattr(msg, "version", PROTOCOL_VERSION) != PROTOCOL_VERSION:
            self._drop("version")
            self.malformed.warn("dropped a message of protocol version %s", msg.version)
            return None
        if self.plane.secure:
            role = self.plane.sender_role(frame)
            if role not in self.senders.get(type(msg), ()):
                self._drop("role")
                self.unauthorized.warn("refused a %s from role %s (it may not send that here)",
                                       type(msg).__name__, role or "none")
                return None
        return msg

    def _drop(self, reason: str) -> None:
        metrics.DROPPED_FRAMES.labels(self.name, reason).inc()


class _BoundPull(Generic[T]):
    """A bound PULL socket (a CURVE server for the roles `senders` names) and its inbox's checks:
    what Receiver and SyncReceiver share."""

    def __init__(self, msg_type: Any, host: str, port: int = 0, name: str = "", *, plane: Plane,
                 senders: Senders) -> None:
        self._inbox: _Inbox[T] = _Inbox(msg_type, name, plane, senders)
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        plane.serve(self._sock, self._inbox.roles)
        self.port = _bind(self._sock, host, port)
        self._copy = not plane.secure          # the sender's role is a property of the zmq.Frame
        self.name = self._inbox.name

    @property
    def dropped(self) -> int:
        """Malformed frames and messages of another protocol version."""
        return self._inbox.malformed.count

    @property
    def refused(self) -> int:
        """Messages of a kind their sender's role may not send here."""
        return self._inbox.unauthorized.count


class Receiver(_BoundPull[T]):
    """Bound PULL socket decoding `msg_type` (a Struct or a tagged Union of Structs) from the roles
    `senders` allows per kind; `recv()` serves one consumer task on the running event loop.

    A plain zmq socket whose ZMQ_FD the loop watches (a reader callback), not zmq.asyncio: a message
    already queued returns without a future, and a wake-up is one callback and one future. Each
    stream hop of the stack ends in one of these; it costs ~35 us less a hop than zmq.asyncio's
    recv_multipart (median 150 vs 185 us one way, ping-pong between two processes idle between
    messages, uvloop, 2-vCPU VM).
    """

    def __init__(self, msg_type: Any, host: str, port: int = 0, name: str = "", *, plane: Plane,
                 senders: Senders) -> None:
        super().__init__(msg_type, host, port, name, plane=plane, senders=senders)
        self._loop: asyncio.AbstractEventLoop | None = None   # the loop watching the socket's FD
        self._waiter: asyncio.Future | None = None

    async def recv(self) -> T:
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=self._copy)
            except zmq.Again:
                await self._readable()
                continue
            msg = self._inbox.accept(frames)
            if msg is not None:
                return msg

    async def _readable(self) -> None:
        """Return once a message may be queued.

        ZMQ_FD is edge-triggered: it signals that ZMQ_EVENTS may have changed, and reading
        ZMQ_EVENTS re-arms it. So EVENTS is read after the waiter exists (a message that arrived
        since the failed recv is not missed) and in the callback (a signal with nobody waiting is
        consumed, not re-delivered on every loop iteration)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._unwatch()
            loop.add_reader(self._sock.FD, self._on_fd)
            self._loop = loop
        self._waiter = loop.create_future()
        try:
            if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await self._waiter
        finally:
            self._waiter = None

    def _on_fd(self) -> None:
        if self._sock.closed:
            return
        waiter = self._waiter
        if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _unwatch(self) -> None:
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._sock.FD)
            except (RuntimeError, ValueError, zmq.ZMQError):   # the loop (or socket) is gone already
                pass
            self._loop = None

    def close(self) -> None:
        if not self._sock.closed:
            self._unwatch()
        self._sock.close(linger=0)


class SyncReceiver(_BoundPull[T]):
    """Bound PULL socket for a thread that blocks (the worker's engine thread): plain zmq, no loop."""

    def __init__(self, msg_type: Any, host: str, port: int = 0, name: str = "", *, plane: Plane,
                 senders: Senders) -> None:
        super().__init__(msg_type, host, port, name, plane=plane, senders=senders)
        self.read_at = 0.0   # perf_counter() when the last recv_all that got a frame read its first

    @property
    def socket(self) -> Any:
        """The bound socket, for a zmq.Poller that waits on it and on other sockets of the thread."""
        return self._sock

    def recv_all(self, timeout_ms: int) -> list[T]:
        """Every queued message; waits up to timeout_ms for the first one when none is queued."""
        out: list[T] = []
        if timeout_ms and not self._sock.poll(timeout_ms, zmq.POLLIN):
            return out
        first = True
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=self._copy)
            except zmq.Again:
                return out
            if first:
                self.read_at, first = time.perf_counter(), False
            if (msg := self._inbox.accept(frames)) is not None:
                out.append(msg)

    def close(self) -> None:
        self._sock.close(linger=0)


class Sender(Generic[T]):
    """Connected PUSH socket. `send` never blocks: a full or peerless queue drops (and logs).

    A plain (synchronous) zmq socket: a non-blocking send needs no event loop or future, which
    keeps the per-message cost low; use it from one thread only. `server_role` is the role whose
    key the peer must hold (default: the one `addr` names, `tcp://host:port#role`).
    """

    _encoder = msgspec.msgpack.Encoder()

    def __init__(self, addr: str, *, plane: Plane, server_role: str = "") -> None:
        self.addr = addr
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            _connect(self._sock, addr, plane, server_role)
        except BaseException:
            self._sock.close(linger=0)
            raise
        self.dropped = 0
        self._last_warn = 0.0

    def send(self, msg: T) -> bool:
        try:
            self._sock.send(self._encoder.encode(msg), flags=zmq.NOBLOCK, copy=True)
            return True
        except zmq.Again:
            self.dropped += 1
            now = time.monotonic()
            if now - self._last_warn > 5.0:
                self._last_warn = now
                log.warning("send to %s dropped (peer gone or queue full; %d so far)", self.addr, self.dropped)
            return False

    def close(self) -> None:
        self._sock.close(linger=0)


class SenderPool(Generic[T]):
    """One Sender per address, created on first use (reply-to addresses of gateways, detokenizers);
    each address names the role serving it (`tcp://host:port#role`)."""

    def __init__(self, plane: Plane) -> None:
        self.plane = plane
        self._senders: dict[str, Sender[T]] = {}
        self._bad_addrs = RateLimitedLog(log, "sender pool")

    def send(self, addr: str, msg: T) -> bool:
        sender = self._senders.get(addr)
        if sender is None:
            try:
                sender = self._senders[addr] = Sender(addr, plane=self.plane)
            except (ValueError, zmq.ZMQError) as exc:   # an address without a role, or unparsable
                self._bad_addrs.warn("cannot send to %s: %s", addr, exc)
                return False
        return sender.send(msg)

    def drop(self, addr: str) -> None:
        sender = self._senders.pop(addr, None)
        if sender is not None:
            sender.close()

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()


class Publisher(Generic[T]):
    """Bound PUB socket (plain zmq, one thread) that only `subscribers` roles may join. `send` never
    blocks: past `hwm` queued messages a slow subscriber's copy is dropped (subscribers must notice
    gaps themselves)."""

    _encoder = msgspec.msgpack.Encoder()

    def __init__(self, host: str, port: int = 0, hwm: int = _HWM, *, plane: Plane,
                 subscribers: Iterable[str]) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        plane.serve(self._sock, subscribers)
        self.port = _bind(self._sock, host, port)

    def send(self, msg: T) -> bool:
        try:
            self._sock.send(self._encoder.encode(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def close(self) -> None:
        self._sock.close(linger=0)


class Subscriber(Generic[T]):
    """SUB socket (every topic) connected to any number of `server_role` publishers; yields decoded
    `msg_type`.

    Malformed frames are dropped, counted and logged (rate-limited). No protocol-version filter
    here: streams with their own version (KV events) are checked by the consumer, which counts them
    apart.
    """

    def __init__(self, msg_type: Any, name: str = "", *, plane: Plane, server_role: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self._sock = context().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        plane.connect(self._sock, server_role)
        self.name = name or str(msg_type)
        self.connected: set[str] = set()
        self._malformed = RateLimitedLog(log, self.name)

    @property
    def dropped(self) -> int:
        return self._malformed.count

    def connect(self, addr: str) -> None:
        if addr not in self.connected:
            self._sock.connect(split_role(addr)[0])
            self.connected.add(addr)

    def disconnect(self, addr: str) -> None:
        if addr in self.connected:
            self.connected.discard(addr)
            try:
                self._sock.disconnect(split_role(addr)[0])
            except zmq.ZMQError:
                pass

    def decode(self, frame: bytes) -> T | None:
        """The message in `frame`, or None (counted, logged) when malformed."""
        try:
            return self._decoder.decode(frame)
        except _DECODE_ERRORS as exc:
            self._malformed.warn("dropped a malformed frame (%d bytes): %s", len(frame), exc)
            return None

    async def recv(self) -> T:
        while True:
            frames = await self._sock.recv_multipart()
            msg = self.decode(frames[-1])   # the last frame is the body (a topic frame may precede it)
            if msg is not None:
                return msg

    def close(self) -> None:
        self._sock.close(linger=0)


class Replier(Generic[Q, R]):
    """Bound ROUTER socket answering `request()` callers of the `clients` roles, polled by a thread
    that never blocks (plain zmq): `serve` answers what is queued, up to `limit` requests."""

    _encoder = msgspec.msgpack.Encoder()

    def __init__(self, request_type: Any, host: str, port: int = 0, name: str = "", *, plane: Plane,
                 clients: Iterable[str]) -> None:
        self._decoder = msgspec.msgpack.Decoder(request_type)
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        plane.serve(self._sock, clients)
        self.port = _bind(self._sock, host, port)
        self.name = name or str(request_type)
        self._malformed = RateLimitedLog(log, self.name)

    def serve(self, answer: Callable[[Q], R], malformed: Callable[[], R], limit: int) -> int:
        """Reply to up to `limit` queued requests with answer(request), or malformed() for a
        request that does not decode. Returns how many were answered."""
        served = 0
        for _ in range(limit):
            try:
                identity, payload = self._sock.recv_multipart(flags=zmq.NOBLOCK)[-2:]
            except zmq.Again:
                break
            except ValueError:
                continue  # a frame without an identity: not a request() caller
            try:
                req = self._decoder.decode(payload)
            except _DECODE_ERRORS as exc:
                metrics.DROPPED_FRAMES.labels(self.name, "malformed").inc()
                self._malformed.warn("malformed request (%d bytes): %s", len(payload), exc)
                reply = malformed()
            else:
                reply = answer(req)
            self._sock.send_multipart([identity, self._encoder.encode(reply)])
            served += 1
        return served

    def close(self) -> None:
        self._sock.close(linger=0)


async def request(addr: str, msg: Any, reply_type: Any, timeout_s: float, *, plane: Plane,
                  server_role: str) -> Any | None:
    """Send `msg` to the `server_role` Replier at `addr`; its reply decoded as `reply_type`, or None
    on timeout, a failed handshake or a malformed reply (logged).

    A fresh DEALER per request: requests are rare, and a late reply to an earlier request can
    never be mistaken for this one.
    """
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        _connect(sock, addr, plane, server_role)
        async with asyncio.timeout(timeout_s):   # the send too: a DEALER waits for a handshaken peer
            await sock.send(Replier._encoder.encode(msg))
            if not await sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                return None
            return msgspec.msgpack.Decoder(reply_type).decode(await sock.recv())
    except TimeoutError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("dropped a malformed reply from %s: %s", addr, exc)
        return None
    finally:
        sock.close(linger=0)


# ----------------------------------------------------------------------------- gRPC

_GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
_MALFORMED_LOG_EVERY_S = 10.0


class Method(NamedTuple):
    """One unary gRPC method: `handler(request, context)`, its request type, and the roles whose
    certificates may call it (checked on mutual-TLS servers; a plaintext server checks nobody)."""

    handler: Callable[..., Awaitable[Any]]
    request_type: Any
    callers: frozenset[str]


class _Malformed(NamedTuple):
    error: str


class _MalformedLog:
    """One log line per interval for malformed calls, however many arrive (a flood must not
    flood the log)."""

    def __init__(self, service: str) -> None:
        self.service, self.count, self._last = service, 0, 0.0

    def note(self, method: str, error: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last >= _MALFORMED_LOG_EVERY_S:
            self._last = now
            log.warning("%s/%s: refused a malformed call (%s); %d so far", self.service, method, error, self.count)


def unary_handler(service: str, methods: dict[str, Method], trust: Trust | None) -> grpc.GenericRpcHandler:
    """A generic gRPC handler for msgspec methods. With `trust` (a mutual-TLS server) each call's
    certificate must name one of the method's callers (else PERMISSION_DENIED); a request that does
    not decode ends INVALID_ARGUMENT with one rate-limited log line, never a traceback."""
    encoder = msgspec.msgpack.Encoder()
    malformed = _MalformedLog(service)
    handlers = {}
    for name, method in methods.items():
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            _checked(name, method, trust is not None, malformed),
            request_deserializer=_lenient_decoder(method.request_type), response_serializer=encoder.encode)
    return grpc.method_handlers_generic_handler(service, handlers)


def _lenient_decoder(request_type: Any) -> Callable[[bytes], Any]:
    """Decode, or hand the handler a _Malformed (grpc would log a traceback for a raising
    deserializer and answer INTERNAL)."""
    decoder = msgspec.msgpack.Decoder(request_type)

    def decode(data: bytes) -> Any:
        try:
            return decoder.decode(data)
        except _DECODE_ERRORS as exc:
            return _Malformed(str(exc)[:200])
    return decode


def _checked(name: str, method: Method, check_role: bool, malformed: _MalformedLog) -> Callable:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if check_role and tls.peer_role(context) not in method.callers:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{name} may be called only by: {', '.join(sorted(method.callers))}")
        if isinstance(request, _Malformed):
            malformed.note(name, request.error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {name} request")
        return await method.handler(request, context)
    return handle


def unary_stub(channel: grpc.aio.Channel, service: str, method: str, reply_type: Any) -> Callable:
    encoder = msgspec.msgpack.Encoder()
    return channel.unary_unary(f"/{service}/{method}", request_serializer=encoder.encode,
                               response_deserializer=msgspec.msgpack.Decoder(reply_type).decode)


def grpc_server(host: str, port: int, trust: Trust | None) -> tuple[grpc.aio.Server, int]:
    """A gRPC server on host:port (0: any free port): mutual TLS with `trust`, plaintext without."""
    server = grpc.aio.server(options=_GRPC_OPTIONS)
    addr = f"{host}:{port}"
    bound = (server.add_secure_port(addr, tls.server_credentials(trust)) if trust is not None
             else server.add_insecure_port(addr))
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {addr}")
    return server, bound


def grpc_channel(target: str, trust: Trust | None, server_role: str) -> grpc.aio.Channel:
    """A channel to a `server_role` process: mutual TLS with `trust` (the server's certificate must
    name that role), plaintext without."""
    if trust is None:
        return grpc.aio.insecure_channel(target, options=_GRPC_OPTIONS)
    return grpc.aio.secure_channel(target, tls.channel_credentials(trust),
                                   options=_GRPC_OPTIONS + tls.channel_options(server_role))


class Health:
    """grpc.health.v1 of one process: on its main gRPC server and, with a probe port, on a plaintext
    probe server that serves nothing else. Kubernetes gRPC probes hold no client certificate, so
    they call the probe port; it tells a caller only SERVING or NOT_SERVING."""

    def __init__(self, servicer: health.aio.HealthServicer, probe: grpc.aio.Server | None, probe_port: int) -> None:
        self.servicer, self.probe, self.probe_port = servicer, probe, probe_port

    async def set(self, service: str, status: Any) -> None:
        await self.servicer.set(service, status)

    async def stop(self) -> None:
        if self.probe is not None:
            await self.probe.stop(0)
            self.probe = None


async def add_health(server: grpc.aio.Server, host: str = "127.0.0.1", probe_port: int = -1) -> Health:
    """Standard grpc.health.v1 on `server`, and on a started plaintext probe server at
    host:probe_port (0: any free port; -1: none). Starts NOT_SERVING."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    probe, bound = None, -1
    if probe_port >= 0:
        probe, bound = grpc_server(host, probe_port, None)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, probe)
        await probe.start()
    checker = Health(servicer, probe, bound)
    await set_serving(checker, False)
    return checker


async def set_serving(servicer: Any, serving: bool, service: str = "") -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await servicer.set(service, status)


def run_async(coro: Any) -> Any:
    """Run a service's main coroutine on uvloop when installed (faster sockets), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
