"""`kvmesh serve` hands an engine field it sets to every worker's engine, real processes
throughout: `--max-n` (a field only `LLM(...)` could set before the engine fields were one list)
bounds the samples a request may ask for, answered as a 400 through the official client."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import free_port
from tests.integration.stack import ROOT, wait_ready


def test_serve_engine_flag_reaches_the_workers_engine(tiny_model, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", tiny_model, "--port", str(port),
                             "--device", "cpu", "--num-gpu-blocks", "512", "--max-n", "2", "--enforce-eager",
                             "--heartbeat-ms", "250", "--lease-ms", "1500"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", 180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        model = Path(tiny_model).name
        ok = client.completions.create(model=model, prompt="hi", max_tokens=2, n=2, temperature=1.0)
        assert len(ok.choices) == 2
        with pytest.raises(openai.BadRequestError, match="at most 2 samples"):
            client.completions.create(model=model, prompt="hi", max_tokens=2, n=3, temperature=1.0)
        again = client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=0.0)
        assert again.choices[0].finish_reason == "length"      # the refused request cost nothing
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
