"""bench/spec_decode_bench.py --smoke runs its whole flow on the CPU (its numbers mean nothing):
every line it prints says speculation gave the plain engine's tokens, for both methods in every
regime, and the crossover summary names each one; the target as its own draft accepts all."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_spec_decode_bench_smoke():
    r = subprocess.run([sys.executable, "bench/spec_decode_bench.py", "--smoke"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    rows, summary = lines[:-1], lines[-1]["largest_batch_that_pays"]
    cases = ["ngram/repeating", "ngram/random", "draft_model/self-draft", "draft_model/independent-draft"]
    assert [(f"{x['method']}/{x['regime']}", x["batch"]) for x in rows] == [(c, b) for c in cases for b in (1, 4)]
    assert all(x["same_tokens"] for x in rows)
    assert all(x["acceptance_rate"] == 1.0 for x in rows if x["regime"] == "self-draft")
    assert sorted(summary) == sorted(cases)
