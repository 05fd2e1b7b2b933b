"""services.shell.run_until_signal and the SIGUSR1 stack dump, in real processes."""
from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

# A service shell in miniature: one loop, SIGTERM, then a shutdown that hangs when asked to.
_SERVICE = textwrap.dedent("""
    import asyncio, sys, time
    from services.logging import setup
    from services.shell import run_until_signal

    log = setup("demo")

    def stuck_in_shutdown():
        time.sleep(60)   # stands in for a library call that never returns

    async def main():
        loop_task = asyncio.create_task(asyncio.sleep(3600))
        # runs once run_until_signal awaits, so its signal handlers are in place
        asyncio.get_running_loop().call_soon(lambda: print("ready", flush=True))
        code = await run_until_signal([loop_task], "demo", log, stop_deadline_s=float(sys.argv[1]))
        if sys.argv[2] == "hang":
            stuck_in_shutdown()
        return code

    sys.exit(asyncio.run(main()))
""")


def _start(deadline_s: float, mode: str, err) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _SERVICE, str(deadline_s), mode],
                            stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _read(err) -> str:
    err.seek(0)
    return err.read()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_service_with_exit_0(sig):
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = _start(5.0, "clean", err)
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
        assert f"demo stopping ({sig.name})" in _read(err)


def test_a_hung_shutdown_prints_its_stacks_and_exits_1_at_the_deadline():
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = _start(1.0, "hang", err)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 1
        assert time.monotonic() - t0 < 8
        text = _read(err)
        assert "Timeout" in text and "stuck_in_shutdown" in text


def test_sigusr1_prints_every_thread_and_keeps_running():
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = _start(5.0, "clean", err)
        try:
            proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 5
            while "most recent call first" not in _read(err) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "most recent call first" in _read(err)
            assert proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
