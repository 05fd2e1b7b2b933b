"""WorkerCore's per-request stage histograms (queue, prefill, decode, worker TTFT; admit, the first
token's send and its step's device wait), measured over the null engine with a step delay and over
the real engine (fake runner, sync and async scheduling).

The histograms are process-global, so every check reads what a run added: count and sum deltas.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_fakes import assert_clean, make_engine  # noqa: E402

from gpu_worker.service.core import WorkerCore  # noqa: E402
from gpu_worker.service.null_engine import NullEngine  # noqa: E402
from services.protocol.messages import Abort, Dispatch  # noqa: E402
from services.protocol.sampling import SamplingParams  # noqa: E402

STAGES = {"queue": "kvmesh_worker_request_queue_seconds", "prefill": "kvmesh_worker_request_prefill_seconds",
          "decode": "kvmesh_worker_request_decode_seconds", "ttft": "kvmesh_worker_time_to_first_token_seconds",
          "admit": "kvmesh_worker_request_admit_seconds", "send": "kvmesh_worker_first_token_send_seconds",
          "sync": "kvmesh_worker_first_token_sync_seconds"}
EPS = 1e-6


def snapshot() -> dict[str, tuple[float, float]]:
    """stage -> (count, sum)."""
    return {k: (REGISTRY.get_sample_value(f"{m}_count") or 0.0, REGISTRY.get_sample_value(f"{m}_sum") or 0.0)
            for k, m in STAGES.items()}


def delta(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in STAGES}


def dispatch(rid: str, prompt_len: int = 3, max_tokens: int = 3, n: int = 1) -> Dispatch:
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Dispatch(request_id=rid, epoch=1, prompt_token_ids=[2 + i % 40 for i in range(prompt_len)], params=params,
                    reply_addr="gw", detok_addr="d1")


def run_until_idle(core: WorkerCore, inbox: list, max_iters: int = 1000) -> None:
    core.run(inbox)
    for _ in range(max_iters):
        if not core.has_work():
            return
        core.run([])
    raise AssertionError("the core did not go idle")


def assert_consistent(d: dict, n: int, *, decode: int | None = None) -> None:
    """Every stage counted once per request; queue + prefill == worker TTFT per request, so in sum."""
    assert d["queue"][0] == n and d["prefill"][0] == n and d["ttft"][0] == n, d
    assert d["decode"][0] == (n if decode is None else decode), d
    assert d["prefill"][1] > 0 and d["ttft"][1] > 0 and d["queue"][1] >= 0, d
    assert abs(d["queue"][1] + d["prefill"][1] - d["ttft"][1]) <= n * EPS, d


def test_null_engine_queue_prefill_decode():
    """2 slots, 4 requests of 3 tokens, 5 ms steps: the last two wait 3 steps in the engine."""
    step_s = 0.005
    core = WorkerCore(NullEngine(vocab_size=1000, max_num_seqs=2, step_ms=step_s * 1000), "w", 1)
    before = snapshot()
    run_until_idle(core, [dispatch(f"r{i}") for i in range(4)])
    d = delta(before, snapshot())
    assert_consistent(d, 4)
    assert d["queue"][1] >= 2 * 3 * step_s            # r2, r3: queued behind r0, r1 for 3 steps each
    assert d["prefill"][1] >= 4 * step_s               # the first step of each request
    assert d["decode"][1] >= 4 * 2 * step_s            # tokens 2 and 3: two more steps each
    assert d["ttft"][1] < 4 * 1.0                      # sane magnitudes (seconds, not ns or ms)


def test_one_request_values():
    """Alone, a request's queue is ~0 and prefill is its first step; counts go up by exactly one."""
    core = WorkerCore(NullEngine(vocab_size=1000, step_ms=10), "w", 1)
    before = snapshot()
    run_until_idle(core, [dispatch("a", max_tokens=4)])
    d = delta(before, snapshot())
    assert_consistent(d, 1)
    assert d["queue"][1] < 0.005 <= 0.010 <= d["prefill"][1]
    assert d["decode"][1] >= 3 * 0.010


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_real_engine_chunked_prefill(async_scheduling):
    """A 64-token prompt in 16-token chunks with a 2 ms forward: prefill spans >= 4 forwards; a
    second request queues behind the first (one sequence slot) for its whole run."""
    engine = make_engine(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16, max_num_seqs=1,
                         async_scheduling=async_scheduling)
    forward = engine.runner.forward

    def slow_forward(batch):
        time.sleep(0.002)
        return forward(batch)
    engine.runner.forward = slow_forward
    core = WorkerCore(engine, "w", 1)
    before = snapshot()
    run_until_idle(core, [dispatch("a", prompt_len=64, max_tokens=4)])
    d = delta(before, snapshot())
    assert_consistent(d, 1)
    assert d["prefill"][1] >= 4 * 0.002
    # tokens 2-4 take three forwards; one step ahead, the first of them runs before token 1 is read
    # and the last token is read without one (no step is launched for it)
    assert d["decode"][1] >= (2 if async_scheduling else 3) * 0.002
    assert d["queue"][1] < d["prefill"][1]

    before = snapshot()
    run_until_idle(core, [dispatch("b", prompt_len=8, max_tokens=5), dispatch("c", prompt_len=8, max_tokens=2)])
    d = delta(before, snapshot())
    assert_consistent(d, 2)
    assert d["queue"][1] >= 5 * 0.002                  # c waits for b's 5 steps (at least)
    assert_clean(engine)


