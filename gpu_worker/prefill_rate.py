"""An engine's recent prefill rate (tokens per second), measured from its own steps.

A step is timed from its schedule to the host read of its sampled tokens, the first moment its
work is known to be done on the device (a launch returns at once, and with async scheduling the
next schedule comes before the step ran):

    schedule N   launch N   [ schedule N+1   launch N+1 ]   read N     (async: the bracket)
    |<--------------------- N took -------------------------------->|  from max(its schedule,
                                                                       the previous read) on

Steps that draw nothing (a prompt chunk before its last) are read with the next one that does,
their tokens and time summed, unless the engine idles first (idled(): their time would count
the wait; they measure nothing then). Only reads whose steps were mostly prefill measure the rate: a
decode token costs a whole memory-bound pass, so decode steps would make recomputing a prompt
look far slower than it is. The estimate is an exponential moving average.

Two readers: the KV tiers' load-or-recompute policy (kv_tiers/load_policy.py) and a drain's
move-or-recompute choice (service/move_cost.py), so both price a recompute the same way.
"""
from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

ALPHA = 0.2                    # weight of a new measurement in the moving averages
MIN_PREFILL_SAMPLE = 32        # prompt tokens a read's steps must compute to measure the prefill rate
MAX_UNREAD = 64                # steps kept waiting for a read (an engine that reads none keeps no more)


def ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


class _Launched(NamedTuple):
    step_no: int
    start: float               # perf_counter() at its schedule
    num_tokens: int
    num_prefill_tokens: int


class PrefillRate:
    def __init__(self) -> None:
        self.rate: float | None = None          # tokens per second; None until a step is measured
        self._start = 0.0                       # the schedule under way began
        self._step_no = 0
        self._unread: deque[_Launched] = deque(maxlen=MAX_UNREAD)
        self._last_read = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.rate = ewma(self.rate, num_tokens / seconds)

    def step_began(self) -> None:
        """A schedule starts (again, after an idle wait inside it: the wait is not the step's)."""
        self._start = time.perf_counter()

    def step_scheduled(self, num_tokens: int, num_prefill_tokens: int) -> int:
        """The schedule made a step of num_tokens, num_prefill_tokens of them prompt: its number
        for read() (0: an empty step, nothing to time)."""
        if num_tokens <= 0:
            return 0
        self._step_no += 1
        self._unread.append(_Launched(self._step_no, self._start, num_tokens, num_prefill_tokens))
        return self._step_no

    def idled(self) -> None:
        """The engine waits with nothing in flight: the steps never read (their requests drew
        nothing: aborted, or waiting for a grammar) are forgotten, as a later read would time
        their tokens over the wait."""
        self._unread.clear()

    def read(self, step_no: int) -> None:
        """The host has read step step_no's tokens: it and every step before it are done."""
        done: list[_Launched] = []
        while self._unread and self._unread[0].step_no <= step_no:
            done.append(self._unread.popleft())
        if not done:
            return
        now = time.perf_counter()
        began, self._last_read = max(done[0].start, self._last_read), now
        tokens, prefill = sum(s.num_tokens for s in done), sum(s.num_prefill_tokens for s in done)
        if prefill >= max(MIN_PREFILL_SAMPLE, tokens // 2):
            self.observe(tokens, now - began)
