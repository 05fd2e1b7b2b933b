"""When `kvmesh serve` restarts a child that exited, and when it gives up (a pure policy, no processes).

    policy = RestartPolicy()
    policy.started(now)                  # the child (re)started at `now`
    decision = policy.exited(now)        # it exited: Restart(delay_s) or GiveUp(reason)

Back-off doubles from FIRST_DELAY_S to MAX_DELAY_S, and starts over once a child has stayed up for
STABLE_AFTER_S: a service that crashes once a day restarts at once, one that crashes at start is not
restarted in a tight loop. CRASH_LOOP_EXITS exits within CRASH_LOOP_WINDOW_S is a crash loop: the
cause will not go away by itself (a bad flag, a port taken, a broken model), so the caller stops
the stack (or drops an optional service) and says why instead of restarting forever.
"""
from __future__ import annotations

import signal
from collections import deque
from typing import NamedTuple

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 10.0
STABLE_AFTER_S = 30.0
CRASH_LOOP_EXITS = 5
CRASH_LOOP_WINDOW_S = 60.0


class Restart(NamedTuple):
    delay_s: float


class GiveUp(NamedTuple):
    reason: str


def describe_exit(code: int | None) -> str:
    """`code 1`, or `signal SIGKILL` for a child killed by a signal (Popen's negative code)."""
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


class RestartPolicy:
    def __init__(self) -> None:
        self._exits: deque[float] = deque()
        self._delay_s = FIRST_DELAY_S
        self._started_at = 0.0

    def started(self, now: float) -> None:
        self._started_at = now

    def exited(self, now: float) -> Restart | GiveUp:
        if now - self._started_at >= STABLE_AFTER_S:
            self._delay_s = FIRST_DELAY_S
        self._exits.append(now)
        while self._exits and now - self._exits[0] > CRASH_LOOP_WINDOW_S:
            self._exits.popleft()
        if len(self._exits) >= CRASH_LOOP_EXITS:
            return GiveUp(f"it exited {len(self._exits)} times within {CRASH_LOOP_WINDOW_S:.0f} s")
        delay, self._delay_s = self._delay_s, min(self._delay_s * 2, MAX_DELAY_S)
        return Restart(delay)
