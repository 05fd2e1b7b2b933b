"""One log format for every service: `time level service[pid] logger: message` on stderr.

Every service also prints all its threads' stacks on `kill -USR1 <pid>` (faulthandler, in C, so it
answers even when the event loop or the GIL is stuck): the first thing to ask a hung process.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys


def setup(service: str, level: str = "info") -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {service}[{os.getpid()}] %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "httpx", "httpcore", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    return logging.getLogger(f"kvmesh.{service}")
