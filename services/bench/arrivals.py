"""Request arrival times: Poisson (burstiness 1) or gamma arrivals at a mean rate, as vLLM does.

Inter-arrival gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): the mean gap is
1/rate for every burstiness; burstiness < 1 is burstier than Poisson, > 1 more uniform.
Times are absolute offsets from the start, so a sender that falls behind (e.g. waiting on
--max-concurrency) catches up by sending late requests at once instead of shifting the schedule.
"""
from __future__ import annotations

import math

import numpy as np


def parse_rates(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]; each rate must be > 0."""
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        rate = math.inf if part in ("inf", "infinity") else float(part)
        if not rate > 0:
            raise ValueError(f"request rate must be > 0 or 'inf', got {part!r}")
        rates.append(rate)
    return rates


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Offsets in seconds from the start for n requests; all zero when rate is inf."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes out at once
    return np.cumsum(gaps)  # (n,)


def iter_arrival_times(rate: float, burstiness: float, rng: np.random.Generator, batch: int = 1024):
    """The same schedule as arrival_times, without an end (for --duration runs)."""
    offset = 0.0
    first = True
    while True:
        times = arrival_times(batch, rate, burstiness, rng)
        if not first and not math.isinf(rate):
            # Later batches: keep the first gap instead of zeroing it.
            times = times + rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))
        first = False
        yield from (offset + t for t in times)
        offset += times[-1]
