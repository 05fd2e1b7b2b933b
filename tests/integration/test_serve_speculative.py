"""`kvmesh serve --speculative-config` reaches the workers' engines, real processes throughout:
greedy completions through the official client, with async scheduling left on (the served
default), equal the offline engine's without speculation."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai

from gpu_worker import LLM, SamplingParams
from tests.integration.conftest import free_port
from tests.integration.stack import ROOT, wait_ready

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
PROMPTS = [[(7 * i) % 23 + 40 for i in range(24)], [(5 * i) % 11 + 300 for i in range(30)]]


def _serve(tiny_model: str, port: int, log) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    return subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", tiny_model, "--port", str(port),
                             "--device", "cpu", "--num-gpu-blocks", "512", "--enforce-eager", "--heartbeat-ms", "250",
                             "--lease-ms", "1500", "--speculative-config", SPEC],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_served_greedy_completions_equal_the_engine_without_speculation(tiny_model, tmp_path):
    llm = LLM(model=tiny_model, device="cpu", num_gpu_blocks=128)
    want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                    SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                                                    use_tqdm=False)]
    llm.llm_engine.close()
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = _serve(tiny_model, port, log)
    try:
        wait_ready(f"http://127.0.0.1:{port}", 180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        model = Path(tiny_model).name
        got = [client.completions.create(model=model, prompt=p, max_tokens=32, temperature=0.0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        assert got == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()

