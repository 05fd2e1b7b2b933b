"""Worker faults on a stack of its own: 2 null-model workers (a sample's token at output position p
is a function of its prompt's length, its index and p, wherever it is drawn), the tokenizer
service, and a gateway that makes its text itself (--text-in-gateway).

  drain          SIGTERM on a worker with streams in flight, through the official openai client:
                 those that fit in the grace end there, the rest move, and no request fails.
  gateway stop   SIGTERM on a gateway: new requests get 503 at once, the stream in flight ends whole.

The load with every fault at once (800 streaming requests through a kill -9, a drain, a Redis
restart and a scheduler restart, through both text paths) is `kvmesh bench chaos`, run in CI by
tests/services/bench/test_bench_chaos.py.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.integration.conftest import free_port
from tests.integration.stack import FAST, INTERNAL, records, redis_and_procs, wait_for, wait_ready

STEP_MS = 20            # the null model's step: 50 tokens/s per sequence
WORKERS = [f"chaos-{i}" for i in range(2)]   # where the drained streams move


def null_worker(procs, name: str, model: str, grace_s: float) -> None:
    procs.start(name, "worker", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", model, "--null-model",
                "--null-step-ms", str(STEP_MS), "--max-num-seqs", "32", "--num-gpu-blocks", "2048",
                "--worker-id", name, "--drain-grace-s", str(grace_s))


@pytest.fixture(scope="module")
def chaos(tiny_model, tmp_path_factory):
    local_port, sched_metrics = free_port(), free_port()
    with redis_and_procs(tmp_path_factory.mktemp("chaos-logs")) as (redis, procs):
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", tiny_model)
        procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", str(sched_metrics),
                    "--routing", "least_loaded")
        for name in WORKERS:
            null_worker(procs, name, tiny_model, grace_s=0.2)
        procs.start("gateway-local", "gateway", *FAST, "--port", str(local_port), "--zmq-port", "0",
                    "--text-in-gateway", "--model", tiny_model)
        local = f"http://127.0.0.1:{local_port}"
        wait_ready(local, 120)
        wait_for(lambda: len(records(redis.client_url, "worker")) == len(WORKERS), 60, "every worker to register")
        yield {"local": local, "procs": procs, "redis": redis.client_url, "model_dir": tiny_model,
               "model": os.path.basename(tiny_model), "scheduler_metrics": f"http://127.0.0.1:{sched_metrics}/metrics"}


def scheduler_metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url, timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def worker_records(redis_url: str) -> dict:
    return {r.id: r for r in records(redis_url, "worker")}


def wait_idle_and_whole(redis_url: str, alive: set[str]) -> None:
    """The live workers hold no request and every KV block is free (the null engine caches none):
    free + cached + used == total with used == 0; the gone workers' leases are gone."""
    def settled() -> bool:
        recs = worker_records(redis_url)
        return set(recs) == alive and all(
            r.load.get("requests") == 0 and r.load.get("free_blocks") == r.load.get("total_blocks") > 0
            for r in recs.values())
    wait_for(settled, 15, f"only {sorted(alive)} registered, idle, every KV block free")


