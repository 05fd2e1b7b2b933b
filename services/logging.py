"""One log format for every service: `time level service[pid] logger: message` on stderr."""
from __future__ import annotations

import logging
import os
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
    return logging.getLogger(f"kvmesh.{service}")
