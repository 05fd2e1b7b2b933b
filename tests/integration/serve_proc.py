"""Test helper: a real `kvmesh serve` process, and its children found through /proc."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from services.ports import free_port
from tests.integration.stack import ROOT, wait_for, wait_ready

BANNER = "kvmesh is serving"


class Serve:
    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        """env: KVMESH_* settings of its services (the test's own environment's are dropped)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "serve.log"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}, **(env or {})}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--port", str(self.port),
                                          "--heartbeat-ms", "250", "--lease-ms", "1500", *args],
                                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)   # its own process group, as in a terminal

    def wait_serving(self, timeout_s: float = 180) -> None:
        """Until the banner: the launcher prints it once every worker is registered."""
        wait_ready(self.base_url, timeout_s)
        wait_for(lambda: BANNER in self.log(), 60, "the launcher's banner")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def openai(self):
        import openai
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="none", timeout=60, max_retries=0)

    def child(self, needle: str) -> int | None:
        """The pid of the live child whose command line holds `needle` (e.g. "--worker-id worker-0")."""
        for pid in children(self.proc.pid):
            try:
                if needle in cmdline(pid) and not is_zombie(pid):
                    return pid
            except OSError:      # exited meanwhile
                continue
        return None

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM, as Ctrl-C would; kills after timeout_s so a test never leaves it behind."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"kvmesh serve did not stop within {timeout_s}s of SIGTERM")


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read()
    except OSError:
        return True
