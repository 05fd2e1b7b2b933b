"""A log line at most once per interval; the lines swallowed in between are counted in the next."""
from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 5.0) -> None:
        self._log = logger
        self._interval = interval_s
        self._last = float("-inf")
        self.suppressed = 0
        self.total = 0

    def warning(self, msg: str, *args: object) -> None:
        self.total += 1
        now = time.monotonic()
        if now - self._last < self._interval:
            self.suppressed += 1
            return
        extra = f" ({self.suppressed} more since the last line)" if self.suppressed else ""
        self._log.warning(msg + extra, *args)
        self._last, self.suppressed = now, 0
