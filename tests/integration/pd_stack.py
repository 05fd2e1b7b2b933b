"""Test helper: a disaggregated stack of real processes (embedded Redis, tokenizer, scheduler,
prefix-cache index, prefill and decode workers, gateway) and what the tests read from it."""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.ports import free_port
from tests.integration.stack import FAST, INTERNAL, Procs, records, redis_and_procs, wait_for, wait_ready

PD_MIN_PREFILL_TOKENS = 48      # the tiny model's prompts: above it P/D, below it D alone
CHUNK = 32                      # P's max_num_batched_tokens: longer prompts prefill in chunks
NUM_BLOCKS = 256


@dataclass
class PDStack:
    procs: Procs
    redis_url: str
    model: str
    base_url: str
    scheduler_metrics: str

    def openai(self):
        import openai
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="none", timeout=60, max_retries=0)

    def load(self, worker_id: str) -> dict:
        rec = next((r for r in records(self.redis_url, "worker") if r.id == worker_id), None)
        return {} if rec is None else rec.load

    def record(self, worker_id: str):
        return next((r for r in records(self.redis_url, "worker") if r.id == worker_id), None)

    def worker_metric(self, worker_id: str, name: str, labels: str = "") -> float:
        return metric(self.record(worker_id).addrs["metrics"], name, labels)

    def route_count(self, route: str) -> float:
        return metric(self.scheduler_metrics, "kvmesh_scheduler_pd_routes_total", f'route="{route}"')

    def no_blocks_held(self, worker_id: str) -> bool:
        """Every KV block of the worker is free or cached (nothing held for a request or a hand-off)."""
        load = self.load(worker_id)
        return bool(load) and load["requests"] == 0 and \
            load["free_blocks"] + load["cached_blocks"] == load["total_blocks"]


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url, timeout=5).text
    pattern = re.escape(name) + (r"\{[^}]*" + re.escape(labels) + r"[^}]*\}" if labels else r"(?:\{\})?")
    m = re.search(r"^" + pattern + r" (?P<value>\S+)$", text, re.MULTILINE)
    return float(m.group("value")) if m else 0.0


@contextmanager
def pd_stack(model: str, logs: Path, prefill_extra: tuple[str, ...] = (), decode_extra: tuple[str, ...] = (),
             lease_ms: int = 2000):
    """One prefill worker (prefill-0, chunked prefill) and one decode worker (decode-0)."""
    port, sched_metrics = free_port(), free_port()
    with redis_and_procs(logs) as (redis, procs):
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", model)
        procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", str(sched_metrics),
                    "--pd-min-prefill-tokens", str(PD_MIN_PREFILL_TOKENS))
        procs.start("prefix-cache", "prefix-cache", *FAST, "--host", "127.0.0.1", "--port", "0",
                    "--metrics-port", "-1")
        handoff = ("--handoff-lease-ms", str(lease_ms), "--metrics-port", "0", "--num-gpu-blocks", str(NUM_BLOCKS))
        procs.start_worker("prefill-0", model, "--role", "prefill", "--max-num-batched-tokens", str(CHUNK),
                           *handoff, *prefill_extra)
        procs.start_worker("decode-0", model, "--role", "decode", *handoff, *decode_extra)
        procs.start("gateway", "gateway", *FAST, "--port", str(port), "--zmq-port", "0")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, 180, procs)
        stack = PDStack(procs, redis.client_url, model, base, f"http://127.0.0.1:{sched_metrics}/metrics")
        wait_for(lambda: metric(stack.scheduler_metrics, "kvmesh_scheduler_workers") == 2, 60,
                 "the scheduler to see both workers")
        wait_for(lambda: [r.load.get("workers") for r in records(redis.client_url, "prefix-cache")] == [2], 60,
                 "the prefix-cache index to follow both workers")
        yield stack