def test_sigterm_with_streams_in_flight_fails_no_request(chaos):
    """Through the gateway that makes its own text: a worker draining for 1 s while streams of 8 and
    400 tokens run on it; those that fit end there, the others move to the workers left.

    Every stream runs on the drainer, whatever the load elsewhere: they all name one conversation
    (OpenAI `user`), which the scheduler keeps on the worker of its first turn, and that first turn
    (the healthy reference) goes to the drainer because least_loaded breaks the tie between idle
    workers by worker id ("a-drainer" sorts first). Routed by load alone, 12 streams over 3 to 5
    workers left the drainer fewer than two long ones often enough to fail on slow machines."""
    procs, model, drainer = chaos["procs"], chaos["model"], "a-drainer"
    null_worker(procs, drainer, chaos["model_dir"], grace_s=1.0)
    wait_for(lambda: drainer in worker_records(chaos["redis"]), 60, "the drainer to register")
    wait_idle_and_whole(chaos["redis"], set(worker_records(chaos["redis"])))
    # the scheduler polls the registry every heartbeat / 2: let it see the drainer before the first turn
    wait_for(lambda: f'worker="{drainer}"' in httpx.get(chaos["scheduler_metrics"], timeout=5).text, 30,
             "the scheduler to know the drainer")
    client = openai.OpenAI(base_url=chaos["local"] + "/v1", api_key="none", timeout=60, max_retries=0)
    before_dispatched = scheduler_metric(chaos["scheduler_metrics"], "kvmesh_scheduler_dispatched_total",
                                         worker=drainer)
    healthy = {m: client.completions.create(model=model, prompt="drain me", max_tokens=m, temperature=0,
                                            user="drain").choices[0].text
               for m in (8, 400)}
    dispatched = scheduler_metric(chaos["scheduler_metrics"], "kvmesh_scheduler_dispatched_total", worker=drainer)
    assert dispatched - before_dispatched == 2, "the conversation's first turns did not run on the drainer"
    results: dict[int, dict] = {}

    def one(i: int) -> None:
        max_tokens, out = (8, 400)[i % 2], {"text": "", "finish": None, "error": None}
        try:
            for chunk in client.completions.create(model=model, prompt="drain me", max_tokens=max_tokens,
                                                   temperature=0.7, seed=i, stream=True, user="drain"):
                out["text"] += chunk.choices[0].text
                out["finish"] = chunk.choices[0].finish_reason or out["finish"]
        except openai.APIError as exc:
            out["error"] = exc
        results[i] = out

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    # the 6 long streams (8 s each) are all there at some heartbeat of the drainer
    wait_for(lambda: worker_records(chaos["redis"])[drainer].load.get("requests", 0) >= 6, 30,
             "the long streams to run on the drainer")
    before = scheduler_metric(chaos["scheduler_metrics"], "kvmesh_scheduler_migrations_total", reason="drain")
    procs.procs[drainer].send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert procs.procs.pop(drainer).wait(30) == 0
    assert len(results) == 12 and not [r["error"] for r in results.values() if r["error"] is not None]
    for i, r in results.items():
        assert r["finish"] == "length" and r["text"] == healthy[(8, 400)[i % 2]], (i, r)
    moved = scheduler_metric(chaos["scheduler_metrics"], "kvmesh_scheduler_migrations_total", reason="drain") - before
    assert moved > 0, "no stream outlived the grace: lengthen them"
    live = {r.id for r in records(chaos["redis"], "worker")}
    assert drainer not in live
    wait_idle_and_whole(chaos["redis"], live)


def test_a_stopping_gateway_lets_its_streams_finish_and_refuses_new_requests(chaos):
    """SIGTERM on a gateway: /ready and new requests answer 503 at once, the stream in flight ends
    whole within --shutdown-grace-s, and the process exits as soon as it has."""
    procs, model, port = chaos["procs"], chaos["model"], free_port()
    gateway = procs.start("gateway-stop", "gateway", *FAST, "--port", str(port), "--zmq-port", "0",
                          "--shutdown-grace-s", "20")
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, 60)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)
    whole = client.completions.create(model=model, prompt="stop me", max_tokens=100, temperature=0).choices[0].text
    text, finish = "", None
    stream = client.completions.create(model=model, prompt="stop me", max_tokens=100, temperature=0, stream=True)
    for chunk in stream:                      # ~2 s of tokens: SIGTERM after the first
        if not text and chunk.choices[0].text:
            gateway.send_signal(signal.SIGTERM)
            t_term = time.monotonic()
            wait_for(lambda: httpx.get(base + "/ready", timeout=2).status_code == 503, 2, "/ready to answer 503")
            refused = httpx.post(base + "/v1/completions", json={"model": model, "prompt": "late", "max_tokens": 2},
                                 timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutdown", refused.text
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert (text, finish) == (whole, "length")
    # uvicorn re-raises the SIGTERM it caught once its shutdown is done
    assert procs.procs.pop("gateway-stop").wait(15) in (0, -signal.SIGTERM)
    assert time.monotonic() - t_term < 15
