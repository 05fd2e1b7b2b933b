"""One stack for the whole integration session: embedded Redis, tokenizer, scheduler, one tiny CPU
worker and a gateway, each a real process. Tests that need more (API keys, more workers) add
processes to it."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.ports import free_port  # noqa: F401  (the integration tests import it from here)
from tests.integration.stack import FAST, INTERNAL, Procs, ROOT, records, redis_and_procs, wait_ready


@dataclass
class Stack:
    procs: Procs
    redis_url: str
    model: str
    model_name: str
    base_url: str

    def openai(self, api_key: str = "none", base_url: str | None = None):
        import openai
        return openai.OpenAI(base_url=(base_url or self.base_url) + "/v1", api_key=api_key, timeout=60, max_retries=0)

    def worker(self, worker_id: str):
        return next((r for r in records(self.redis_url, "worker") if r.id == worker_id), None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("model") / "tiny-llama"
    subprocess.run([sys.executable, "-m", "services.cli", "make-model", "--arch", "llama", "--size", "tiny",
                    str(out)], cwd=ROOT, check=True, capture_output=True)
    return str(out)


@pytest.fixture(scope="session")
def stack(tiny_model, tmp_path_factory):
    port = free_port()
    with redis_and_procs(tmp_path_factory.mktemp("logs")) as (redis, procs):
        # metrics pages: test_bad_input_checklist.py reads each inbox's dropped-frame counter
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "0", "--model", tiny_model)
        procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", "0")
        procs.start("prefix-cache", "prefix-cache", *FAST, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0")
        procs.start_worker("worker-0", tiny_model, "--metrics-port", "0")
        procs.start("gateway", "gateway", *FAST, "--port", str(port), "--zmq-port", "0")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, 180, procs)
        yield Stack(procs, redis.client_url, tiny_model, Path(tiny_model).name, base)
