import math

import numpy as np
import pytest

from services.bench.arrivals import arrival_times, iter_arrival_times, parse_rates


def test_parse_rates():
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    with pytest.raises(ValueError):
        parse_rates("0")


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_mean_gap_is_one_over_rate(burstiness):
    t = arrival_times(20000, 10.0, burstiness, np.random.default_rng(0))
    gaps = np.diff(t)
    assert t[0] == 0.0 and gaps.mean() == pytest.approx(0.1, rel=0.05)
    # Coefficient of variation of gamma(k) gaps is 1/sqrt(k): burstier below 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_inf_rate_and_stream():
    assert arrival_times(5, math.inf, 1.0, np.random.default_rng(0)).tolist() == [0.0] * 5
    it = iter_arrival_times(100.0, 1.0, np.random.default_rng(0), batch=16)
    times = [next(it) for _ in range(100)]
    assert all(b > a for a, b in zip(times, times[1:]))
    assert times[-1] == pytest.approx(1.0, rel=0.3)
