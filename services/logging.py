"""One log format for every service: `time level service[pid] logger: message` on stderr.

Every service also prints all its threads' stacks on `kill -USR1 <pid>` (faulthandler, in C, so it
answers even when the event loop or the GIL is stuck): the first thing to ask a hung process.

A warning or error that repeats word for word (every heartbeat's "heartbeat failed: Error 111
connecting to ..." while Redis is down) is written once per REPEAT_INTERVAL_S, with the number held
back since; a message that differs (another pid, another error) is always written.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time

REPEAT_INTERVAL_S = 10.0
_MAX_TRACKED = 1024   # messages remembered; varying ones would otherwise grow the table forever


class RepeatLimiter(logging.Filter):
    """Passes a WARNING+ record at most once per interval per (logger, message text)."""

    def __init__(self, interval_s: float = REPEAT_INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], tuple[float, int]] = {}   # -> (last written, held back since)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        try:
            text = record.getMessage()
        except Exception:   # bad arguments: let the handler report it as it always does, never raise here
            return True
        key, now = (record.name, text), time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval_s:
            self._last[key] = (last[0], last[1] + 1)
            return False
        if last is not None and last[1]:
            record.msg = f"{record.msg} (and {last[1]} more like this since the last one shown)"
        if len(self._last) >= _MAX_TRACKED:
            self._last.clear()
        self._last[key] = (now, 0)
        return True


def setup(service: str, level: str = "info") -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {service}[{os.getpid()}] %(name)s: %(message)s", "%H:%M:%S"))
    handler.addFilter(RepeatLimiter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "httpx", "httpcore", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    return logging.getLogger(f"kvmesh.{service}")


class RateLimitedLog:
    """At most one warning per `period_s` for one source (a socket), carrying how many were
    suppressed since the last line: a flood of bad frames costs a counter, not the log."""

    def __init__(self, logger: logging.Logger, name: str, period_s: float = 10.0) -> None:
        self.logger, self.name, self.period_s = logger, name, period_s
        self.count = 0            # every event, logged or not
        self._since_line = 0      # events since the last line
        self._last_line = float("-inf")

    def warn(self, fmt: str, *args: object) -> None:
        self.count += 1
        self._since_line += 1
        now = time.monotonic()
        if now - self._last_line < self.period_s:
            return
        more = f" ({self._since_line - 1} more since the last such line)" if self._since_line > 1 else ""
        self.logger.warning(f"%s: {fmt}%s", self.name, *args, more)
        self._last_line, self._since_line = now, 0