def test_abort_counts_reached_stages_only():
    """An aborted request: queue, prefill and TTFT once it got there, never decode; a stop-string
    abort is a finish and counts decode."""
    core = WorkerCore(NullEngine(vocab_size=1000, max_num_seqs=1), "w", 1)
    before = snapshot()
    core.run([dispatch("a", max_tokens=50), dispatch("b", max_tokens=50)])   # a runs, b waits
    core.run([Abort(request_id="a", reason="client"), Abort(request_id="b", reason="client")])
    d = delta(before, snapshot())
    assert d["queue"][0] == 1 and d["ttft"][0] == 1 and d["prefill"][0] == 1 and d["decode"][0] == 0, d

    before = snapshot()
    core.run([dispatch("c", max_tokens=50)])
    core.run([])
    core.run([Abort(request_id="c", index=0, reason="stop")])
    d = delta(before, snapshot())
    assert_consistent(d, 1)
    assert not core.requests and not core._unscheduled


def test_engine_without_request_table_gets_ttft_and_decode():
    class Opaque:   # the engine surface without `requests`: no queue or prefill split
        def __init__(self):
            self._e = NullEngine(vocab_size=1000, step_ms=1)
            self.add_request, self.abort_request = self._e.add_request, self._e.abort_request
            self.step, self.stats = self._e.step, self._e.stats
            self.has_unfinished_requests = self._e.has_unfinished_requests
    core = WorkerCore(Opaque(), "w", 1)
    before = snapshot()
    run_until_idle(core, [dispatch("a"), dispatch("b")])
    d = delta(before, snapshot())
    assert d["queue"][0] == 0 and d["prefill"][0] == 0 and d["ttft"][0] == 2 and d["decode"][0] == 2, d
    assert d["ttft"][1] >= 2 * 0.001


def test_admit_starts_at_the_socket_read_and_send_ends_at_note_sent():
    """admit: from run()'s `received` (when the shell read the Dispatch off its socket) to the engine
    holding the request, and TTFT starts there too; send: from the end of the first token's step to
    note_sent(), once per request; the null engine reports no device wait."""
    core = WorkerCore(NullEngine(vocab_size=1000), "w", 1)
    before = snapshot()
    core.run([dispatch("a", max_tokens=2)], received=time.perf_counter() - 0.005)   # read 5 ms ago
    time.sleep(0.003)
    core.note_sent(time.perf_counter())
    core.run([])                                   # the second (last) token: nothing more to time
    core.note_sent(time.perf_counter())
    d = delta(before, snapshot())
    assert d["admit"][0] == 1 and 0.005 <= d["admit"][1] < 1.0, d
    assert d["ttft"][1] >= 0.005 and d["queue"][1] >= d["admit"][1]
    assert d["send"][0] == 1 and 0.003 <= d["send"][1] < 1.0, d
    assert d["sync"][0] == 0
    assert_consistent(d, 1)


def test_first_tokens_unsent_by_a_run_are_not_carried_over():
    core = WorkerCore(NullEngine(vocab_size=1000), "w", 1)
    before = snapshot()
    core.run([dispatch("a", max_tokens=3)])        # a shell that never called note_sent (tests)
    core.run([])
    core.note_sent(time.perf_counter())
    assert delta(before, snapshot())["send"][0] == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_real_engine_reports_the_first_tokens_device_wait(async_scheduling):
    """Engine.last_sync_s of the step that produced each request's first token, once per request."""
    engine = make_engine(block_size=4, num_gpu_blocks=64, async_scheduling=async_scheduling)
    core = WorkerCore(engine, "w", 1)
    before = snapshot()
    run_until_idle(core, [dispatch("a", prompt_len=8, max_tokens=3), dispatch("b", prompt_len=5, max_tokens=2, n=2)])
    d = delta(before, snapshot())
    assert_consistent(d, 2)
    assert d["sync"][0] == 2 and 0 <= d["sync"][1] <= d["prefill"][1], d
    assert engine.last_sync_s >= 0
    assert_clean(engine)
