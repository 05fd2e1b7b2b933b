"""The engine's prefill-rate meter (gpu_worker/prefill_rate.py) on a fake clock: a step is timed
from the later of its schedule and the previous read to its own read, so neither async
scheduling (the next step scheduled before this one ran) nor an idle engine skews it."""
from __future__ import annotations

import pytest

from gpu_worker import prefill_rate
from gpu_worker.prefill_rate import PrefillRate


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(prefill_rate.time, "perf_counter", lambda: now[0])
    return now


def _schedule(meter: PrefillRate, clock: list, at: float, tokens: int, prefill: int) -> int:
    clock[0] = at
    meter.step_began()
    return meter.step_scheduled(tokens, prefill)


def _read(meter: PrefillRate, clock: list, at: float, step_no: int) -> None:
    clock[0] = at
    meter.read(step_no)


def test_async_steps_are_timed_to_their_own_read(clock):
    meter = PrefillRate()
    a = _schedule(meter, clock, 0.0, 1000, 1000)      # a prompt, launched
    b = _schedule(meter, clock, 0.001, 4, 0)          # the next step, scheduled before a ran
    _read(meter, clock, 0.1, a)                       # a's tokens: 1,000 in 0.1 s
    assert meter.rate == pytest.approx(10_000)
    _read(meter, clock, 0.12, b)                      # a decode step: not a prefill sample
    assert meter.rate == pytest.approx(10_000)
    d = _schedule(meter, clock, 5.0, 2000, 2000)      # after an idle engine: from its schedule on
    _schedule(meter, clock, 5.001, 1, 0)
    _read(meter, clock, 5.2, d)
    assert meter.rate == pytest.approx(10_000)


def test_steps_that_draw_nothing_are_read_with_the_next(clock):
    meter = PrefillRate()
    first = _schedule(meter, clock, 0.0, 512, 512)    # a prompt chunk: no draw, never read itself
    last = _schedule(meter, clock, 0.01, 488, 488)    # its last chunk draws
    _read(meter, clock, 0.1, last)                    # both, 1,000 tokens in 0.1 s
    assert meter.rate == pytest.approx(10_000) and first < last
    assert _schedule(meter, clock, 0.2, 0, 0) == 0    # nothing scheduled: nothing to time
    meter.read(0)
    assert meter.rate == pytest.approx(10_000)


def test_a_step_never_read_does_not_time_the_engines_idle_wait(monkeypatch):
    """A prompt chunk whose request was aborted before it drew is never read by itself; once the
    engine has idled (the worker's idle hook, or a step that scheduled nothing) the next read
    must not count that chunk's tokens over the whole wait."""
    from tests.gpu_worker.engine.engine_fakes import make_engine
    from services.protocol.sampling import SamplingParams

    now = [0.0]

    def tick() -> float:
        now[0] += 0.001
        return now[0]

    monkeypatch.setattr(prefill_rate.time, "perf_counter", tick)
    for idle in ("worker", "engine"):
        eng = make_engine(max_num_batched_tokens=32, enable_chunked_prefill=True)
        params = SamplingParams(temperature=0.0, max_tokens=2)
        eng.add_request("a", [3 + i % 40 for i in range(64)], params)
        assert eng.step() == []                 # a's first chunk: 32 tokens, no draw
        eng.abort_request("a")
        if idle == "worker":
            eng.idle()
        else:
            assert eng.step() == []             # nothing to schedule
        now[0] += 100.0                         # idle
        eng.add_request("b", [5 + i % 40 for i in range(40)], params)
        eng.step()                              # b's prompt, 40 tokens in two chunks,
        eng.step()                              # the second drawn and read
        assert eng.scheduler.prefill_rate.rate > 1000, idle
