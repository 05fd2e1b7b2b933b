"""Lease fencing with real processes: a worker paused (SIGSTOP) past its lease is failed by the
scheduler, and when it wakes it rejoins as a new epoch and drops the old epoch's work instead of
generating it for clients that were already told it failed. A restarted worker with the same
--worker-id (what `kvmesh serve` does) is a new incarnation too.

Its own stack (the worker is paused and killed): embedded Redis, tokenizer (with a metrics page:
the detokenizer's dropped-token counter is the witness), scheduler, prefix-cache index (its
metrics show it resynced the rejoined worker's kept cache), one tiny CPU worker, gateway.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import free_port
from tests.integration.stack import FAST, INTERNAL, records, redis_and_procs, wait_for, wait_ready

WORKER = "w-lease"
STREAMS = 4
LEASE_S = 1.5          # FAST's --lease-ms


@pytest.fixture(scope="module")
def lease_stack(tiny_model, tmp_path_factory):
    port = free_port()
    logs = tmp_path_factory.mktemp("lease-logs")
    with redis_and_procs(logs) as (redis, procs):
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "0", "--model", tiny_model)
        # --migration-wait-s 0: the paused worker's requests fail once its lease lapses, instead of
        # waiting for a worker (the same one, rejoining): what reaches the clients is then fixed
        procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", "-1", "--migration-wait-s", "0")
        procs.start("prefix-cache", "prefix-cache", *FAST, "--host", "127.0.0.1", "--port", "0",
                    "--metrics-port", "0")
        procs.start_worker(WORKER, tiny_model)
        procs.start("gateway", "gateway", *FAST, "--port", str(port), "--zmq-port", "0")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, 180)
        yield {"base": base, "procs": procs, "redis": redis.client_url, "model": Path(tiny_model).name,
               "model_dir": tiny_model, "logs": logs}


def worker_record(st):
    return next((r for r in records(st["redis"], "worker") if r.id == WORKER), None)


def scrape(st, kind: str) -> dict[str, float]:
    """A service's /metrics page: sample name with labels -> value."""
    [rec] = records(st["redis"], kind)
    text = httpx.get(rec.addrs["metrics"], timeout=5).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def dropped_tokens(st) -> dict[str, float]:
    """The tokenizer's kvmesh_detok_dropped_tokens_total, by reason."""
    page = scrape(st, "tokenizer")
    return {reason: page.get(f'kvmesh_detok_dropped_tokens_total{{reason="{reason}"}}', 0.0)
            for reason in ("stale_epoch", "no_stream")}


def index_blocks_of_worker(st) -> float:
    return scrape(st, "prefix-cache").get(f'kvmesh_prefix_worker_blocks{{worker="{WORKER}"}}', 0.0)


class Stream(threading.Thread):
    """One streamed completion read with httpx: every `data:` payload, in order."""

    def __init__(self, st, i: int) -> None:
        super().__init__(daemon=True)
        self.body = {"model": st["model"], "prompt": f"story {i} " * 30, "max_tokens": 1500, "temperature": 0,
                     "stream": True, "ignore_eos": True}
        self.url = st["base"] + "/v1/completions"
        self.events: list[str] = []
        self.started = threading.Event()   # the first token arrived: the worker is generating it

    def run(self) -> None:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", self.url, json=self.body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()


def test_a_worker_paused_past_its_lease_rejoins_with_a_new_epoch_and_drops_the_old_work(lease_stack):
    st = lease_stack
    first = wait_for(lambda: worker_record(st), 30, "the worker's record")
    pid = first.info["pid"]
    before = dropped_tokens(st)
    snapshots_before = scrape(st, "prefix-cache").get("kvmesh_prefix_snapshots_applied_total", 0.0)

    streams = [Stream(st, i) for i in range(STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60), "a stream never started"

    st["procs"].procs[WORKER].send_signal(signal.SIGSTOP)
    try:
        t_stop = time.monotonic()
        for s in streams:                  # failed by the scheduler once the lease ran out
            s.join(30)
            assert not s.is_alive(), "a stream was not ended while its worker was paused"
        failed_after = time.monotonic() - t_stop
        for s in streams:
            assert s.events[-1] == "[DONE]", s.events[-3:]
            assert json.loads(s.events[-2])["error"]["code"] == "worker_failed", s.events[-2]
        assert failed_after >= LEASE_S * 0.9, failed_after       # not before the lease lapsed
        assert worker_record(st) is None
    finally:
        st["procs"].procs[WORKER].send_signal(signal.SIGCONT)

    rejoined = wait_for(lambda: (r := worker_record(st)) and r.epoch > first.epoch and r, 20,
                        "the worker to rejoin with a new epoch")
    assert rejoined.info["pid"] == pid                  # the same process: a new incarnation of it
    # zero blocks in use and nothing held, as reported after its steps (every heartbeat)
    def no_block_in_use(r) -> bool:   # free + cached == total: used == 0
        return r.load["free_blocks"] + r.load["cached_blocks"] == r.load["total_blocks"]
    idle = wait_for(lambda: (r := worker_record(st)) and r.load.get("requests") == 0
                    and r.load.get("running") == 0 and no_block_in_use(r) and r,
                    10, "the rejoined worker to hold no request and no KV block")
    time.sleep(1.0)   # were the old requests still generating, tokens would keep arriving
    assert worker_record(st).load["tokens_out"] == idle.load["tokens_out"]
    after = dropped_tokens(st)
    assert after == before, f"tokens of the old epoch reached the detokenizer: {before} -> {after}"
    # the worker kept its cached prefix blocks; the index, which purged them when the lease
    # expired, takes them back from a snapshot of the new epoch
    assert idle.load["cached_blocks"] > 0
    wait_for(lambda: index_blocks_of_worker(st) == worker_record(st).load["cached_blocks"], 10,
             "the prefix index to resync the rejoined worker's cache")
    # (whether the index saw the lease expire first or the new epoch first, it asked for a snapshot)
    assert scrape(st, "prefix-cache")["kvmesh_prefix_snapshots_applied_total"] > snapshots_before
    log = (st["logs"] / f"{WORKER}.log").read_text(errors="replace")
    assert f"the lease of epoch {first.epoch} lapsed; serving as epoch {rejoined.epoch}, " \
           f"dropped its {STREAMS} requests" in log

    # the new incarnation serves a new request correctly (the official client)
    import openai
    client = openai.OpenAI(base_url=st["base"] + "/v1", api_key="none", timeout=60, max_retries=0)
    wait_ready(st["base"], 10)
    r = client.completions.create(model=st["model"], prompt="hello again", max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    wait_for(lambda: worker_record(st).load.get("requests_total", 0) >= 1 + STREAMS, 5,
             "the worker to count the new request")


def test_a_restarted_worker_with_the_same_id_is_a_new_incarnation(lease_stack):
    """`kvmesh serve` restarts a dead worker with the same --worker-id: it takes the next epoch,
    and the scheduler serves through it."""
    st = lease_stack
    old = wait_for(lambda: worker_record(st), 30, "the worker's record")
    st["procs"].kill(WORKER)
    st["procs"].start_worker(WORKER, st["model_dir"])
    new = wait_for(lambda: (r := worker_record(st)) and r.epoch > old.epoch and r, 120,
                   "the restarted worker to register")
    assert new.info["pid"] != old.info["pid"]
    wait_ready(st["base"], 30)
    r = httpx.post(st["base"] + "/v1/completions", timeout=60,
                   json={"model": st["model"], "prompt": "after restart", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
