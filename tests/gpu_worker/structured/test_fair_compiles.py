"""One tenant's flood of slow compiles cannot starve another tenant's constrained requests.

The compile threads serve tenants fairly (fair_queue.py), the time limit counts a compile from its
start, not its wait for a thread, a tenant's compiles on a worker are capped (429 beyond), and a
cached constraint takes no thread. The pool's `compile` seam stands in for xgrammar here (a sleep
or a gate), so these tests need no tokenizer; the last two drive a real engine and worker core."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from gpu_worker.outputs import RequestBusy, RequestError
from gpu_worker.service.core import WorkerCore
from gpu_worker.structured import CompileBusy, GrammarCompilerPool, GrammarError
from gpu_worker.structured.fair_queue import FairQueue
from services.protocol.kv_events import cache_salt_for
from services.protocol.messages import Abort, Dispatch, RequestFailed, failure_of
from services.protocol.sampling import SamplingParams, StructuredOutput
from tests.gpu_worker.structured.test_structured_engine import assert_blocks_back, make_engine, run

SLOW_S = 0.3          # one of tenant A's compiles


def spec(tenant: str, i: int) -> StructuredOutput:
    return StructuredOutput(regex=f"{tenant}{i}")


def sleeping_pool(**kwargs) -> GrammarCompilerPool:
    """A pool whose compile sleeps SLOW_S for tenant A's constraints and returns at once for the rest."""
    pool = GrammarCompilerPool("/nonexistent", 1024, [1], **kwargs)

    def compile_(s: StructuredOutput) -> _Grammar:
        if s.regex.startswith("A"):
            time.sleep(SLOW_S)
        return _Grammar()
    pool.compile = compile_
    return pool


class _Grammar:
    memory_size_bytes = 100


def test_a_thread_that_frees_up_serves_the_tenant_with_fewest_running():
    """Deterministic (gated tasks): with two threads busy on A's tasks and A's queue deep, B's one
    task is the next to start, not A's third (a FIFO would start it after all of A's)."""
    queue = FairQueue(2, "test")
    started: list[str] = []
    gates = {name: threading.Event() for name in ("a0", "a1", "a2", "a3", "b0")}
    futures = {}

    def task(name: str):
        def run_():
            started.append(name)
            gates[name].wait(timeout=10)
            return name
        return run_
    for name in ("a0", "a1", "a2", "a3"):
        futures[name] = Future()
        queue.put("A", futures[name], task(name))
    deadline = time.monotonic() + 10
    while len(started) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    futures["b0"] = Future()
    queue.put("B", futures["b0"], task("b0"))
    assert queue.pending("A") == 4 and queue.pending("B") == 1
    gates["a0"].set()
    assert futures["a0"].result(timeout=10) == "a0"
    gates["b0"].set()
    assert futures["b0"].result(timeout=10) == "b0"
    for gate in gates.values():
        gate.set()
    assert {f.result(timeout=10) for f in futures.values()} == set(gates)
    assert started[:3] == ["a0", "a1", "b0"]
    # nothing is remembered of tenants with nothing queued or running: the queue's state is bounded
    # by the tenants active now, not by those ever seen
    deadline = time.monotonic() + 10
    while (queue._running or queue._served) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert queue._queued == {} and queue._running == {} and queue._served == {}
    queue.close()


def test_a_flood_from_one_tenant_delays_another_by_at_most_one_compile():
    pool = sleeping_pool(time_limit_s=5.0)
    flood = [pool.submit(spec("A", i), "key0") for i in range(20)]      # 3 s of compiles on 2 threads
    time.sleep(0.05)                                                     # both threads busy with A's
    t = time.monotonic()
    pool.submit(spec("B", 0), "key1").wait()
    assert time.monotonic() - t < SLOW_S + 0.2
    assert not all(job.future.done() for job in flood)                   # B did not wait for the flood
    pool.close()


def test_time_queued_does_not_count_against_the_time_limit():
    """Eight compiles of 0.3 s each on two threads under a 0.55 s limit: the last ones wait 0.9 s for
    a thread, past the limit counted from submission, and all compile. A compile that runs past the
    limit still fails."""
    pool = sleeping_pool(time_limit_s=0.55)
    jobs = [pool.submit(spec("A", i), "key0") for i in range(8)]
    assert all(job.wait() is not None for job in jobs)
    pool.compile = lambda s: time.sleep(0.8)
    with pytest.raises(GrammarError, match="did not compile within the time limit"):
        pool.submit(spec("A", 99), "key0").wait()
    pool.close()


