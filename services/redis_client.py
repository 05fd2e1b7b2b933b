"""The one way services open Redis: redis.asyncio with timeouts, and commands that finish before
a cancellation lands.

    r = redis_client.connect(url, RedisAuth.of(trust))
    # then the usual redis.asyncio API, pipelines and scripts too

Authentication: a password in the URL (`redis://:PASSWORD@host:port/0`, for an external Redis whose
password is not the trust directory's) wins; otherwise the trust directory's `redis.password`;
with neither (--insecure-internal-planes) no AUTH is sent. `rediss://` URLs use TLS and check the
server's certificate against the system store plus the trust directory's CA (an external Redis
with a public certificate, or one whose certificate the trust CA signed, both work); a
`ssl_ca_certs=PATH` query parameter in the URL adds that CA file.

Why: with redis-py 8.1 on Python 3.11, cancelling a task in the middle of a command can leave it
waiting forever inside the client's send path (with the plain client, the loop in
tests/services/test_redis_client.py hangs within a few cancellations). Services cancel their loops
on SIGTERM, so a loop cancelled in the middle of a heartbeat hung the whole shutdown (a
prefix-cache polling Redis every millisecond hung in 12 of 20 SIGTERMs). Here each command (or
pipeline) runs as its own task; cancelling the caller waits for that command to end (bounded by
the socket timeouts, in practice a millisecond) and then raises CancelledError as usual.
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Awaitable, NamedTuple, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline as _Pipeline

from services.security.bundle import Paths, Trust

T = TypeVar("T")

SOCKET_TIMEOUT_S = 5.0


async def finish_then_cancel(aw: Awaitable[T]) -> T:
    """Await `aw` in its own task; a cancellation of the caller is held until that task is done."""
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved: the caller is cancelled, the command's own error is moot
        raise


class Pipeline(_Pipeline):
    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        return await finish_then_cancel(super().execute(raise_on_error))


class Redis(aioredis.Redis):
    async def execute_command(self, *args: Any, **options: Any) -> Any:
        return await finish_then_cancel(super().execute_command(*args, **options))

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        return Pipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


class RedisAuth(NamedTuple):
    """How to authenticate to Redis: the trust directory's password and CA (PEM text)."""

    password: str
    ca_pem: str

    @classmethod
    def of(cls, trust: Trust | None) -> "RedisAuth | None":
        return None if trust is None else cls(trust.redis_password, trust.ca_cert.decode())

    @classmethod
    def from_dir(cls, root: str | os.PathLike) -> "RedisAuth":
        """From a trust directory's files (what the launcher, which holds no role, reads)."""
        paths = Paths(Path(root))
        return cls(paths.redis_password.read_text().strip(), paths.ca_cert.read_text())


def connect(url: str, auth: RedisAuth | None, timeout_s: float = SOCKET_TIMEOUT_S) -> Redis:
    """A client for `url` that authenticates as above; `auth` None: no password, no extra CA."""
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if auth is not None:
        if not urlsplit(url).password:
            options["password"] = auth.password
        if url.startswith("rediss://"):
            options["ssl_ca_data"] = auth.ca_pem
    return Redis.from_url(url, **options)
