"""services.redis_client against a real (embedded) Redis: a task cancelled in the middle of a
command or pipeline ends promptly and leaves the client usable. With a plain redis.asyncio client
(redis-py 8.1, Python 3.11) this loop hangs within its first few cancellations."""
from __future__ import annotations

import asyncio
import random

import pytest

from services import redis_client
from services.embedded_redis import EmbeddedRedis


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as r:
        yield r.url


async def _hammer(r: redis_client.Redis) -> None:
    script = r.register_script("return redis.call('INCR', KEYS[1])")
    while True:
        await r.smembers("members")
        await r.mget(["a", "b"])
        await script(keys=["epoch"])
        pipe = r.pipeline(transaction=False)
        pipe.sadd("members", "x").incr("n")
        await pipe.execute()


async def test_cancelling_mid_command_neither_hangs_nor_breaks_the_client(redis_url):
    r = redis_client.connect(redis_url, None)
    rng = random.Random(7)
    try:
        for _ in range(150):
            task = asyncio.create_task(_hammer(r))
            await asyncio.sleep(rng.random() * 0.005)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=2.0)
            assert done and task.cancelled(), "a cancelled Redis loop did not end"
            assert await asyncio.wait_for(r.set("k", "v"), 2.0)
        assert int(await r.get("n")) > 0
    finally:
        await r.aclose()


async def test_a_command_error_still_reaches_the_caller(redis_url):
    r = redis_client.connect(redis_url, None)
    try:
        await r.set("text", "not a number")
        with pytest.raises(Exception, match="not an integer"):
            await r.incr("text")
        pipe = r.pipeline(transaction=False)
        pipe.incr("text")
        with pytest.raises(Exception, match="not an integer"):
            await pipe.execute()
    finally:
        await r.aclose()
