"""Worker faults under load, on a stack of its own: 4 null-model workers (a sample's token at output
position p is a function of its prompt's length, its index and p, wherever it is drawn), the
tokenizer service's text path and a gateway that makes its text itself (--text-in-gateway).

  chaos   a steady stream of 800 short streaming requests (greedy and seeded, n = 1 and 2, some with
          logprobs); one worker gets kill -9 and another SIGTERM (a short drain grace: it hands its
          requests back) while they run. Every request must end whole: no error, each stream's text
          equal to the same request's on the healthy stack (no duplicated, missing or reordered
          token), usage and logprobs counting every token; no KV block or lease left behind.
  drain   SIGTERM on a worker with streams in flight, through the official openai client: those
          that fit in the grace end there, the rest move, and no request fails.

The chaos test prints the table BENCHMARKS.md carries (requests, lost, corrupted, migrated, the
added latency of a migrated request at p50 / p99).
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import statistics
import threading
import time

import httpx
import openai
import pytest

from tests.integration.conftest import free_port
from tests.integration.stack import FAST, INTERNAL, records, redis_and_procs, wait_for, wait_ready

STEP_MS = 20            # the null model's step: 50 tokens/s per sequence
REQUESTS = 800
CONCURRENCY = 48
PROMPT_LENGTHS = range(5, 13)
MAX_TOKENS = (16, 24, 32)
WORKERS = [f"chaos-{i}" for i in range(4)]
MOVED_GAP_S = 0.5       # a stream that waited this long between two chunks moved (a step is 20 ms)


def null_worker(procs, name: str, model: str, grace_s: float) -> None:
    procs.start(name, "worker", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", model, "--null-model",
                "--null-step-ms", str(STEP_MS), "--max-num-seqs", "32", "--num-gpu-blocks", "2048",
                "--worker-id", name, "--drain-grace-s", str(grace_s))


@pytest.fixture(scope="module")
def chaos(tiny_model, tmp_path_factory):
    port, local_port, sched_metrics = free_port(), free_port(), free_port()
    with redis_and_procs(tmp_path_factory.mktemp("chaos-logs")) as (redis, procs):
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", tiny_model)
        procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", str(sched_metrics),
                    "--routing", "least_loaded")
        for name in WORKERS:
            null_worker(procs, name, tiny_model, grace_s=0.2)
        procs.start("gateway", "gateway", *FAST, "--port", str(port), "--zmq-port", "0")
        procs.start("gateway-local", "gateway", *FAST, "--port", str(local_port), "--zmq-port", "0",
                    "--text-in-gateway", "--model", tiny_model)
        base, local = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{local_port}"
        wait_ready(base, 120)
        wait_ready(local, 120)
        wait_for(lambda: len(records(redis.client_url, "worker")) == len(WORKERS), 60, "every worker to register")
        yield {"base": base, "local": local, "procs": procs, "redis": redis.client_url, "model_dir": tiny_model,
               "model": os.path.basename(tiny_model), "scheduler_metrics": f"http://127.0.0.1:{sched_metrics}/metrics"}


def request_of(i: int) -> dict:
    """The i-th request of the load: its prompt length, budget, samples and sampling vary with i."""
    body = {"prompt": list(range(300, 300 + PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])),
            "max_tokens": MAX_TOKENS[(i // 3) % len(MAX_TOKENS)], "n": 2 if i % 8 == 0 else 1}
    if i % 3:
        body.update(temperature=0.8, seed=i)
    else:
        body.update(temperature=0.0)
    if i % 5 == 0:
        body["logprobs"] = 1
    return body


def reference_key(body: dict) -> tuple:
    return len(body["prompt"]), body["max_tokens"], body["n"]


async def references(client: openai.AsyncOpenAI, model: str, bodies: list[dict]) -> dict[tuple, list[str]]:
    """Each distinct request's text per sample on the healthy stack (not streamed)."""
    keys = {reference_key(b): b for b in bodies}

    async def one(body: dict) -> list[str]:
        r = await client.completions.create(model=model, prompt=body["prompt"], max_tokens=body["max_tokens"],
                                            n=body["n"], temperature=0.0)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    texts = await asyncio.gather(*(one(b) for b in keys.values()))
    return dict(zip(keys, texts))


