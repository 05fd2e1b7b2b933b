"""The prefix-cache index under faults, as real processes with a real Redis and two tiny CPU workers:
killing the index mid-run never fails a request (routing falls back to load) and a restarted index
reloads from Redis and answers hits again; a killed worker's blocks leave the index within its lease."""
from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import httpx
import pytest
import redis as redis_lib

from services.prefix_client import PrefixClient
from services.security import bundle
from tests.integration.conftest import free_port
from tests.integration.stack import FAST, INTERNAL, Procs, records, redis_and_procs, wait_for, wait_ready

LEASE_S = 1.5          # FAST's --lease-ms
GROUPS = 4
SYSTEM_LEN = 64        # tokens shared by a group: 4 blocks of 16


def system_prompt(group: int) -> list[int]:
    return [3 + (i * 7 + group * 131) % 1000 for i in range(SYSTEM_LEN)]


def prompt(group: int, n: int) -> list[int]:
    return system_prompt(group) + [3 + (n * 17 + k) % 1000 for k in range(16)]


@pytest.fixture(scope="module")
def pc(tiny_model, tmp_path_factory):
    port = free_port()
    with redis_and_procs(tmp_path_factory.mktemp("prefix-logs")) as (redis, procs):
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", tiny_model)
        procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", "0")
        start_index(procs)
        procs.start_worker("worker-0", tiny_model)
        procs.start_worker("worker-1", tiny_model)
        procs.start("gateway", "gateway", *FAST, "--port", str(port), "--zmq-port", "0")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, 60)
        wait_for(lambda: len(records(redis.client_url, "worker")) == 2, 30, "two workers")
        yield {"base": base, "procs": procs, "redis_url": redis.client_url, "model": tiny_model.rsplit("/", 1)[-1],
               "trust": bundle.load(procs.trust_dir, "scheduler")}


def start_index(procs: Procs):
    return procs.start("prefix-cache", "prefix-cache", *FAST, "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "-1", "--discovery-interval-s", "0.25")


def complete(pc, group: int, n: int) -> None:
    r = httpx.post(pc["base"] + "/v1/completions", timeout=30,
                   json={"model": pc["model"], "prompt": prompt(group, n), "max_tokens": 2})
    r.raise_for_status()


def matches(pc, pid: int | None = None) -> dict[int, list[str]]:
    """group -> workers holding its system prompt, asked of the live index (of process `pid`) with
    the scheduler's certificate (Match answers only schedulers)."""
    redis_url = pc["redis_url"]
    recs = [r for r in records(redis_url, "prefix-cache") if pid is None or r.id.endswith(f"-{pid}")]
    [worker, *_] = records(redis_url, "worker")
    if not recs:
        return {}

    async def ask() -> dict[int, list[str]]:
        client = PrefixClient(recs[0].addrs["grpc"], pc["trust"], timeout_s=1.0)
        try:
            out = {}
            for g in range(GROUPS):
                m = await client.match(worker.info["model_id"], prompt(g, 0))
                out[g] = [w.worker_id for w in m.workers if w.matched_blocks >= SYSTEM_LEN // 16]
            return out
        finally:
            await client.close()
    return asyncio.run(ask())


def scheduler_metric(redis_url: str, pattern: str) -> float:
    [sched] = records(redis_url, "scheduler")
    m = re.search("^" + pattern + r" (\S+)$", httpx.get(sched.addrs["metrics"], timeout=5).text, re.M)
    return float(m.group(1)) if m else 0.0


def scheduler_hits(redis_url: str) -> float:
    return scheduler_metric(redis_url, r'kvmesh_scheduler_prefix_matches_total\{outcome="hit"\}')


class Load(threading.Thread):
    """Two clients sending grouped prompts until stopped; counts successes and keeps every failure."""

    def __init__(self, pc) -> None:
        super().__init__(daemon=True)
        self.pc, self.stop, self.ok, self.errors = pc, threading.Event(), 0, []

    def run(self) -> None:
        def client(k: int) -> None:
            n = k
            while not self.stop.is_set():
                n += 2
                try:
                    complete(self.pc, n % GROUPS, n)
                    self.ok += 1
                except Exception as exc:
                    self.errors.append(repr(exc))
        threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def test_index_restart_mid_run_fails_open_and_reloads_from_redis(pc):
    procs, redis_url = pc["procs"], pc["redis_url"]
    load = Load(pc)
    load.start()
    try:
        wait_for(lambda: scheduler_hits(redis_url) > 0, 20, "the scheduler routing on prefix hits")
        wait_for(lambda: all(matches(pc).values()), 10, "every group's prompt in the index")
        procs.kill("prefix-cache", signal.SIGKILL)
        served = load.ok
        wait_for(lambda: not records(redis_url, "prefix-cache"), 5, "the dead index's lease to expire")
        wait_for(lambda: load.ok >= served + 8, 20, "requests served while the index is down")
        # the scheduler met the dead index (fail open: routed by load) before its record expired
        assert scheduler_metric(redis_url, r'kvmesh_scheduler_prefix_matches_total\{outcome="unavailable"\}') > 0
        index = start_index(procs)
        wait_for(lambda: matches(pc, index.pid), 20, "the restarted index")
        log = (procs.log_dir / "prefix-cache.log").read_text()
        reloaded = [int(n) for n in re.findall(r"reloaded (\d+) block copies", log)]
        assert len(reloaded) == 2 and reloaded[-1] > 0, reloaded     # warm from Redis, not empty
        assert all(matches(pc, index.pid).values())
        hits = scheduler_hits(redis_url)
        wait_for(lambda: scheduler_hits(redis_url) > hits, 20, "prefix hits routed through the new index")
    finally:
        load.stop.set()
        load.join(30)
    assert not load.errors, load.errors[:5]
    assert load.ok > 20


def test_killed_workers_blocks_leave_the_index_within_its_lease(pc):
    redis_url = pc["redis_url"]
    for g in range(GROUPS):
        for n in range(3):
            complete(pc, g, 100 + n)
    held = wait_for(lambda: (m := matches(pc)) and all(m.values()) and m, 10, "the groups in the index")
    victim = held[0][0]
    pc["procs"].kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: not any(victim in ws for ws in matches(pc).values()), 10,
             f"{victim}'s blocks to leave the index")
    gone_after = time.monotonic() - t0
    # the lease lapses after LEASE_S; the index reads the registry every 0.25 s
    assert gone_after < LEASE_S + 1.0, gone_after
    r = redis_lib.Redis.from_url(redis_url)
    try:
        wait_for(lambda: victim.encode() not in r.smembers("kvmesh:pc:workers"), 5, "the ownership records purged")
        assert not list(r.scan_iter(f"kvmesh:pc:w:{victim}:*"))
    finally:
        r.close()
    wait_for(lambda: scheduler_metric(redis_url, "kvmesh_scheduler_workers") == 1, 10, "the scheduler to drop it")
    for g in range(GROUPS):              # the survivor serves every group
        complete(pc, g, 200)
