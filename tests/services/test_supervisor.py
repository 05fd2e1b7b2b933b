"""services.supervisor with real child processes (small Python programs): restarts with the same
command, a refused configuration is never restarted, an optional crash-looper is dropped, a
crash-looping worker is restarted on and on."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from services import restart_policy, supervisor
from services.restart_policy import CRASH_LOOP_EXITS
from services.supervisor import Supervisor


def _program(runs: Path, code: int) -> list[str]:
    """A child that notes each run in `runs` and exits with `code` at once."""
    return [sys.executable, "-c", f"open({str(runs)!r}, 'a').write('run\\n'); raise SystemExit({code})"]


def _tick_until(sup: Supervisor, done, timeout_s: float = 30) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reason = sup.tick(time.monotonic())
        if reason is not None or done():
            return reason
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_child_that_exits_with_code_0_is_restarted_with_the_same_command(tmp_path):
    runs, sup = tmp_path / "runs", Supervisor()
    sup.spawn("worker-0", _program(runs, 0), time.monotonic())
    try:
        reason = _tick_until(sup, lambda: runs.exists() and runs.read_text().count("run") >= 3)
        assert reason is None
    finally:
        sup.stop()


def test_a_refused_configuration_stops_the_stack_without_a_restart(tmp_path):
    runs, sup = tmp_path / "runs", Supervisor()
    sup.spawn("scheduler", _program(runs, 2), time.monotonic())
    try:
        reason = _tick_until(sup, lambda: False)
        assert reason is not None and "scheduler" in reason and "exited with code 2" in reason
        assert "configuration was refused" in reason and runs.read_text().count("run") == 1
    finally:
        sup.stop()


@pytest.fixture
def fast_backoff(monkeypatch):
    """The back-off scaled down 50x (0.5 s -> 10 ms, 10 s -> 0.2 s): the same policy, quickly."""
    monkeypatch.setattr(restart_policy, "FIRST_DELAY_S", 0.01)
    monkeypatch.setattr(restart_policy, "MAX_DELAY_S", 0.2)
    monkeypatch.setattr(supervisor, "MAX_DELAY_S", 0.2)


def test_a_crash_looping_optional_child_is_dropped_and_the_rest_keeps_running(tmp_path, fast_backoff):
    runs, sup = tmp_path / "runs", Supervisor()
    sup.spawn("prefix-cache", _program(runs, 1), time.monotonic(), optional=True)
    steady = sup.spawn("tokenizer", [sys.executable, "-c", "import time; time.sleep(60)"], time.monotonic())
    try:
        assert _tick_until(sup, lambda: all(c.name != "prefix-cache" for c in sup.children), 60) is None
        assert runs.read_text().count("run") == CRASH_LOOP_EXITS
        assert steady.proc.poll() is None
    finally:
        t0 = time.monotonic()
        sup.stop()
        assert steady.proc.poll() is not None and time.monotonic() - t0 < 15


def test_a_crash_looping_worker_is_restarted_on_and_on_and_never_stops_the_stack(tmp_path, fast_backoff):
    runs, sup = tmp_path / "runs", Supervisor()
    sup.spawn("decode-0", _program(runs, 1), time.monotonic(), pooled=True)
    steady = sup.spawn("scheduler", [sys.executable, "-c", "import time; time.sleep(60)"], time.monotonic())
    try:
        reason = _tick_until(sup, lambda: runs.exists() and runs.read_text().count("run") >= CRASH_LOOP_EXITS + 3)
        assert reason is None and steady.proc.poll() is None
        assert any(c.name == "decode-0" for c in sup.children)
    finally:
        sup.stop()


def test_a_worker_whose_configuration_is_refused_still_stops_the_stack(tmp_path):
    runs, sup = tmp_path / "runs", Supervisor()
    sup.spawn("worker-0", _program(runs, 2), time.monotonic(), pooled=True)
    try:
        reason = _tick_until(sup, lambda: False)
        assert reason is not None and "configuration was refused" in reason and runs.read_text().count("run") == 1
    finally:
        sup.stop()
