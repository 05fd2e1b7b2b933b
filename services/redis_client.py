"""The one way services open Redis: redis.asyncio with timeouts, and commands that finish before
a cancellation lands.

    r = redis_client.connect(url)   # then the usual redis.asyncio API, pipelines and scripts too

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
from typing import Any, Awaitable, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline as _Pipeline

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


def connect(url: str, timeout_s: float = SOCKET_TIMEOUT_S) -> Redis:
    return Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
