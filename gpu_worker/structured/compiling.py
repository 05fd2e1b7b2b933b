"""CompilingRequests: the constrained requests whose first draw waits for their grammar (what
vLLM calls WAITING_FOR_FSM).

A request's grammar compiles on the pool (compiler.py) while its prompt is prefilled. Until the
compile is settled, its Request.draw_waits is set and the scheduler computes every token of its
sequences but the last, the one whose logits the draw samples (scheduler.py, _chunk). So the
prompt's prefill overlaps the compile, the rest of the batch keeps stepping, and no step ever
blocks on a compile:

    step k   poll(): settled jobs leave; draw_waits cleared -> the draw joins this step's schedule
                     failed ones (compile error, deadline passed, no thread by the queue
                     deadline: busy) -> the engine ends them
    step k   nothing else to run: wait() blocks until a compile ends, at most IDLE_WAIT_S, so a
             caller stepping in a loop neither spins nor keeps new requests waiting long
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple

from gpu_worker.structured.matchers import GrammarError

# Longest an idle engine blocks in one step for a compile: a worker's loop reads new requests
# between steps, and one arriving then waits at most this long.
IDLE_WAIT_S = 0.005


class Settled(NamedTuple):
    ready: list[Any]     # Requests whose grammar compiled: they draw from now on
    failed: list[Any]    # Requests whose compile failed or missed a deadline (job.error: why; job.busy: retryable)


class CompilingRequests:
    def __init__(self) -> None:
        self._requests: dict[str, Any] = {}      # request id -> Request (gpu_worker/sequence.py)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request: Any) -> None:
        """request.grammar was just submitted: hold its draws until the job settles (a job found
        in the cache is settled already and not held)."""
        if request.grammar.expect_cached:
            return
        request.draw_waits = True
        self._requests[request.request_id] = request

    def discard(self, request_id: str) -> None:
        """The request ended (aborted, failed, finished): forget it, and drop its compile if it
        has not started yet (a running compile cannot be stopped; it ends on its pool thread)."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            request.grammar.future.cancel()

    def poll(self) -> Settled:
        """Requests whose job settled since the last poll; they are no longer held."""
        ready: list[Any] = []
        failed: list[Any] = []
        for request_id, request in list(self._requests.items()):
            job = request.grammar
            if not job.settled():
                continue
            del self._requests[request_id]
            request.draw_waits = False
            try:
                job.wait()                     # settled: returns or raises at once
            except GrammarError:
                job.future.cancel()            # past its deadline and still queued: never run it
                failed.append(request)
                continue
            ready.append(request)
        return Settled(ready, failed)

    def wait(self, timeout_s: float = IDLE_WAIT_S) -> None:
        """Block until one compile ends or reaches its deadline, at most timeout_s."""
        jobs = [request.grammar for request in self._requests.values()]
        if not jobs:
            return
        until_deadline = min(job.wait_deadline() for job in jobs) - time.monotonic()
        wait_futures([job.future for job in jobs], timeout=max(0.0, min(timeout_s, until_deadline)),
                     return_when=FIRST_COMPLETED)
