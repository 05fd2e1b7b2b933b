"""The gateway's HTTP connections: read timeouts for headers and bodies, and a connection limit.

uvicorn bounds a keep-alive connection's idle time, and nothing else: a client that connects and
sends nothing, or half its headers, or half its body, holds its connection (and the request's
buffer) forever. Read timeouts belong where the bytes arrive, in the protocol, as Node's
`headersTimeout`/`requestTimeout` and nginx's `client_header_timeout`/`client_body_timeout` do:

    connect ──── headers complete ──── body complete ──── response ──── next request's first byte
    |<- header_timeout_s ->|<--- body_timeout_s --->|                   |<- header_timeout_s ...
                                                                 (uvicorn's keep-alive timeout)

A read that misses its deadline gets `408` with `connection: close`, and the connection closes;
the request's handler sees a disconnect (services/gateway/disconnects.py logs it in one line).
The URL and headers are bounded in size too (MAX_HEADER_BYTES; beyond: 431, closed): the parser
has no limit of its own, and the header deadline alone would let a fast client send gigabytes.

Past `max_connections` open connections, a request is answered 503 (an OpenAI-shaped body,
`Retry-After`) and its connection closed, like uvicorn's `limit_concurrency` but counted in
connections only: the handlers of the requests already admitted are not what is scarce; file
descriptors and the buffers of slow clients are.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any, NamedTuple

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("kvmesh.gateway")


class ConnectionLimits(NamedTuple):
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


MAX_HEADER_BYTES = 64 * 1024   # the URL and every header name and value together (nginx allows 4 x 8 KiB)
BODY_TIMEOUT_KEY = "kvmesh.body_timeout_s"   # set in a request's scope when its body missed its deadline
REFUSAL_LOG_PERIOD_S = 5.0                  # a burst of refusals is logged as one line per period


def _error_body(message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


def _raw_response(status: bytes, message: str, code: str) -> bytes:
    """A whole response as bytes, for where no ASGI cycle exists yet (the request is incomplete)."""
    body = _error_body(message, "invalid_request_error", code)
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class _HeadersTooLarge(Exception):
    """Raised in a parser callback to stop parsing; uvicorn then calls send_400_response."""


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the read deadlines and connection limit above."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._reading = ""            # what the armed deadline waits for: "headers" or "body"
        self._header_bytes = 0        # of the request being read (MAX_HEADER_BYTES)
        self._headers_too_large = False

    # -- deadlines ------------------------------------------------------------------------------
    def _arm(self, reading: str, seconds: float) -> None:
        self._disarm()
        self._reading = reading
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if self._reading == "body" else None
        seconds = self.limits.body_timeout_s if cycle is not None else self.limits.header_timeout_s
        if cycle is None:
            log.info("closed the connection of %s: its request's headers did not arrive within %g s (408)",
                     _peer(self.client), seconds)
        else:   # the handler waiting for the body sees a disconnect; disconnects.py logs the line
            cycle.scope[BODY_TIMEOUT_KEY] = seconds  # type: ignore[literal-required]
        if cycle is None or not cycle.response_started:
            self.transport.write(_raw_response(b"408 Request Timeout", f"the request's {self._reading} did not "
                                               f"arrive within {seconds:g} s", "request_timeout"))
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    # -- uvicorn's protocol callbacks -------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            # answered after its headers arrive (a reply before the request could reach a client as
            # a reset); the header deadline still bounds how long that may take
            self.app = self._refuse
        self._arm("headers", self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        if self._deadline is None:    # a keep-alive connection's next request: its first byte
            self._arm("headers", self.limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        super().on_header(name, value)

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES:
            self._headers_too_large = True
            raise _HeadersTooLarge

    def send_400_response(self, msg: str) -> None:
        if not self._headers_too_large:
            super().send_400_response(msg)
            return
        log.info("closed the connection of %s: its request's headers are over %d bytes (431)",
                 _peer(self.client), MAX_HEADER_BYTES)
        self.transport.write(_raw_response(b"431 Request Header Fields Too Large", "the request's URL and "
                                           f"headers are over {MAX_HEADER_BYTES} bytes", "headers_too_large"))
        self.transport.close()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm("body", self.limits.body_timeout_s)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        _refusals.note(len(self.connections), self.limits.max_connections)
        body = _error_body("the server has too many open connections; retry later", "server_error",
                           "too_many_connections")
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _RefusalLog:
    """One warning per REFUSAL_LOG_PERIOD_S however many requests a burst brings."""

    def __init__(self) -> None:
        self.unlogged, self.logged_at = 0, float("-inf")

    def note(self, open_now: int, limit: int) -> None:
        self.unlogged += 1
        now = asyncio.get_running_loop().time()
        if now - self.logged_at >= REFUSAL_LOG_PERIOD_S:
            log.warning("refused %d request(s) with 503: %d connections open, --max-connections is %d",
                        self.unlogged, open_now, limit)
            self.unlogged, self.logged_at = 0, now


_refusals = _RefusalLog()


def ensure_fd_room(max_connections: int, spare: int = 256) -> None:
    """Raise the open-file limit to fit max_connections sockets (plus `spare` for everything else),
    or warn: past the limit accept() fails, and clients see resets instead of the 503."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + spare
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        if raised < need:
            log.warning("--max-connections %d needs %d open files; the limit is %d (ulimit -n): lower "
                        "--max-connections or raise the limit", max_connections, need, raised)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
