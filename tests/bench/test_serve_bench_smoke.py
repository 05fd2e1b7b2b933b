"""bench/serve_bench.py --smoke: the device script's whole flow on the CPU with the tiny model.

Makes the model, starts `kvmesh serve` (one worker, then two per routing mode) as real processes,
drives each with `kvmesh bench serve`, and checks the JSON, the files in $OUT and that no stack
is left running.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _procs_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(entry))
    return pids


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_serve_bench_smoke(tmp_path):
    out, model = tmp_path / "out", tmp_path / "tiny-llama"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["OUT"] = str(out)
    r = subprocess.run([sys.executable, "bench/serve_bench.py", "--smoke", "--model-dir", str(model),
                        "--time-budget", "230"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=260)
    log = (out / "serve_bench.log").read_text(errors="replace") if (out / "serve_bench.log").exists() else ""
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:] + log[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["serve_bench.json", "serve_bench.log"]
    res = json.loads((out / "serve_bench.json").read_text())
    assert res["errors"] == {} and res["skipped"] == {}

    single = res["sections"]["single"]
    for key, n in (("c1", 4), ("c64", 12)):
        assert single[key]["completed"] == n and single[key]["failed"] == 0, single[key]
        assert single[key]["median_ttft_ms"] > 0 and single[key]["total_token_throughput"] > 0
        stages = single[key]["stages"]                # the servers' TTFT split over the run
        assert {k: stages["counts"][k] for k in ("gateway_ttft", "worker_ttft", "worker_queue",
                                                 "worker_prefill", "worker_decode")} == dict.fromkeys(
            ("gateway_ttft", "worker_ttft", "worker_queue", "worker_prefill", "worker_decode"), n), stages
        assert 0 < stages["worker_ttft_ms"] <= stages["gateway_ttft_ms"] <= stages["client_ttft_ms"] + 1
        assert abs(stages["worker_queue_ms"] + stages["worker_prefill_ms"] - stages["worker_ttft_ms"]) < 0.01
        # the first token's path, hop by hop (the gateway detokenizes: kvmesh serve's default)
        path = ("gateway_submit", "gateway_tokenize", "gateway_upstream", "gateway_first_write", "scheduler_dispatch",
                "worker_admit", "worker_first_sync", "worker_first_send")
        assert {k: stages["counts"][k] for k in path} == dict.fromkeys(path, n), stages
        assert 1 <= stages["counts"]["detok_first_token"] <= n and stages["counts"]["scheduler_prefix_match"] == 0
        assert stages["gateway_tokenize_ms"] <= stages["gateway_submit_ms"] < stages["gateway_ttft_ms"]
        assert stages["worker_ttft_ms"] < stages["gateway_upstream_ms"] and stages["hops_ms"] is not None

    routing = res["sections"]["routing"]
    for mode in ("cache_aware", "round_robin"):
        run, workers = routing[mode]["run"], routing[mode]["workers"]
        assert run["completed"] == 12 and run["failed"] == 0, run
        assert run["cached_token_ratio"] > 0          # the groups share a system prompt
        assert len(workers) == 2 and sum(w["requests_total"] for w in workers.values()) == 12
        assert run["stages"]["counts"]["scheduler_prefix_match"] == (12 if mode == "cache_aware" else 0)
    assert sorted(w["requests_total"] for w in routing["round_robin"]["workers"].values()) == [6, 6]

    assert "2 workers round_robin" in r.stdout and "single c=1 32/8" in r.stdout   # the table, last
    assert not _procs_mentioning(str(model)), "a stack was left running"
