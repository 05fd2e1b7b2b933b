"""The planner's decision core on scripted signal sequences: it grows on a breached up-threshold
(at most max_step, then a cooldown), holds between the thresholds, shrinks one pod only after a
whole window of low signals, never leaves [min, max], and never shrinks on missing data."""
from __future__ import annotations

import math
import os

from services.planner.decide import PoolPolicy, PoolState, Threshold, decide
from services.planner.signals import Bucket, histogram_quantile

DECODE = PoolPolicy("decode", min_replicas=1, max_replicas=6,
                    thresholds=(Threshold("itl_p90_s", 0.1, 0.03), Threshold("kv_usage", 0.85, 0.4)),
                    max_step=2, window_s=300.0, up_cooldown_s=60.0)
HIGH = {"itl_p90_s": 0.05, "kv_usage": 0.95}
LOW = {"itl_p90_s": 0.01, "kv_usage": 0.2}
BETWEEN = {"itl_p90_s": 0.05, "kv_usage": 0.6}


def run(policy: PoolPolicy, replicas: int, script: list[tuple[float, dict]]) -> list[tuple[float, int]]:
    """Feed (time, signals) in order, carrying each decision out; the replica count after each step."""
    state, trace = PoolState(), []
    for now, signals in script:
        replicas = decide(policy, state, now, replicas, signals).desired
        trace.append((now, replicas))
    return trace


def test_scales_up_on_one_breached_signal_by_at_most_max_step():
    d = decide(DECODE, PoolState(), 0.0, 2, {"itl_p90_s": 0.5, "kv_usage": 0.1})   # ITL 5x over
    assert (d.desired, d.direction) == (4, "up") and "itl_p90_s=0.5 > 0.1" in d.reason
    d = decide(DECODE, PoolState(), 0.0, 2, {"itl_p90_s": 0.12, "kv_usage": 0.1})  # 20 % over: one pod
    assert d.desired == 3


def test_scale_ups_wait_out_the_cooldown():
    trace = run(DECODE, 1, [(t, HIGH) for t in (0, 10, 59, 60, 61, 121)])
    assert [r for _, r in trace] == [2, 2, 2, 3, 3, 4]


def test_clamped_at_max_and_at_min():
    assert run(DECODE, 1, [(t * 60.0, HIGH) for t in range(10)])[-1][1] == 6
    assert [r for _, r in run(DECODE, 6, [(0, HIGH), (100, HIGH)])] == [6, 6]
    assert [r for _, r in run(DECODE, 1, [(t * 400.0, LOW) for t in range(5)])] == [1] * 5
    # outside the bounds (a manual kubectl scale): brought back whatever the signals say
    assert decide(DECODE, PoolState(), 0, 9, LOW).desired == 6
    assert decide(DECODE, PoolState(), 0, 0, HIGH).desired == 1


def test_no_flapping_inside_the_window():
    """Load that comes and goes every 30 s never shrinks the pool; a steady low shrinks it one pod
    per window, never sooner than a window after the last change."""
    policy = PoolPolicy("decode", 1, 6, DECODE.thresholds, 2, window_s=300.0, up_cooldown_s=0.0)
    flapping = [(t * 30.0, HIGH if t % 2 == 0 else LOW) for t in range(20)]
    trace = run(policy, 2, flapping)
    assert all(b >= a for (_, a), (_, b) in zip(trace, trace[1:])), trace
    quiet = [(600.0 + t * 15.0, LOW) for t in range(90)]
    trace = run(policy, 4, quiet)
    changes = [(t, r) for (t, r), (_, before) in zip(trace, [(0, 4)] + trace) if r != before]
    assert [r for _, r in changes] == [3, 2, 1]
    assert changes[0][0] - 600.0 >= 300.0
    assert all(b[0] - a[0] >= 300.0 for a, b in zip(changes, changes[1:]))


def test_between_the_thresholds_holds_and_restarts_the_low_streak():
    script = [(0, LOW), (200, LOW), (250, BETWEEN), (260, LOW), (500, LOW), (560, LOW)]
    assert [r for _, r in run(DECODE, 3, script)] == [3, 3, 3, 3, 3, 2]


def test_missing_signals_never_shrink_but_a_known_breach_still_grows():
    state = PoolState()
    for t in range(0, 2000, 100):
        d = decide(DECODE, state, float(t), 4, {"itl_p90_s": None, "kv_usage": 0.1})
        assert d.desired == 4 and "no value for itl_p90_s" in d.reason
    d = decide(DECODE, PoolState(), 0.0, 4, {"itl_p90_s": None, "kv_usage": 0.99})
    assert d.desired == 5
    assert decide(DECODE, PoolState(), 0.0, 4, {"itl_p90_s": math.nan, "kv_usage": 0.1}).desired == 4


def test_histogram_quantile_matches_prometheus():
    # 10 observations: 5 in (0, 0.1], 4 in (0.1, 0.5], 1 above 1
    buckets = [Bucket(0.1, 5), Bucket(0.5, 9), Bucket(1.0, 9), Bucket(math.inf, 10)]
    assert math.isclose(histogram_quantile(0.5, buckets), 0.1)
    assert math.isclose(histogram_quantile(0.7, buckets), 0.1 + 0.4 * 2 / 4)
    assert histogram_quantile(0.95, buckets) == 1.0            # in +Inf: the highest finite bound
    assert histogram_quantile(0.9, [Bucket(0.1, 0), Bucket(math.inf, 0)]) is None


def test_bad_planner_flags_name_the_flag():
    import pytest

    from services.config import ConfigError, PlannerConfig, parse_config

    def error(*argv: str) -> str:
        with pytest.raises(ConfigError) as exc:
            parse_config(PlannerConfig, list(argv), "kvmesh planner", env={})
        return str(exc.value)

    assert "--kv-usage-down (0.9) must be below --kv-usage-up" in error("--decode-deployment", "d", "--kv-usage-down", "0.9")
    assert "--decode-min-replicas (5) is above --decode-max-replicas (2)" in error(
        "--decode-deployment", "d", "--decode-min-replicas", "5", "--decode-max-replicas", "2")
    assert "--prometheus-url" in error("--decode-deployment", "d", "--prometheus-url", "file:///etc/passwd")
    assert "--decode-selector" in error("--decode-deployment", "d", "--decode-selector", 'a="b"}) or vector(1')


def test_a_planner_with_no_deployment_says_so(capsys, monkeypatch):
    from services.planner.main import main
    for name in [n for n in os.environ if n.startswith("KVMESH_")]:
        monkeypatch.delenv(name)
    assert main(["--prometheus-url", "http://127.0.0.1:9"]) == 2
    assert "give --prefill-deployment (or --prefill-statefulset), --decode-deployment" in capsys.readouterr().err
