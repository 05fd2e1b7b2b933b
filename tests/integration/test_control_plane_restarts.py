"""Control-plane restarts under streaming load, on a stack of its own: two gateways, two null-model
workers (deterministic fake tokens: a stream's text is compared with the same request's on the
undisturbed stack), one scheduler, one tokenizer, the embedded Redis.

    two gateways serve at once          each has its own inbox; replies reach the one that asked
    Redis restarts (down past a lease)  streams pause and go on; no worker is declared dead, not
                                        even one that registers again only most of a lease later
    the scheduler is killed (-9)        streams already on workers finish; a request sent to it
                                        completes through the new one, which adopts the requests
                                        the workers hold (their gateways send them again) and serves
"""
from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from services.embedded_redis import EmbeddedRedis
from tests.integration.conftest import free_port
from tests.integration.stack import FAST, INTERNAL, records, redis_and_procs, wait_for, wait_ready

STEP_MS = "10"          # null engine: one token per 10 ms per stream
LEASE_S = 1.5           # FAST's --lease-ms
LONG = 400              # tokens of a stream that must outlive a restart (~4 s)
LONGER = 1000           # ... that must outlive a scheduler's death, a lease and a new one's start (~10 s)


def start_worker(procs, name: str, model: str) -> None:
    procs.start(name, "worker", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", model, "--null-model",
                "--null-step-ms", STEP_MS, "--max-num-seqs", "8", "--worker-id", name)


def start_scheduler(procs) -> None:
    procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", "-1", "--worker-capacity-factor", "1")


@pytest.fixture(scope="module")
def st(tiny_model, tmp_path_factory):
    ports = [free_port(), free_port()]
    with redis_and_procs(tmp_path_factory.mktemp("restart-logs")) as (redis, procs):
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", tiny_model)
        start_scheduler(procs)
        for name in ("null-a", "null-b"):
            start_worker(procs, name, tiny_model)
        for i, port in enumerate(ports):
            procs.start(f"gateway-{i}", "gateway", *FAST, "--port", str(port), "--zmq-port", "0")
        bases = [f"http://127.0.0.1:{p}" for p in ports]
        for base in bases:
            wait_ready(base, 120)
        wait_for(lambda: len(records(redis.client_url, "worker")) == 2, 60, "two workers")
        yield {"bases": bases, "procs": procs, "redis": redis, "model": os.path.basename(tiny_model)}


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)


class Stream(threading.Thread):
    """One streamed completion through the official client: its text, usage and any error."""

    def __init__(self, st, base: str, i: int, max_tokens: int = LONG) -> None:
        super().__init__(daemon=True)
        self.http, self.model, self.i, self.max_tokens = client(base), st["model"], i, max_tokens
        self.text, self.tokens, self.error = "", 0, None
        self.started = threading.Event()      # the first text arrived: the request is on a worker

    def run(self) -> None:
        try:
            for chunk in self.http.completions.create(
                    model=self.model, prompt=f"stream {self.i} " * (1 + self.i % 5), max_tokens=self.max_tokens,
                    stream=True, stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].text:
                    self.text += chunk.choices[0].text
                    self.started.set()
                if chunk.usage is not None:
                    self.tokens = chunk.usage.completion_tokens
        except Exception as exc:  # the assertion names it
            self.error = exc
        finally:
            self.started.set()


def run_streams(st, n: int, max_tokens: int = LONG) -> list[Stream]:
    streams = [Stream(st, st["bases"][i % 2], i, max_tokens) for i in range(n)]
    for s in streams:
        s.start()
    return streams


