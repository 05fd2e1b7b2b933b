"""CURVE on every ZeroMQ socket: who may connect, and which role sent each message.

    plane = curve.plane_for(cfg, "scheduler")          # --trust-dir, or --insecure-internal-planes
    plane.serve(sock, allowed=("gateway", "worker"))   # a bound socket: CURVE server of this role
    plane.connect(sock, server_role="worker")          # a connecting socket: CURVE client
    plane.sender_role(frame)                           # the role that sent a frame to a served socket

A bound socket is a CURVE server holding its role's secret key; a connecting socket is a CURVE
client holding its own role's key pair and the server role's public key, so an address in Redis
that points at an impostor gets a failed handshake, never plaintext. One ZAP responder per process
(a thread on the ZAP endpoint of zmq.Context.instance(), which every transport socket uses) accepts
a client only when its public key belongs to a role that the socket's ZAP domain lists, and names
that role as the connection's User-Id; a receiver reads it per message and refuses message kinds
that role may not send (services/transport.py).

Roles are per service, not per process (every worker holds the worker key): a role's messages are
authenticated, a single process of that role is not.

An address that a service advertises (registry records, reply and detokenizer addresses) names
the role serving it, `tcp://host:port#role`, so that a sender knows whose public key to expect; the
role only picks a key from the trust directory, it is never trusted by itself.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Iterable

import zmq
from zmq.utils import z85

from services.logging import RateLimitedLog
from services.security import bundle
from services.security.bundle import Trust, TrustError

log = logging.getLogger("kvmesh.curve")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"   # fixed by the ZAP RFC (27/ZAP)
MISSING_TRUST = ("no trust material: pass --trust-dir DIR (make one with `kvmesh keys generate DIR`; "
                 "`kvmesh serve` makes its own), or --insecure-internal-planes to run the internal planes "
                 "without authentication (tests and debugging only)")


def with_role(addr: str, role: str) -> str:
    """`tcp://host:port` advertised as served by `role`."""
    return f"{addr}#{role}"


def split_role(addr: str) -> tuple[str, str]:
    """(`tcp://host:port`, role or "") of an advertised address."""
    endpoint, _, role = addr.partition("#")
    return endpoint, role


class Plane:
    """How one process's ZMQ sockets authenticate: its role's trust material, or nothing at all
    (`Plane.insecure()`, only by explicit choice)."""

    def __init__(self, trust: Trust | None) -> None:
        self.trust = trust

    @classmethod
    def insecure(cls) -> "Plane":
        return cls(None)

    @classmethod
    def load(cls, trust_dir: str, role: str) -> "Plane":
        return cls(bundle.load(trust_dir, role))

    @property
    def secure(self) -> bool:
        return self.trust is not None

    @property
    def role(self) -> str:
        return self.trust.role if self.trust is not None else ""

    def serve(self, sock: Any, allowed: Iterable[str]) -> None:
        """Make `sock` (before it binds) a CURVE server of this role that lets in only `allowed` roles."""
        if self.trust is None:
            return
        if sock.context.underlying != zmq.Context.instance().underlying:
            # the ZAP responder serves that context only; elsewhere libzmq would let any key in
            raise ValueError("a CURVE server socket must come from zmq.Context.instance()")
        roles = sorted(set(allowed))
        for role in roles:
            self.trust.peer_key(role)                   # a role the directory lacks: fail now, clearly
        _responder().learn(self.trust.curve_peers)      # bound before the socket: no unchecked handshake
        sock.curve_secretkey = self.trust.curve_secret
        sock.curve_publickey = self.trust.curve_public
        sock.curve_server = True
        sock.zap_domain = ",".join(roles).encode()      # the responder's allow-list for this socket

    def connect(self, sock: Any, server_role: str) -> None:
        """Make `sock` (before it connects) a CURVE client of this role expecting a `server_role` peer."""
        if self.trust is None:
            return
        sock.curve_serverkey = self.trust.peer_key(server_role)
        sock.curve_publickey = self.trust.curve_public
        sock.curve_secretkey = self.trust.curve_secret

    def sender_role(self, frame: zmq.Frame) -> str | None:
        """The role that sent `frame` (received with copy=False on a served socket); None when insecure."""
        if self.trust is None:
            return None
        return frame.get("User-Id")


def plane_for(cfg: Any, role: str) -> Plane:
    """The plane of a service of `role` from its config (ServiceConfig's --trust-dir and
    --insecure-internal-planes). Raises TrustError (its message says what to do) when neither is given."""
    if cfg.insecure_internal_planes:
        log.warning("--insecure-internal-planes: ZeroMQ sockets accept anyone; any local process can inject, "
                    "abort or read requests")
        return Plane.insecure()
    if not cfg.trust_dir:
        raise TrustError(MISSING_TRUST)
    return Plane.load(cfg.trust_dir, role)


def plane_or_exit(cfg: Any, role: str) -> Plane:
    """plane_for for a service's main(): missing or unreadable trust material logs its one-line
    reason and exits 2, as a bad flag does (kvmesh serve's supervisor does not restart exit 2)."""
    try:
        return plane_for(cfg, role)
    except TrustError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None


class _ZapResponder(threading.Thread):
    """Answers libzmq's ZAP requests for every CURVE server socket of this process.

    A request is [version, request id, domain, address, identity, mechanism, client public key]; the
    domain is the socket's allowed roles, comma-separated. The reply's User-Id is the client's role."""

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(name="zap", daemon=True)
        self.roles: dict[bytes, str] = {}            # raw 32-byte public key -> role
        self._lock = threading.Lock()
        self.refused = 0
        self._refusals = RateLimitedLog(log, "ZAP")
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)

    def learn(self, peers: dict[str, bytes]) -> None:
        with self._lock:
            self.roles.update({z85.decode(key): role for role, key in peers.items()})

    def run(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart()
            except zmq.ContextTerminated:
                return
            self._sock.send_multipart(self.answer(frames))

    def answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, _address, _identity, mechanism = frames[:6]
        key = frames[6] if mechanism == b"CURVE" and len(frames) > 6 else b""
        with self._lock:
            role = self.roles.get(key)
        allowed = domain.decode(errors="replace").split(",")
        if role is not None and role in allowed:
            return [version, request_id, b"200", b"OK", role.encode(), b""]
        self.refused += 1
        self._refusals.warn("refused a %s client (%s) on a socket open to %s",
                            mechanism.decode(errors="replace"), f"role {role}" if role else "unknown key",
                            ", ".join(allowed))
        return [version, request_id, b"400", b"not allowed", b"", b""]


_lock = threading.Lock()
_zap: _ZapResponder | None = None


def _responder() -> _ZapResponder:
    global _zap
    with _lock:
        if _zap is None:
            _zap = _ZapResponder(zmq.Context.instance())
            _zap.start()
        return _zap
