"""services.logging: a warning repeated word for word is written once per interval, with a count."""
from __future__ import annotations

import io
import logging
import time

from services.logging import RepeatLimiter


def _logger(interval_s: float) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RepeatLimiter(interval_s))
    log = logging.getLogger(f"test.repeats.{id(out)}")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
    return log, out


def test_a_repeated_warning_is_written_once_per_interval_with_the_count_held_back():
    log, out = _logger(0.5)
    for _ in range(30):
        log.warning("heartbeat failed: %s", "Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    assert out.getvalue().count("heartbeat failed") == 1
    time.sleep(0.6)
    log.warning("heartbeat failed: %s", "Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].endswith("(and 29 more like this since the last one shown)"), lines


def test_different_messages_and_info_lines_are_never_held_back():
    log, out = _logger(60)
    for pid in (11, 12, 13):
        log.warning("worker-0 (pid %d) exited with signal SIGKILL; restarting it in 0.5 s", pid)
    for _ in range(5):
        log.info("worker joined")
    text = out.getvalue()
    assert all(f"pid {pid}" in text for pid in (11, 12, 13)) and text.count("worker joined") == 5


def test_a_record_with_bad_arguments_does_not_raise_into_the_caller():
    log, out = _logger(60)
    logging.raiseExceptions = False          # the handler's own report of the bad record stays quiet
    try:
        log.warning("two values %d %d", 1)   # a caller's bug: logging reports it, never raises it
    finally:
        logging.raiseExceptions = True
    log.warning("still logging")
    assert "still logging" in out.getvalue()