def finish(streams: list[Stream], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    for s in streams:
        s.join(max(0.1, deadline - time.monotonic()))
    assert not any(s.is_alive() for s in streams), "a stream did not end"


@pytest.fixture(scope="module")
def reference(st) -> dict[tuple[int, int], str]:
    """Each stream's text on the undisturbed stack, by (stream, max_tokens): the null engine's
    tokens are deterministic. Both lengths at once (16 streams, all running together)."""
    streams = run_streams(st, 8, LONG) + run_streams(st, 8, LONGER)
    finish(streams)
    assert [s.error for s in streams] == [None] * 16
    assert [s.tokens for s in streams] == [LONG] * 8 + [LONGER] * 8
    return {(s.i, s.max_tokens): s.text for s in streams}


def assert_intact(streams: list[Stream], reference: dict[tuple[int, int], str]) -> None:
    """Every stream ended normally with exactly the undisturbed stream's text: nothing failed,
    duplicated, missing or reordered."""
    assert [(s.i, s.error) for s in streams if s.error] == []
    assert [s.i for s in streams if s.tokens != s.max_tokens or s.text != reference[(s.i, s.max_tokens)]] == []


def worker_epochs(st) -> dict[str, int]:
    return {r.id: r.epoch for r in records(st["redis"].client_url, "worker")}


def test_two_gateways_serve_at_once(st, reference):
    """Each gateway registers its own inbox; the tokenizer and the scheduler answer each request at
    the gateway that sent it (the reference run went through both, alternating)."""
    gateways = records(st["redis"].client_url, "gateway")
    assert len(gateways) == 2 and len({g.addrs["zmq"] for g in gateways}) == 2
    streams = run_streams(st, 8)
    finish(streams)
    assert_intact(streams, reference)


def test_streams_go_on_through_a_redis_restart_longer_than_a_lease(st, reference):
    redis: EmbeddedRedis = st["redis"]
    epochs = worker_epochs(st)
    pids = {name: st["procs"].procs[name].pid for name in ("null-a", "null-b", "scheduler")}
    streams = run_streams(st, 8)
    for s in streams:
        assert s.started.wait(30)
    slow = st["procs"].procs["null-b"]
    redis.stop()
    slow.send_signal(signal.SIGSTOP)   # one worker will be slow to register again
    time.sleep(2 * LEASE_S)            # every lease would have lapsed, were Redis there to see it
    redis.start()                      # same port and password, empty
    time.sleep(0.6 * LEASE_S)          # past the usual grace for a missing record, within a lease
    slow.send_signal(signal.SIGCONT)
    finish(streams)
    assert_intact(streams, reference)
    wait_for(lambda: worker_epochs(st) == epochs, 10, "the workers to register again under their epochs")
    assert {name: st["procs"].procs[name].pid for name in pids} == pids
    assert all(st["procs"].procs[name].poll() is None for name in pids)
    for base in st["bases"]:
        wait_ready(base, 10)
        r = client(base).completions.create(model=st["model"], prompt="after", max_tokens=3)
        assert r.usage.completion_tokens == 3


def test_a_killed_scheduler_fails_no_stream_on_a_worker(st, reference):
    """The streams on the workers go on; a request sent to the dead scheduler waits for the next
    one (its gateway sends it again), and the new scheduler adopts the workers' requests (its
    gateways send those again too), so it could move them were a worker to die now."""
    procs = st["procs"]
    streams = run_streams(st, 8, LONGER)
    for s in streams:
        assert s.started.wait(30)
    procs.kill("scheduler")                        # SIGKILL: no goodbye, its record lingers a lease
    late: list[int] = []
    sent = threading.Thread(target=lambda: late.append(client(st["bases"][0]).completions.create(
        model=st["model"], prompt="while down", max_tokens=2).usage.completion_tokens))
    sent.start()
    time.sleep(0.2)
    start_scheduler(procs)
    sent.join(30)
    assert late == [2]
    # the new scheduler holds the workers' requests as its own: its gateways told it about them
    wait_for(lambda: any(r.load.get("inflight", 0) >= len(streams) and r.load.get("inherited", 1) == 0
                         for r in records(st["redis"].client_url, "scheduler")),
             10, "the new scheduler to adopt the workers' requests")
    finish(streams)
    assert_intact(streams, reference)
    for base in st["bases"]:
        wait_ready(base, 20)
        wait_for(lambda: client(base).completions.create(model=st["model"], prompt="new", max_tokens=2)
                 .usage.completion_tokens == 2, 10, "a request through the new scheduler")
