"""Cache-aware routing end to end: `kvmesh serve --workers 2` driven by `kvmesh bench serve` on the
generated-shared-prefix workload keeps a single worker's prefix hit rate while both workers work."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from contextlib import contextmanager

import httpx

from services.embedded_redis import EmbeddedRedis
from tests.integration.conftest import free_port
from tests.integration.stack import ROOT, records, wait_for, wait_ready

# 6 groups x 8 prompts: a shared system prompt of 4 blocks (64 tokens) + a 16-token question.
# --ignore-eos: the random model may answer a prompt with EOS at once, an empty completion that
# the bench (as vLLM's) counts as a failed request.
GSP = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "6", "--gsp-prompts-per-group", "8",
       "--gsp-system-prompt-len", "64", "--gsp-question-len", "16", "--gsp-output-len", "2",
       "--request-rate", "inf", "--max-concurrency", "4", "--seed", "3", "--ignore-eos"]


@contextmanager
def serve(model: str, workers: int, log_path, *flags: str):
    """`kvmesh serve` on its own Redis (so the test can read the registry); yields (base URL, Redis URL).
    The Redis has a password of its own, given in the URL (an external Redis: redis_client.connect),
    through the environment (a command line is readable by every local user)."""
    redis = EmbeddedRedis(password=secrets.token_urlsafe(16)).start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["KVMESH_REDIS_URL"] = redis.client_url
    # The index's answers are what this test measures: a deadline a busy 2-core host meets (at the
    # 50 ms default, every Match timing out there routes by load alone, and the breaker keeps it so).
    env["KVMESH_PREFIX_MATCH_TIMEOUT_MS"] = "2000"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", model, "--workers",
                                 str(workers), "--device", "cpu", "--num-gpu-blocks", "512", "--port", str(port),
                                 "--heartbeat-ms", "250", "--lease-ms", "1500", *flags],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, 60)
        # /ready needs one worker, and the scheduler and the prefix-cache index discover the others
        # on their own clocks (the index every second): wait until both know all of them, or a
        # benchmark that ends in a second is routed without them (every request to one worker, or
        # every Match a miss)
        wait_for(lambda: scheduler_metric(redis.client_url, "kvmesh_scheduler_workers").get("") == workers, 60,
                 f"the scheduler to see {workers} workers")
        if workers > 1:      # one worker: kvmesh serve starts no index (the scheduler would not ask it)
            wait_for(lambda: [r.load.get("workers") for r in records(redis.client_url, "prefix-cache")] == [workers],
                     60, f"the prefix-cache index to follow {workers} workers")
        yield base, redis.client_url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        redis.stop()


def bench(base: str, model: str, out_dir) -> dict:
    subprocess.run([sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", base, "--tokenizer", model,
                    *GSP, "--disable-tqdm", "--no-plots", "--save-result", "--result-dir", str(out_dir),
                    "--result-filename", "result.json"], cwd=ROOT, check=True, capture_output=True, timeout=60)
    return json.loads((out_dir / "result.json").read_text())


def scheduler_metric(redis_url: str, name: str) -> dict[str, float]:
    """{labels text: value} of one metric family on the scheduler's /metrics."""
    [sched] = records(redis_url, "scheduler")
    text = httpx.get(sched.addrs["metrics"], timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


def test_two_workers_keep_the_single_worker_hit_rate(tiny_model, tmp_path):
    rates = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        out.mkdir()
        with serve(tiny_model, workers, tmp_path / f"serve-{workers}.log") as (base, redis_url):
            result = bench(base, tiny_model, out)
            assert result["completed"] == 48 and not result["failure_reasons"], result["failure_reasons"]
            rates[workers] = result["cached_token_ratio"]
            if workers == 2:
                loads = {r.id: r.load for r in records(redis_url, "worker")}
                assert set(loads) == {"worker-0", "worker-1"}
                for wid, load in loads.items():      # both took load (engine counters, registry)
                    assert load["prefix_query_tokens"] > 0, (wid, loads)
                dispatched = scheduler_metric(redis_url, "kvmesh_scheduler_dispatched_total")
                assert len(dispatched) == 2 and min(dispatched.values()) >= 4, dispatched
                # the scheduler exports the per-worker and cluster hit ratios from the same counters
                per_worker = scheduler_metric(redis_url, "kvmesh_worker_prefix_hit_ratio")
                cluster = scheduler_metric(redis_url, "kvmesh_cluster_prefix_hit_ratio")
                assert len(per_worker) == 2 and cluster[""] > 0.3, (per_worker, cluster)
                assert scheduler_metric(redis_url, "kvmesh_scheduler_prefix_matches_total").get(
                    '{outcome="hit"}', 0) > 0
    print("cached token ratio by worker count:", rates)
    assert rates[1] > 0.4, rates
    assert abs(rates[2] - rates[1]) <= 0.05, rates
