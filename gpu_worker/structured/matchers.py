"""A compile in flight (GrammarJob) and the per-sequence xgrammar GrammarMatcher.

A constrained request's grammar compiles while its prompt is prefilled (the engine submits it at
add_request). Its first draw needs the grammar: until the job is settled (compiled, failed, or
past its deadline) the scheduler leaves that draw out of every step (compiling.py), so wait()
returns at once; a job whose grammar was in the cache (expect_cached) is settled from the start.

The time limit counts the compile, not the wait for a compile thread: a job's deadline is set when
a thread starts it (begin), so a request queued behind other tenants' compiles is not failed for
time it spent waiting (the fair queue bounds that wait: fair_queue.py).
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
        self.field = field
        self.expect_cached = expect_cached   # found in the cache: settled from the start
        self.error: str | None = None   # set once the compile failed: the request ends with it

    def begin(self, time_limit_s: float) -> None:
        """A compile thread starts this job now: it must end within time_limit_s (called on that thread)."""
        self.deadline = time.monotonic() + time_limit_s

    def settled(self) -> bool:
        """True once wait() returns (or raises) at once: the compile ended or missed its deadline."""
        return self.error is not None or self.future.done() or time.monotonic() >= self.deadline

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
        no deadline yet, so this waits in slices until a thread has started it."""
        while True:
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
