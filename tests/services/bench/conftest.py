"""Fixtures: scripted mock OpenAI servers in subprocesses (so their timing is not disturbed by the
client's event loop), a tiny BPE tokenizer directory, and a real `kvmesh serve` with a tiny model."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from services.ports import free_port

REPO = Path(__file__).resolve().parents[3]


class MockServers:
    """Starts one mock server per distinct argument list, on first use; stops them at the end."""

    def __init__(self):
        self.procs: dict[tuple, tuple[subprocess.Popen, str]] = {}

    def get(self, *args: str) -> str:
        if args not in self.procs:
            port = free_port()
            # stderr to a file: a pipe nobody reads would block the server once it filled
            err = tempfile.TemporaryFile()
            proc = subprocess.Popen([sys.executable, "-m", "services.bench.mock_server", "--port", str(port), *args],
                                    cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                    env={**os.environ, "PYTHONPATH": str(REPO)})
            url = f"http://127.0.0.1:{port}"
            self.procs[args] = (proc, url)
            _wait_ready(proc, url, err)
        return self.procs[args][1]

    def close(self):
        for proc, _ in self.procs.values():
            proc.terminate()
        for proc, _ in self.procs.values():
            proc.wait(timeout=10)


def _wait_ready(proc: subprocess.Popen, url: str, err) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            err.seek(0)
            raise RuntimeError(f"mock server exited: {err.read().decode(errors='replace')[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("mock server did not start within 30 s")


@pytest.fixture(scope="session")
def mock_servers():
    servers = MockServers()
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer trained in milliseconds; written as <dir>/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world this is a tokenizer test sentence"] * 50
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    return str(path)


@pytest.fixture(scope="session")
def kvmesh_server(tmp_path_factory) -> str:
    """`kvmesh serve` with the tiny random-weight llama on the CPU (its tokenizer adds a bos);
    the base URL. Stopped with SIGTERM (SIGKILL if it hangs) at the end of the session."""
    root = tmp_path_factory.mktemp("kvmesh")
    model = root / "tiny-llama"
    subprocess.run([sys.executable, "-m", "services.cli", "make-model", "--arch", "llama", "--size", "tiny", str(model)],
                   cwd=REPO, check=True, capture_output=True, timeout=120)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["PYTHONPATH"] = str(REPO)
    log = open(root / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", str(model), "--port", str(port),
                             "--device", "cpu", "--num-gpu-blocks", "512", "--heartbeat-ms", "250"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_serving(proc, url, root / "serve.log")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_serving(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvmesh serve exited: {log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"kvmesh serve was not ready within 180 s: {log.read_text(errors='replace')[-3000:]}")
