"""`kvmesh prefix-cache` as a real process: flags, registry record, Match over gRPC, /metrics, SIGTERM."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
from prefix_fakes import FakeBlockManager, planes

from gpu_worker.kv_events import KVEventPublisher
from services.prefix_client import PrefixClient
from services.embedded_redis import EmbeddedRedis
from services.redis_client import RedisAuth
from services.registry import Registry
from services.security import bundle

BS = 4
PROMPT = list(range(1, 21))


@pytest.mark.slow
async def test_prefix_cache_process():
    auth = RedisAuth.from_dir(planes().trust_dir)   # the service authenticates with the trust directory's
    with EmbeddedRedis(password=auth.password) as redis_server:
        reg = Registry(redis_server.url, auth)
        bm = FakeBlockManager(BS)
        pub = KVEventPublisher(bm, "w1", plane=planes().worker, heartbeat_s=0.05)
        lease = await reg.register("worker", "w1", lease_ms=3000, info={"block_size": BS},
                                   addrs={"kv_events": pub.events_addr, "kv_snapshot": pub.snapshot_addr})
        pub.set_epoch(lease.epoch)
        # stderr to a file, not a pipe nobody reads: a full pipe would block the service's logging
        err = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "prefix-cache", "--redis-url", redis_server.url,
             "--port", "0", "--metrics-port", "0", "--block-size", str(BS), "--discovery-interval-s", "0.1",
             "--trust-dir", str(planes().trust_dir)],
            stderr=err, text=True)

        def log_tail() -> str:
            err.seek(0)
            return err.read()[-6000:]

        try:
            bm.store_prompt(PROMPT)
            deadline = time.monotonic() + 20
            record, best = None, 0
            while best < 5:
                assert time.monotonic() < deadline and proc.poll() is None, f"the service did not answer:\n{log_tail()}"
                pub.flush()
                await lease.renew()
                records = await reg.list("prefix-cache")
                if records and record is None:
                    record = records[0]
                    client = PrefixClient(record.addrs["grpc"], bundle.load(planes().trust_dir, "scheduler"), timeout_s=1.0)
                if record is not None:
                    best = (await client.match("m", PROMPT)).best_blocks
                await asyncio.sleep(0.02)
            text = urllib.request.urlopen(record.addrs["metrics"], timeout=5).read().decode()
            assert 'kvmesh_prefix_worker_blocks{worker="w1"} 5.0' in text
            await client.close()
            proc.send_signal(signal.SIGTERM)
            try:   # past its 8 s stop deadline the service prints its stacks and exits 1
                code = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGUSR1)   # faulthandler: every thread's stack
                time.sleep(1)
                code = None
            assert code == 0, f"exit {code} after SIGTERM:\n{log_tail()}"
            assert await reg.list("prefix-cache") == []   # lease released on a clean stop
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.close()
            pub.close()
            await reg.close()


@pytest.mark.slow
def test_sigterm_while_loops_are_inside_redis_commands():
    """Registry reads every millisecond, so SIGTERM lands in the middle of a Redis command. Before
    services/redis_client.py this hung the shutdown in 12 of 20 tries."""
    with EmbeddedRedis() as redis_server:
        for _ in range(3):
            with tempfile.TemporaryFile(mode="w+") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "services.cli", "prefix-cache", "--redis-url", redis_server.url,
                     "--port", "0", "--metrics-port", "0", "--block-size", str(BS),
                     "--discovery-interval-s", "0.001", "--insecure-internal-planes"], stderr=err, text=True)
                try:
                    deadline = time.monotonic() + 30
                    while not asyncio.run(_registered(redis_server.url)):   # started, however slow CI is
                        assert time.monotonic() < deadline and proc.poll() is None, "the service did not start"
                        time.sleep(0.1)
                    time.sleep(0.5)   # its loops now poll Redis
                    proc.send_signal(signal.SIGTERM)
                    code = proc.wait(timeout=15)
                    err.seek(0)
                    assert code == 0, err.read()[-6000:]
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()


async def _registered(url: str) -> bool:
    reg = Registry(url, None)
    try:
        return bool(await reg.list("prefix-cache"))
    finally:
        await reg.close()
