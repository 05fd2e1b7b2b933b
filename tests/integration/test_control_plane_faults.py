"""Control-plane faults on a stack of its own with a null-model worker (fake tokens, no model math:
these tests check admission, failover and recovery, never generated text)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from services.embedded_redis import EmbeddedRedis
from tests.integration.conftest import free_port
from tests.integration.stack import FAST, INTERNAL, records, redis_and_procs, wait_for, wait_ready


@pytest.fixture(scope="module")
def cp(tiny_model, tmp_path_factory):
    port = free_port()
    with redis_and_procs(tmp_path_factory.mktemp("cp-logs")) as (redis, procs):
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", tiny_model)
        procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", "-1", "--max-queue", "2",
                    "--worker-capacity-factor", "1", "--retry-after-s", "2")
        procs.start("worker", "worker", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", tiny_model,
                    "--null-model", "--null-step-ms", "20", "--max-num-seqs", "2", "--worker-id", "null-0")
        procs.start("gateway", "gateway", *FAST, "--port", str(port), "--zmq-port", "0")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, 120)
        yield {"base": base, "procs": procs, "redis": redis, "model": os.path.basename(tiny_model),
               "model_dir": tiny_model}


def body(cp, max_tokens: int, stream: bool = False) -> dict:
    return {"model": cp["model"], "prompt": "x", "max_tokens": max_tokens, "stream": stream}


def test_queue_full_is_429_with_retry_after(cp):
    results: list[int] = []

    def long_request() -> None:   # 120 steps of 20 ms: the queue stays full for seconds
        results.append(httpx.post(cp["base"] + "/v1/completions", json=body(cp, 120), timeout=60).status_code)

    threads = [threading.Thread(target=long_request) for _ in range(4)]   # 2 running + 2 queued
    for t in threads:
        t.start()
    wait_for(lambda: any(s.load.get("queued") == 2 for s in records(cp["redis"].client_url, "scheduler")),
             30, "two requests queued at the scheduler")
    r = httpx.post(cp["base"] + "/v1/completions", json=body(cp, 1), timeout=30)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "2" and r.json()["error"]["type"] == "rate_limit_error"
    for t in threads:
        t.join(60)
    assert results == [200] * 4


def test_redis_restart_keeps_serving(cp):
    redis: EmbeddedRedis = cp["redis"]
    worker_pid = cp["procs"].procs["worker"].pid
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", cp["base"] + "/v1/completions", json=body(cp, 100, stream=True)) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            redis.stop()                       # the data path does not need Redis
            time.sleep(0.5)
            redis.start()                      # same port, empty (no persistence)
            events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "error" not in events[-2]
    wait_for(lambda: any(w.id == "null-0" for w in records(redis.client_url, "worker")), 10,
             "the worker to re-register")
    assert cp["procs"].procs["worker"].poll() is None and cp["procs"].procs["worker"].pid == worker_pid
    wait_ready(cp["base"], 10)
    r = httpx.post(cp["base"] + "/v1/completions", json=body(cp, 3), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_tokenizer_death_ends_streams_with_an_error(cp):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", cp["base"] + "/v1/completions", json=body(cp, 2000, stream=True)) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            t0 = time.monotonic()
            cp["procs"].kill("tokenizer")
            events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "tokenizer_failed"
    assert time.monotonic() - t0 < 10
    # a new tokenizer process is discovered and the stack serves again
    cp["procs"].start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", cp["model_dir"])
    wait_ready(cp["base"], 60)
    r = httpx.post(cp["base"] + "/v1/completions", json=body(cp, 2), timeout=30)
    assert r.status_code == 200
    # a second tokenizer process shares the work (Tokenize round-robin, each detokenizes its own)
    cp["procs"].start("tokenizer-2", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", cp["model_dir"])
    wait_for(lambda: len(records(cp["redis"].client_url, "tokenizer")) == 2, 30, "two tokenizers")
    time.sleep(0.6)                                   # the gateway's next discovery
    for _ in range(6):
        r = httpx.post(cp["base"] + "/v1/completions", json=body(cp, 3, stream=True), timeout=30)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text


def test_no_worker_is_503(cp):
    cp["procs"].kill("worker", signal.SIGTERM)   # drains and deregisters at once
    wait_for(lambda: not records(cp["redis"].client_url, "worker"), 10, "the worker to deregister")
    time.sleep(0.6)                              # the scheduler's grace for vanished records
    r = httpx.post(cp["base"] + "/v1/completions", json=body(cp, 1), timeout=30)
    assert r.status_code == 503 and "retry-after" in r.headers, r.text
    assert r.json()["error"]["code"] == "no_workers"
    assert httpx.get(cp["base"] + "/ready").status_code == 503
    # with Redis away too, the scheduler cannot look for a worker once more: it answers from what
    # it knows, and keeps running
    redis: EmbeddedRedis = cp["redis"]
    redis.stop()
    try:
        r = httpx.post(cp["base"] + "/v1/completions", json=body(cp, 1), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text
        time.sleep(0.3)
        assert cp["procs"].procs["scheduler"].poll() is None
    finally:
        redis.start()


def test_a_scheduler_killed_with_a_worker_fails_no_request_once_a_new_one_starts(cp):
    """kill -9 of the scheduler and of a worker running requests, at once: the gateway sends its
    live requests to the next scheduler (Submit.resubmitted), which adopts those the live worker
    runs, moves the dead worker's from their tokens, and runs the ones the dead scheduler had
    queued and the one sent to it after its death. Every request ends 200 with the healthy text."""
    # two workers of its own (test_no_worker_is_503 stops the first one, when it ran before)
    procs = cp["procs"]
    if "worker" in procs.procs:
        procs.kill("worker", signal.SIGTERM)
    for name in ("worker-1", "worker-2"):
        procs.start(name, "worker", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", cp["model_dir"],
                    "--null-model", "--null-step-ms", "20", "--max-num-seqs", "2", "--worker-id", f"null-{name[-1]}")
    wait_for(lambda: len(records(cp["redis"].client_url, "worker")) == 2, 60, "both workers to register")
    wait_ready(cp["base"], 60)
    healthy = httpx.post(cp["base"] + "/v1/completions", json=body(cp, 100), timeout=60).json()["choices"][0]["text"]
    results: list[tuple[int, str]] = []

    def request() -> None:
        r = httpx.post(cp["base"] + "/v1/completions", json=body(cp, 100), timeout=60)
        results.append((r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))

    threads = [threading.Thread(target=request) for _ in range(6)]     # 2 on each worker + 2 queued
    for t in threads:
        t.start()
    wait_for(lambda: sum(r.load.get("requests", 0) for r in records(cp["redis"].client_url, "worker")) == 4, 10,
             "both workers to run two requests")
    procs.kill("scheduler")
    procs.kill("worker-1")
    late = threading.Thread(target=request)          # sent to the dead scheduler: its record still stands
    late.start()
    procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", "-1")
    for t in (*threads, late):
        t.join(60)
    assert results == [(200, healthy)] * 7, results
    wait_for(lambda: httpx.post(cp["base"] + "/v1/completions", json=body(cp, 2), timeout=30).status_code == 200,
             10, "a request through the new scheduler")
