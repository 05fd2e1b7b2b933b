"""vLLM's own OpenAI server as the peer of `kvmesh serve` in bench/serve_bench.py (issue #4).

`python3 -m vllm.entrypoints.openai.api_server` on the same random-weight model directory
(`--load-format dummy`: vLLM draws its own random weights of the model's shape; the tokenizer is
the directory's, the one `kvmesh bench serve` builds the prompts with), with vLLM's serving
defaults otherwise (on an H200 that is an 8,192-token step budget and CUDA graphs up to 512
rows). It runs from its own site folder (`--vllm-site`, what `../shared/peer-vllm/` installs:
vLLM's pins differ from ours, so none of our wheels are on its path), in its own process group,
stopped with SIGTERM and then SIGKILL. The benchmark client is ours, unchanged, so both servers
see the same requests: same dataset, seed, lengths and concurrency.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

from process_group import die_with_parent, stop_group   # bench/, this module's directory
from services.ports import free_port

# FlashInfer is not carried to the device (peer-vllm README); the rest keeps vLLM off the network.
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}


def http_ok(url: str) -> bool:
    """Whether GET url answers 200 within 2 s (a server's readiness probe; serve_bench's too)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class VllmServer:
    """The interface bench_client needs of a stack: name, model, url, proc; start() and stop().
    `log` is serve_bench's CombinedLog (header(), fh); the server's output goes to its file."""

    def __init__(self, model: Path, site: Path, max_model_len: int, gpu_memory_utilization: float,
                 log, say: Callable[[str], None], extra_flags: list[str] | None = None) -> None:
        self.name, self.model, self.site = "vllm", model, site
        self.max_model_len, self.gpu_memory_utilization = max_model_len, gpu_memory_utilization
        self.log, self.say = log, say
        self.extra_flags = list(extra_flags or [])
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--load-format", "dummy", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", str(self.max_model_len),
                "--gpu-memory-utilization", str(self.gpu_memory_utilization), "--seed", "0",
                *self.extra_flags]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(self.site)
        env.update(VLLM_ENV)
        return env

    def start(self, timeout_s: float) -> float:
        if not (self.site / "vllm").is_dir():
            raise RuntimeError(f"no vllm package in --vllm-site {self.site} (install ../shared/peer-vllm/'s wheels "
                               "there first)")
        t = time.time()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = self.command(port)
        self.log.header(f"stack vllm: {' '.join(cmd[1:])}  [PYTHONPATH={self.site}]")
        self.say(f"stack vllm: starting ({' '.join(cmd[2:])})")
        self.proc = subprocess.Popen(cmd, env=self.environment(), stdout=self.log.fh, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm exited with code {self.proc.returncode} during start-up "
                                   "(see serve_bench.log)")
            if self._http_ok("/health") and self._http_ok("/v1/models"):
                took = time.time() - t
                self.say(f"stack vllm: ready in {took:.1f} s")
                return took
            time.sleep(1.0)
        raise RuntimeError(f"vllm not ready within {timeout_s:.0f} s")

    def _http_ok(self, path: str) -> bool:
        return http_ok(self.url + path)

    def stop(self) -> None:
        if self.proc is None:
            return
        t = time.time()
        stop_group(self.proc, 45, "stack vllm", self.say)
        self.log.header(f"stack vllm: stopped (exit {self.proc.returncode})")
        self.say(f"stack vllm: stopped in {time.time() - t:.1f} s (exit {self.proc.returncode})")
        self.proc = None