async def stream_one(client: openai.AsyncOpenAI, model: str, body: dict) -> dict:
    """One streamed request's outcome: text and finish per sample, usage, logprob tokens, timing."""
    t0 = time.monotonic()
    out = {"texts": {}, "finish": {}, "logprob_tokens": 0, "usage": None, "error": None, "max_gap": 0.0}
    last = t0
    try:
        stream = await client.completions.create(model=model, stream=True, stream_options={"include_usage": True},
                                                 **body)
        async for chunk in stream:
            now = time.monotonic()
            out["max_gap"], last = max(out["max_gap"], now - last), now
            if chunk.usage is not None:
                out["usage"] = chunk.usage
            for c in chunk.choices:
                out["texts"][c.index] = out["texts"].get(c.index, "") + c.text
                if c.finish_reason:
                    out["finish"][c.index] = c.finish_reason
                if c.logprobs is not None and c.logprobs.tokens:
                    out["logprob_tokens"] += len(c.logprobs.tokens)
    except openai.APIError as exc:
        out["error"] = exc
    out["seconds"] = time.monotonic() - t0
    return out


def corrupted(body: dict, result: dict, reference: list[str]) -> bool:
    n, max_tokens = body["n"], body["max_tokens"]
    return ([result["texts"].get(i) for i in range(n)] != reference
            or any(result["finish"].get(i) != "length" for i in range(n))
            or result["usage"] is None or result["usage"].completion_tokens != n * max_tokens
            or ("logprobs" in body and result["logprob_tokens"] != n * max_tokens))


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


def test_kill_9_and_sigterm_under_load_lose_and_corrupt_nothing(chaos):
    procs, model = chaos["procs"], chaos["model"]
    bodies = [request_of(i) for i in range(REQUESTS)]
    killed, drained = WORKERS[1], WORKERS[2]
    done: list[int] = []

    async def load() -> tuple[dict, list[dict]]:
        client = openai.AsyncOpenAI(base_url=chaos["base"] + "/v1", api_key="none", timeout=60, max_retries=0)
        refs = await references(client, model, bodies)
        gate = asyncio.Semaphore(CONCURRENCY)

        async def run(i: int) -> dict:
            async with gate:
                result = await stream_one(client, model, bodies[i])
                done.append(i)
                return result
        results = await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(REQUESTS))), 240)
        await client.close()
        return refs, results

    faults: dict[str, float] = {}

    def inject() -> None:          # kill -9 a quarter of the way in, SIGTERM halfway
        deadline = time.monotonic() + 240
        while len(done) < REQUESTS // 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        procs.procs[killed].send_signal(signal.SIGKILL)
        faults["killed_at"] = time.monotonic()
        while len(done) < REQUESTS // 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        procs.procs[drained].send_signal(signal.SIGTERM)
        faults["drained_at"] = time.monotonic()

    injector = threading.Thread(target=inject, daemon=True)
    t0 = time.monotonic()
    injector.start()
    refs, results = asyncio.run(load())
    wall = time.monotonic() - t0
    injector.join(5)
    assert set(faults) == {"killed_at", "drained_at"}, "the faults came after the load ended: lengthen it"

    lost = [i for i, r in enumerate(results) if r["error"] is not None]
    bad = [i for i, r in enumerate(results) if r["error"] is None and corrupted(bodies[i], r, refs[reference_key(bodies[i])])]
    assert procs.procs[drained].wait(30) == 0                # the drained worker exits cleanly
    procs.procs[killed].wait(5)
    wait_idle_and_whole(chaos["redis"], set(WORKERS) - {killed, drained})
    url = chaos["scheduler_metrics"]
    moved = {reason: scheduler_metric(url, "kvmesh_scheduler_migrations_total", reason=reason, outcome="moved")
             for reason in ("worker_died", "drain")}
    failed_moves = scheduler_metric(url, "kvmesh_scheduler_migrations_total", outcome="failed")

    healthy = statistics.median(r["seconds"] for r in results if r["max_gap"] < MOVED_GAP_S)
    added = sorted(r["seconds"] - healthy for r in results if r["max_gap"] >= MOVED_GAP_S and r["error"] is None)
    p50 = statistics.median(added) if added else 0.0
    p99 = added[min(len(added) - 1, int(0.99 * len(added)))] if added else 0.0
    print(f"\nchaos: {REQUESTS} requests, 4 null-model workers ({STEP_MS} ms/step), kill -9 one, SIGTERM one "
          f"(drain grace 0.2 s), {wall:.1f} s\n"
          f"| requests | lost | corrupted | migrated (kill -9 / drain) | added latency of a moved request p50 / p99 |\n"
          f"|---|---|---|---|---|\n"
          f"| {REQUESTS} | {len(lost)} | {len(bad)} | {moved['worker_died']:.0f} / {moved['drain']:.0f} | "
          f"{p50 * 1000:.0f} ms / {p99 * 1000:.0f} ms |")
    assert not lost, [(i, str(results[i]["error"])) for i in lost[:5]]
    assert not bad, [(bodies[i], results[i]["texts"], refs[reference_key(bodies[i])]) for i in bad[:3]]
    assert moved["worker_died"] > 0 and moved["drain"] > 0 and failed_moves == 0, (moved, failed_moves)


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
