"""The planner's decision: one pool, its replicas now and its SLO signals in, the replicas it
should have out. Pure: no clock, no sockets (the shell passes `now` in seconds).

Hysteresis, so that a pool near one threshold does not flap:

    signal ──────────────────────────────────────────────────────────────
              up threshold   ▲ any signal above: grow (at most --max-step, then a cooldown)
    ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─│─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─
              (between: hold, and the low streak restarts)
    ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─│─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─ ─
              down threshold ▼ every signal below for the whole window, and the window since
                               the last change: shrink by one

A signal that could not be read never lets a pool shrink (no data is not "idle"); replicas outside
[min, max] (a manual `kubectl scale`) are brought back inside whatever the signals say.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple


class Threshold(NamedTuple):
    signal: str       # a key of the signals map, e.g. "ttft_p90_s"
    up: float         # above it the pool needs more pods
    down: float       # under it (every signal of the pool) the pool can do with fewer


@dataclass(frozen=True)
class PoolPolicy:
    pool: str
    min_replicas: int
    max_replicas: int
    thresholds: tuple[Threshold, ...]
    max_step: int
    window_s: float          # stabilization window of a scale-down
    up_cooldown_s: float     # between two scale-ups: new pods need time to load and take load


@dataclass
class PoolState:
    """What a pool's past decisions left for the next one."""

    last_change_s: float | None = None
    last_up_s: float | None = None
    low_since_s: float | None = None     # every signal under its down threshold since then


class Decision(NamedTuple):
    pool: str
    current: int
    desired: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


def decide(policy: PoolPolicy, state: PoolState, now: float, current: int,
           signals: Mapping[str, float | None]) -> Decision:
    """The replicas `policy.pool` should have; updates `state` as if the decision is carried out."""
    lo, hi = policy.min_replicas, policy.max_replicas
    if not lo <= current <= hi:
        return _changed(policy, state, now, current, min(max(current, lo), hi), f"outside [{lo}, {hi}]")
    high = [(t, signals[t.signal]) for t in policy.thresholds
            if _known(signals.get(t.signal)) and signals[t.signal] > t.up]
    if high:
        state.low_since_s = None
        return _grow(policy, state, now, current, high)
    values = [signals.get(t.signal) for t in policy.thresholds]
    if not all(_known(v) for v in values):
        state.low_since_s = None
        missing = [t.signal for t, v in zip(policy.thresholds, values) if not _known(v)]
        return Decision(policy.pool, current, current, f"hold: no value for {', '.join(missing)}")
    if not all(v < t.down for t, v in zip(policy.thresholds, values)):
        state.low_since_s = None
        return Decision(policy.pool, current, current, "hold: within the thresholds")
    return _shrink(policy, state, now, current)


def _grow(policy: PoolPolicy, state: PoolState, now: float, current: int,
          high: list[tuple[Threshold, float]]) -> Decision:
    why = ", ".join(f"{t.signal}={v:.4g} > {t.up:.4g}" for t, v in high)
    if current >= policy.max_replicas:
        return Decision(policy.pool, current, current, f"hold at max: {why}")
    if state.last_up_s is not None and now - state.last_up_s < policy.up_cooldown_s:
        return Decision(policy.pool, current, current, f"hold: scale-up cooldown ({why})")
    # grow in proportion to the worst overshoot, at least one pod, at most max_step
    ratio = max(v / t.up for t, v in high)
    step = min(policy.max_step, max(1, math.ceil(max(current, 1) * (ratio - 1))))
    desired = min(policy.max_replicas, current + step)
    state.last_up_s = now
    return _changed(policy, state, now, current, desired, why)


def _shrink(policy: PoolPolicy, state: PoolState, now: float, current: int) -> Decision:
    if state.low_since_s is None:
        state.low_since_s = now
    if current <= policy.min_replicas:
        return Decision(policy.pool, current, current, "hold at min: every signal low")
    low_for = now - state.low_since_s
    since_change = math.inf if state.last_change_s is None else now - state.last_change_s
    if low_for < policy.window_s or since_change < policy.window_s:
        return Decision(policy.pool, current, current,
                        f"hold: low for {low_for:.0f} s of the {policy.window_s:.0f} s window")
    state.low_since_s = now    # the next pod leaves only after a whole new window
    return _changed(policy, state, now, current, current - 1,
                    f"every signal under its down threshold for {low_for:.0f} s")


def _changed(policy: PoolPolicy, state: PoolState, now: float, current: int, desired: int,
             reason: str) -> Decision:
    state.last_change_s = now
    return Decision(policy.pool, current, desired, reason)


def _known(value: float | None) -> bool:
    return value is not None and not math.isnan(value)
