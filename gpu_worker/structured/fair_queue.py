"""FairQueue: a few threads running tasks fairly across tenants (API keys), not first come first served.

One tenant sending many distinct slow schemas at once must not hold every compile thread while
another tenant's one-property schema waits behind them (as on a FIFO pool, where its compiles would miss
their time limit). Each tenant has its own FIFO of queued tasks; a thread that frees up starts the
head task of the tenant with the fewest tasks running now, ties going to the one served least
recently (max-min fairness over the threads):

    running   A: 2  B: 0        queued  A: [a3 a4 a5 ...]  B: [b1]
    a thread frees (A: 1 running) -> B has fewest running -> b1 starts next, not a3

So a tenant's task waits at most for one running task to end, whatever the others queued. Queued
tasks hold a Future and a callable each; a tenant's count of queued + running tasks is tracked
(`pending`) so the caller can cap it.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple


class _Task(NamedTuple):
    tenant: str
    future: Future
    fn: Callable[[], Any]


class FairQueue:
    def __init__(self, num_threads: int, thread_name: str) -> None:
        self._num_threads = num_threads
        self._thread_name = thread_name
        self._threads: list[threading.Thread] = []
        self._cond = threading.Condition()
        self._queued: dict[str, deque[_Task]] = {}   # tenants with queued tasks
        self._running: dict[str, int] = {}           # tenant -> tasks running now
        self._served: dict[str, int] = {}            # tenant -> stamp of its last task started
        self._stamps = itertools.count()
        self._closed = False

    def put(self, tenant: str, future: Future, fn: Callable[[], Any]) -> None:
        """Queue fn; its result (or exception) settles future. A future cancelled while queued never runs."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the queue is closed")
            self._queued.setdefault(tenant, deque()).append(_Task(tenant, future, fn))
            if len(self._threads) < self._num_threads:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self._thread_name}-{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
            self._cond.notify()

    def pending(self, tenant: str) -> int:
        """Tasks of tenant queued (not cancelled) or running now."""
        with self._cond:
            queued = sum(not task.future.cancelled() for task in self._queued.get(tenant, ()))
            return queued + self._running.get(tenant, 0)

    def close(self) -> None:
        """Cancel every queued task; running ones end on their threads, which then exit."""
        with self._cond:
            self._closed = True
            for tasks in self._queued.values():
                for task in tasks:
                    task.future.cancel()
            self._queued.clear()
            self._cond.notify_all()

    def _next(self) -> _Task | None:
        """The next task to run (marked running), or None once closed."""
        with self._cond:
            while not self._queued and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            tenant = min(self._queued, key=lambda t: (self._running.get(t, 0), self._served.get(t, -1)))
            tasks = self._queued[tenant]
            task = tasks.popleft()
            if not tasks:
                del self._queued[tenant]
            self._running[tenant] = self._running.get(tenant, 0) + 1
            self._served[tenant] = next(self._stamps)
            return task

    def _done(self, tenant: str) -> None:
        with self._cond:
            self._running[tenant] -= 1
            if not self._running[tenant]:
                del self._running[tenant]
                if tenant not in self._queued:      # nothing of it left: forget it (bounded by tenants active)
                    self._served.pop(tenant, None)

    def _work(self) -> None:
        while (task := self._next()) is not None:
            try:
                if task.future.set_running_or_notify_cancel():
                    try:
                        result = task.fn()
                    except BaseException as exc:   # noqa: BLE001 (the future carries it to the waiter)
                        task.future.set_exception(exc)
                    else:
                        task.future.set_result(result)
            finally:
                self._done(task.tenant)
