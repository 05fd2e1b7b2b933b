"""`kvmesh serve --speculative-config` with a draft model, real processes throughout: greedy
completions through the official client equal the engine's without speculation; the worker's
/metrics counts the drafts (the draft is the target itself, so every draft is accepted, at every
position); `kvmesh bench serve --metrics-url` reports the run's acceptance."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from gpu_worker import LLM, SamplingParams
from tests.integration.stack import ROOT, records
from tests.integration.test_prefix_routing import serve

K = 3
PROMPTS = [[(7 * i) % 23 + 40 for i in range(24)], [(5 * i) % 11 + 300 for i in range(30)]]
MAX_TOKENS = 1 + 4 * (K + 1)     # the prefill's token, then 4 steps of k drafts + 1


def spec_counters(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        if family.name.startswith("kvmesh_spec_decode_"):
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.name + ("" if "position" not in s.labels else f"[{s.labels['position']}]")] = s.value
                    assert s.labels["method"] == "draft_model"
    return out


def test_draft_model_served_counted_and_benchmarked(tiny_model, tmp_path):
    llm = LLM(model=tiny_model, device="cpu", num_gpu_blocks=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)]
    llm.llm_engine.close()
    spec = json.dumps({"method": "draft_model", "model": tiny_model, "num_speculative_tokens": K})
    with serve(tiny_model, 1, tmp_path / "serve.log", "--enforce-eager",
               "--speculative-config", spec) as (base, redis_url):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        model = Path(tiny_model).name
        got = [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        assert got == want
        metrics_url = records(redis_url, "worker")[0].addrs["metrics"]
        want_counts = {"kvmesh_spec_decode_num_drafts_total": 8.0, "kvmesh_spec_decode_num_draft_tokens_total": 8.0 * K,
                       "kvmesh_spec_decode_num_accepted_tokens_total": 8.0 * K,
                       **{f"kvmesh_spec_decode_num_accepted_tokens_per_pos_total[{p}]": 8.0 for p in range(K)}}
        from tests.integration.stack import wait_for
        wait_for(lambda: spec_counters(metrics_url) == want_counts, 30, "the worker's speculation counters")
        proc = subprocess.run([sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", base,
                               "--tokenizer", tiny_model, "--dataset-name", "random", "--random-input-len", "16",
                               "--random-output-len", str(MAX_TOKENS), "--num-prompts", "4", "--ignore-eos",
                               "--metrics-url", metrics_url, "--disable-tqdm", "--no-plots"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Speculative decoding" in proc.stdout and "Acceptance rate (%):" in proc.stdout
        line = next(x for x in proc.stdout.splitlines() if x.startswith("Acceptance rate (%):"))
        assert float(line.split(":")[1]) == 100.0
