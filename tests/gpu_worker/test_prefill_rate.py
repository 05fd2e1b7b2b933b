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
