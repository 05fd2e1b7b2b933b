"""One kvmesh engine at a time measures a GPU's memory (gpu_worker/device_memory_lock.py): a second
engine waits until the first one's memory is allocated, a dead holder blocks no one, and a lock
file that is not ours is never followed."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpu_worker.config import EngineConfig
from gpu_worker.device_memory_lock import lock_path, measuring_device
from gpu_worker.engine_setup import measuring_memory

UUID = "GPU-test-0000"


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_a_second_engine_measures_only_after_the_first_is_done():
    order: list[str] = []
    first_in, release = threading.Event(), threading.Event()

    def first() -> None:
        with measuring_device(UUID):
            order.append("first measures")
            first_in.set()
            release.wait(10)
            order.append("first done")

    def second() -> None:
        with measuring_device(UUID):
            order.append("second measures")

    a = threading.Thread(target=first)
    a.start()
    assert first_in.wait(10)
    b = threading.Thread(target=second)
    b.start()
    time.sleep(0.5)
    assert order == ["first measures"]          # the second waits while the first holds the lock
    release.set()
    a.join(10)
    b.join(10)
    assert order == ["first measures", "first done", "second measures"]
    assert oct(os.stat(lock_path(UUID)).st_mode & 0o777) == "0o600"


def test_other_gpus_do_not_wait():
    done = threading.Event()

    def other() -> None:
        with measuring_device("GPU-other"):
            done.set()

    with measuring_device(UUID):
        t = threading.Thread(target=other)
        t.start()
        assert done.wait(5)
        t.join(5)


def test_a_killed_holder_releases_the_lock(runtime_dir):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from gpu_worker.device_memory_lock import measuring_device\n"
                               f"with measuring_device({UUID!r}):\n print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)},
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        t = time.monotonic()
        with measuring_device(UUID, max_wait_s=20):
            waited = time.monotonic() - t
        assert waited < 5
    finally:
        holder.kill()
        holder.wait()


def test_a_stuck_holder_is_waited_for_only_up_to_the_bound(caplog):
    with measuring_device(UUID):
        got = threading.Event()

        def waiter() -> None:
            with measuring_device(UUID, max_wait_s=0.5):
                got.set()

        with caplog.at_level(logging.INFO, logger="gpu_worker.device_memory_lock"):
            t = threading.Thread(target=waiter)
            t.start()
            assert got.wait(5)
            t.join(5)
    messages = [r.getMessage() for r in caplog.records]
    assert any("waiting for it" in m for m in messages)
    assert any("measuring anyway" in m for m in messages)


def test_a_link_in_the_lock_files_place_is_not_followed(runtime_dir, caplog):
    target = runtime_dir / "elsewhere"
    target.write_text("not a lock")
    os.symlink(target, lock_path(UUID))
    with caplog.at_level(logging.WARNING, logger="gpu_worker.device_memory_lock"):
        with measuring_device(UUID):
            pass
    assert target.read_text() == "not a lock"
    assert any("cannot be opened" in r.getMessage() for r in caplog.records)


def test_only_an_engine_that_measures_a_gpu_takes_the_lock(runtime_dir):
    for config in (EngineConfig(model="m", device="cpu"), EngineConfig(model="m", device="cuda", num_gpu_blocks=64)):
        with measuring_memory(config):
            pass
    assert not list(runtime_dir.iterdir())