def test_a_tenant_past_its_cap_is_refused_and_others_are_not():
    pool = GrammarCompilerPool("/nonexistent", 1024, [1], max_per_tenant=3)
    gate = threading.Event()
    pool.compile = lambda s: (gate.wait(timeout=10), _Grammar())[1]
    cached = spec("A", 0)
    pool.cache.put(pool_digest(cached), _Grammar())
    jobs = [pool.submit(spec("A", i), "key0") for i in (1, 2, 3)]     # two running, one queued
    with pytest.raises(CompileBusy, match="at most 3"):
        pool.admit(spec("A", 4), "key0")
    pool.admit(cached, "key0")                 # a cached constraint takes no thread
    assert pool.submit(cached, "key0").future.done()
    pool.admit(spec("B", 0), "key1")           # another key is not refused
    for i in range(5):                         # nor the unsalted tenant (offline LLM, no API keys)
        pool.admit(spec("C", i), "")
    assert jobs[2].future.cancel()             # a cancelled queued compile no longer counts
    pool.admit(spec("A", 4), "key0")
    gate.set()
    assert jobs[0].wait() is not None and jobs[1].wait() is not None
    pool.close()


def test_a_compile_no_thread_starts_in_time_fails_busy_and_frees_its_place():
    """Behind its own key's compiles (both threads held), a new request's compile that no thread
    starts within the queue-wait limit settles busy and is cancelled: it never runs, and no longer
    counts against the key's cap. A started compile is not failed by that limit, nor is an
    unsalted tenant's (no cap, no limit) or a job with no limit set (a request moved here)."""
    pool = GrammarCompilerPool("/nonexistent", 1024, [1], queue_wait_limit_s=0.2)
    gate, started, ran = threading.Event(), [], []
    pool.compile = lambda s: (started.append(s.regex), gate.wait(timeout=10), ran.append(s.regex), _Grammar())[3]
    running = [pool.submit(spec("A", i), "key0") for i in (0, 1)]
    for job in running:
        pool.limit_queue_wait(job, "key0")
    deadline = time.monotonic() + 10
    while len(started) < 2 and time.monotonic() < deadline:   # both threads hold key0's compiles
        time.sleep(0.001)
    queued, moved = pool.submit(spec("A", 2), "key0"), pool.submit(spec("A", 3), "key0")
    unsalted = pool.submit(spec("C", 0), "")
    pool.limit_queue_wait(queued, "key0")
    pool.limit_queue_wait(unsalted, "")
    assert not queued.settled() and pool._queue.pending("key0") == 4
    t = time.monotonic()
    with pytest.raises(GrammarError, match="waited too long for a compile thread"):
        queued.wait()                                 # a blocking wait ends at the queue deadline too
    assert 0.1 < time.monotonic() - t < 5
    assert queued.settled() and queued.busy and queued.future.cancelled()
    assert not any(job.settled() for job in (*running, moved, unsalted))
    assert pool._queue.pending("key0") == 3          # its place under the cap is free
    gate.set()
    assert all(job.wait() is not None for job in (*running, moved, unsalted))
    assert sorted(ran) == ["A0", "A1", "A3", "C0"] and not any(j.busy for j in (*running, moved, unsalted))
    pool.close()


def test_the_worker_answers_a_compile_that_waited_too_long_with_a_429(tiny_llama):
    """Through WorkerCore: key0's third constrained request waits behind its two compiles (both
    threads) past the queue-wait limit: a 429 rate_limit_exceeded to the gateway, its stream closed
    with the same code, its blocks back; the two others are served once their compiles end."""
    engine, gate, compiled = gated_engine(tiny_llama, 64)
    engine.grammars.queue_wait_limit_s = 0.3
    core = WorkerCore(engine, "w", 1)
    salt = cache_salt_for("key0", "")
    out = core.run([Dispatch(request_id=f"r{i}", epoch=1, prompt_token_ids=[5, 6, 7], params=constrained(r),
                             cache_salt=salt, reply_addr="gw", detok_addr="d")
                    for i, r in enumerate(("[a-z]{3}", "[0-9]{3}", "(yes|no)"))])
    deadline = time.monotonic() + 30
    while not any(isinstance(e.msg, RequestFailed) for e in out) and time.monotonic() < deadline:
        out += core.run([])
    failed = [e.msg for e in out if isinstance(e.msg, RequestFailed)]
    assert [(m.request_id, m.status, m.code) for m in failed] == [("r2", 429, "rate_limit_exceeded")]
    assert "retry later" in failed[0].message
    assert any(isinstance(e.msg, Abort) and e.msg.request_id == "r2" and e.msg.reason == "rate_limit_exceeded"
               for e in out)
    assert failure_of(Abort(request_id="r2", reason="rate_limit_exceeded")).status == 429
    assert "r2" not in engine.requests and engine.grammars._queue.pending("key0") == 2
    gate.set()
    assert set(run(engine)) == {("r0", 0), ("r1", 0)} and sorted(compiled) == ["[0-9]{3}", "[a-z]{3}"]
    assert engine.grammars._queue.pending("key0") == 0
    assert_blocks_back(engine)
    engine.close()


