"""Test helper: run kvmesh services as real processes (`python -m services.cli <svc>`) on loopback."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from services.embedded_redis import EmbeddedRedis
from services.security import bundle

from services.registry import list_records

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--lease-ms", "1500", "--heartbeat-ms", "250"]
INTERNAL = ["--host", "127.0.0.1", "--port", "0", "--zmq-port", "0"]


def make_trust(where: Path) -> Path:
    """A fresh trust directory (keys, certificates, Redis password) for one test stack."""
    return bundle.generate(where / "trust").root


class Procs:
    def __init__(self, redis_url: str, log_dir: Path, trust_dir: Path | None = None) -> None:
        self.redis_url, self.log_dir = redis_url, log_dir
        self.trust_dir = trust_dir if trust_dir is not None else make_trust(log_dir)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, service: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", service, "--redis-url", self.redis_url,
                                 "--log-level", "info", "--trust-dir", str(self.trust_dir), *args], cwd=ROOT, stdout=log, stderr=log, env=env)
        self.procs[name] = proc
        return proc

    def start_worker(self, name: str, model: str, *extra: str) -> subprocess.Popen:
        return self.start(name, "worker", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", model,
                          "--device", "cpu", "--worker-id", name, "--num-gpu-blocks", "1024",
                          "--max-num-seqs", "64", *extra)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def logs(self) -> str:
        return "\n".join(f"==== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.log_dir.glob("*.log"))


def records(redis_url: str, kind: str):
    """The registry's records of one kind, from synchronous test code; `redis_url` carries the
    password (EmbeddedRedis.client_url)."""
    return list_records(redis_url, kind, None)


def wait_for(pred, timeout_s: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def wait_ready(base_url: str, timeout_s: float = 120, procs: Procs | None = None) -> None:
    """Until the gateway's /ready answers 200. A timeout names its last answer (the 503's reason or
    the connection error); with `procs`, a service that exited meanwhile fails it at once."""
    last = ["no answer yet"]

    def ok() -> bool:
        if procs is not None and (dead := {n: p.returncode for n, p in procs.procs.items() if p.poll() is not None}):
            raise AssertionError(f"waiting for {base_url}/ready: services exited (name: exit code) {dead}")
        try:
            r = httpx.get(base_url + "/ready", timeout=2)
        except httpx.HTTPError as exc:
            last[0] = repr(exc)
            return False
        last[0] = f"{r.status_code} {r.text[:300]}"
        return r.status_code == 200
    try:
        wait_for(ok, timeout_s, f"{base_url}/ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; its last answer: {last[0]}") from None


@contextlib.contextmanager
def redis_and_procs(logs: Path):
    """An embedded Redis with the stack's password and a Procs for a test stack; the caller starts
    the services (they read the password from the trust directory; test code reads Redis through
    redis.client_url). On a failure the services' logs are printed; the processes and Redis always stop."""
    trust_dir = make_trust(logs)
    redis = EmbeddedRedis(password=bundle.Paths(trust_dir).redis_password.read_text().strip()).start()
    procs = Procs(redis.url, logs, trust_dir)
    try:
        yield redis, procs
    except BaseException:
        print(procs.logs())
        raise
    finally:
        procs.stop_all()
        redis.stop()
