"""The part of a service's `main.py` shell that every service repeats: run its loops until a
signal or a dead loop, then give the shutdown a deadline.

    code = await run_until_signal([recv_task, heartbeat_task], "scheduler", log)
    # ... release the lease, stop servers, close sockets ...
    return code
"""
from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys

STOP_DEADLINE_S = 8.0  # a clean stop takes well under a second; Kubernetes waits 30 s by default


async def run_until_signal(tasks: list[asyncio.Task], name: str, log: logging.Logger,
                           stop_deadline_s: float = STOP_DEADLINE_S) -> int:
    """Wait for SIGTERM/SIGINT or for any of `tasks` to end, then cancel them all.

    Returns the process exit code: 0 after a signal, 1 when a loop died (each death logged).
    From then on the caller's shutdown (and the interpreter's exit) has `stop_deadline_s`: past it
    faulthandler prints every thread's stack and exits 1, so a stop that hangs (a library's
    shutdown, a socket) shows where instead of waiting for a SIGKILL that leaves no trace.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    received: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda sig=sig: (received.append(sig.name), stop.set()))
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    for task in done:
        if task is not waiter and not task.cancelled() and task.exception() is not None:
            log.error("%s loop died: %r", name, task.exception())
            code = 1
    log.info("%s stopping (%s)", name, received[0] if received else "a loop ended")
    arm_stop_deadline(stop_deadline_s)
    waiter.cancel()
    for task in tasks:
        task.cancel()
    return code


def arm_stop_deadline(seconds: float = STOP_DEADLINE_S) -> None:
    """From now on the process has `seconds` to exit; past that faulthandler (a C thread, so it
    fires even with the GIL or the event loop stuck) prints every thread's stack and exits 1."""
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