def pool_digest(s: StructuredOutput) -> bytes:
    from gpu_worker.structured.compiler import _digest
    return _digest(s)


def test_the_engine_refuses_a_tenant_past_its_cap_with_a_429(tiny_llama):
    """Through WorkerCore: the request past its key's cap is a 429 naming the limit; another key's
    constrained request is served; the capped key's are served once compiled."""
    engine = make_engine(tiny_llama)
    engine.grammars.max_per_tenant = 1
    gate, compile_now = threading.Event(), engine.grammars.compile
    engine.grammars.compile = lambda s: (gate.wait(timeout=60), compile_now(s))[1]
    core = WorkerCore(engine, "w", 1)
    params = [SamplingParams(max_tokens=3, temperature=0.0, structured=StructuredOutput(regex=r)) for r in
              ("[a-z]{3}", "[0-9]{3}", "(yes|no)")]
    salts = [cache_salt_for("key0", ""), cache_salt_for("key0", "x"), cache_salt_for("key1", "")]
    out = core.run([Dispatch(request_id=f"r{i}", epoch=1, prompt_token_ids=[5, 6, 7], params=p, cache_salt=salt,
                             reply_addr="gw", detok_addr="d") for i, (p, salt) in enumerate(zip(params, salts))])
    failed = [e.msg for e in out if isinstance(e.msg, RequestFailed)]
    assert [(m.request_id, m.status, m.code) for m in failed] == [("r1", 429, "rate_limit_exceeded")]
    assert "at most 1" in failed[0].message
    with pytest.raises(RequestBusy):           # the engine's own answer, offline callers included
        engine.add_request("r3", [5, 6, 7], params[2], cache_salt=salts[1])
    assert "r3" not in engine.requests
    gate.set()
    assert set(run(engine)) == {("r0", 0), ("r2", 0)}
    engine.add_request("again", [5, 6, 7], params[1], cache_salt=salts[1])   # key0's compile ended: room again
    assert ("again", 0) in run(engine)
    assert engine.take_failed() == []
    assert_blocks_back(engine)
    engine.close()





def gated_engine(model: str, cap: int):
    """An engine whose compiles wait for the returned gate; the regexes compiled are listed."""
    engine = make_engine(model)
    engine.grammars.max_per_tenant = cap
    gate, compile_now, compiled = threading.Event(), engine.grammars.compile, []
    engine.grammars.compile = lambda s: (gate.wait(timeout=60), compiled.append(s.regex), compile_now(s))[2]
    return engine, gate, compiled


def constrained(regex: str) -> SamplingParams:
    return SamplingParams(max_tokens=3, temperature=0.0, structured=StructuredOutput(regex=regex))


def test_a_refused_resume_leaves_no_compile_behind(tiny_llama):
    """add_request refusing a resume (bad resume_output) queues nothing: no compile runs for it,
    counts against its key's cap, or keeps the engine treating the id as constrained."""
    engine, gate, compiled = gated_engine(tiny_llama, 1)
    salt = cache_salt_for("key0", "")
    with pytest.raises(RequestError, match="resume_output"):   # a token outside the vocabulary
        engine.add_request("bad", [5, 6, 7], constrained("(yes|no)"), cache_salt=salt, resume_output=[[10 ** 9]])
    assert engine.grammars._queue.pending("key0") == 0 and not engine._constrained
    engine.add_request("r0", [5, 6, 7], constrained("[a-z]{3}"), cache_salt=salt)   # not refused: key0 has room
    gate.set()
    assert set(run(engine)) == {("r0", 0)} and compiled == ["[a-z]{3}"]
    assert_blocks_back(engine)
    engine.close()


def test_a_request_moved_here_mid_stream_is_not_refused_at_its_keys_cap(tiny_llama):
    """A request moved here mid-stream (resume_output: a drain, or a peer move's recompute) has
    streamed already: its key's compile cap does not refuse it (a 429 would end the stream)."""
    engine, gate, _ = gated_engine(tiny_llama, 2)
    salt = cache_salt_for("key0", "")
    for i, regex in enumerate(("[a-z]{3}", "[0-9]{3}")):     # key0 at its cap
        engine.add_request(f"r{i}", [5, 6, 7], constrained(regex), cache_salt=salt)
    engine.add_request("moved", [5, 6, 7], constrained("[a-z]{3}"), cache_salt=salt, resume_output=[[8]])
    assert "moved" in engine.requests
    gate.set()
    assert {("r0", 0), ("r1", 0)} <= set(run(engine))
    assert_blocks_back(engine)
    engine.close()
