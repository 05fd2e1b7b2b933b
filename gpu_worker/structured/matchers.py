"""A compile in flight (GrammarJob) and the per-sequence xgrammar GrammarMatcher.

A constrained request's grammar compiles while its prompt is prefilled (the engine submits it at
add_request). Its first draw needs the grammar: until the job is settled (compiled, failed, or
past its deadline) the scheduler leaves that draw out of every step (compiling.py), so wait()
returns at once; a job whose grammar was in the cache (expect_cached) is settled from the start.

The time limit counts the compile, not the wait for a compile thread: a job's deadline is set when
a thread starts it (begin), so a request queued behind other tenants' compiles is not failed for
time it spent waiting (the fair queue bounds that wait: fair_queue.py). The wait behind its own
tenant's compiles has a bound of its own (limit_queue_wait): a job no thread has started by then is
cancelled and fails busy, a retry later may succeed (the worker answers 429).
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


_WAIT_SLICE_S = 0.05     # a blocking wait() re-reads the deadline this often (begin() may set it meanwhile)


class GrammarError(Exception):
    """A constraint could not be compiled (bad syntax, unsupported schema, time limit); the
    message names the field and is safe to show the client."""


class GrammarJob:
    """One request's grammar: compiling on the pool, then compiled (or failed)."""

    def __init__(self, future: Future, field: str, *, expect_cached: bool = False) -> None:
        self.future = future
        self.deadline = math.inf        # no limit while queued; begin() starts it
        self.queue_deadline = math.inf  # a thread must start it by then (limit_queue_wait)
        self.field = field
        self.expect_cached = expect_cached   # found in the cache: settled from the start
        self.error: str | None = None   # set once the compile failed: the request ends with it
        self.busy = False               # it failed waiting for a thread, not compiling: retryable

    def limit_queue_wait(self, limit_s: float) -> None:
        """A thread must start this job within limit_s from now, or it fails busy (settled)."""
        self.queue_deadline = time.monotonic() + limit_s

    def begin(self, time_limit_s: float) -> None:
        """A compile thread starts this job now: it must end within time_limit_s (called on that thread)."""
        self.deadline = time.monotonic() + time_limit_s

    def settled(self) -> bool:
        """True once wait() returns (or raises) at once: the compile ended or missed its deadline,
        or no thread started it by its queue deadline (it is cancelled then: it never runs)."""
        now = time.monotonic()
        return (self.error is not None or self.future.done() or now >= self.deadline
                or (now >= self.queue_deadline and self._expire_queued()))

    def _expire_queued(self) -> bool:
        """Cancel the job if no thread has started it: True then (it failed busy). A job a thread
        started meanwhile runs on under its own deadline."""
        if not self.future.cancel():
            return False
        self.busy = True
        self.error = (f"{self.field}: the constraint waited too long for a compile thread behind this API key's "
                      "other compiles on this worker; retry later or reuse schemas")
        return True

    def wait_deadline(self) -> float:
        """When this job settles at the latest if nothing ends before: its deadline once started,
        else its queue deadline."""
        return self.deadline if self.deadline != math.inf else self.queue_deadline

    def wait(self) -> Any:
        """The CompiledGrammar; raises GrammarError when the compile failed or missed its deadline."""
        if self.error is not None:
            raise GrammarError(self.error)
        try:
            return self._result()
        except GrammarError as exc:         # the compiler itself is unavailable
            self.error = str(exc)
        except FutureTimeout:
            self.error = (f"invalid {self.field}: the constraint did not compile within the time limit; "
                          "simplify it")
        except Exception as exc:            # xgrammar raises RuntimeError / ValueError with a reason
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            self.error = f"invalid {self.field}: it cannot be compiled: {_without_source_path(reason)[:300]}"
        raise GrammarError(self.error)

    def _result(self) -> Any:
        """The future's result, or FutureTimeout once the deadline passed; a job still queued has
        no deadline yet, so this waits in slices until a thread has started it (or, past its
        queue deadline, raises GrammarError busy)."""
        while True:
            if time.monotonic() >= self.queue_deadline and self._expire_queued():
                raise GrammarError(self.error)
            remaining = self.deadline - time.monotonic()
            if remaining <= 0 and not self.future.done():
                raise FutureTimeout()
            try:
                return self.future.result(timeout=max(0.0, min(remaining, _WAIT_SLICE_S)))
            except FutureTimeout:
                continue


def new_matcher(compiled: Any, output_token_ids: list[int]) -> Any:
    """A GrammarMatcher advanced through the tokens the sequence generated already (a sample
    that resumes after a hand-off or catches up after a fork)."""
    import xgrammar
    matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=-1)
    for token in output_token_ids:
        if not matcher.accept_token(token):
            raise GrammarError("the sequence's tokens do not match its grammar")
    return matcher


def _without_source_path(reason: str) -> str:
    """xgrammar prefixes errors with '[time] /path/file.cc:line: ': keep only the reason."""
    head, sep, tail = reason.partition(".cc:")
    if sep:
        return tail.split(": ", 1)[-1]
    return reason
