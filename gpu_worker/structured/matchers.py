"""A compile in flight (GrammarJob) and the per-sequence xgrammar GrammarMatcher.

A constrained request's grammar compiles while its prompt is prefilled (the engine submits it at
add_request). Its first draw needs the grammar: until the job is settled (compiled, failed, or
past its deadline) the scheduler leaves that draw out of every step (compiling.py), so wait()
returns at once; a job expected to be a cache hit (expect_cached) is not held, and its wait()
is that lookup.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


class GrammarError(Exception):
    """A constraint could not be compiled (bad syntax, unsupported schema, time limit); the
    message names the field and is safe to show the client."""


class GrammarJob:
    """One request's grammar: compiling on the pool, then compiled (or failed)."""

    def __init__(self, future: Future, deadline: float, field: str, *, expect_cached: bool = False) -> None:
        self.future = future
        self.deadline = deadline
        self.field = field
        self.expect_cached = expect_cached   # compiled here before: the compile is a cache lookup
        self.error: str | None = None   # set once the compile failed: the request ends with it

    def settled(self) -> bool:
        """True once wait() returns (or raises) at once: the compile ended or missed its deadline."""
        return self.error is not None or self.future.done() or time.monotonic() >= self.deadline

    def wait(self) -> Any:
        """The CompiledGrammar; raises GrammarError when the compile failed or missed its deadline."""
        if self.error is not None:
            raise GrammarError(self.error)
        try:
            return self.future.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except GrammarError as exc:         # the compiler itself is unavailable
            self.error = str(exc)
        except FutureTimeout:
            self.error = (f"invalid {self.field}: the constraint did not compile within the time limit; "
                          "simplify it")
        except Exception as exc:            # xgrammar raises RuntimeError / ValueError with a reason
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            self.error = f"invalid {self.field}: it cannot be compiled: {_without_source_path(reason)[:300]}"
        raise GrammarError(self.error)


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
