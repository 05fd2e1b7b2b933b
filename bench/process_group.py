"""The benchmark's child processes, each in its own process group (start_new_session=True), and how
they are stopped so that nothing is left running on the device (bench/serve_bench.py and its
vLLM peer, bench/vllm_server.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable


def die_with_parent() -> None:
    """Linux: this child gets SIGTERM if the benchmark process dies (no stack left running)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()   # state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def kill_group(pgid: int, timeout_s: float = 15.0, say: Callable[[str], None] = print) -> None:
    """SIGKILL what is left of a process group this script created, then wait until it is gone."""
    if group_members(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left := group_members(pgid):
        say(f"warning: processes {left} of group {pgid} still alive after SIGKILL")


def stop_group(proc: subprocess.Popen, term_timeout_s: float, name: str, say: Callable[[str], None] = print) -> None:
    """SIGTERM the group's leader (a server stops its own children), wait up to term_timeout_s,
    then SIGKILL whatever of its process group is left and reap the leader."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=term_timeout_s)
        except subprocess.TimeoutExpired:
            say(f"{name}: did not stop in {term_timeout_s:.0f} s; killing its process group")
    kill_group(proc.pid, say=say)
    if proc.poll() is None:
        proc.wait()
