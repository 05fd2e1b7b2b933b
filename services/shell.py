"""The part of a service's `main.py` shell that every service repeats: run its loops until a
signal or a dead loop.

    code = await run_until_signal([recv_task, heartbeat_task], "scheduler", log)
    # ... release the lease, stop servers, close sockets ...
    return code
"""
from __future__ import annotations

import asyncio
import logging
import signal


async def run_until_signal(tasks: list[asyncio.Task], name: str, log: logging.Logger) -> int:
    """Wait for SIGTERM/SIGINT or for any of `tasks` to end, then cancel them all.

    Returns the process exit code: 0 after a signal, 1 when a loop died (each death logged).
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    for task in done:
        if task is not waiter and not task.cancelled() and task.exception() is not None:
            log.error("%s loop died: %r", name, task.exception())
            code = 1
    waiter.cancel()
    for task in tasks:
        task.cancel()
    return code
