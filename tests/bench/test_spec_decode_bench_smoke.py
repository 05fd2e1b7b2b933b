"""bench/spec_decode_bench.py --smoke runs its whole flow on the CPU (its numbers mean nothing):
every line it prints says speculation gave the plain engine's tokens, for both methods in every
regime, and the crossover summary names each one; the target as its own draft accepts all. The
crossover sweep (last_paying, refine) is checked on made-up speedups."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from spec_decode_bench import crossover, last_paying, refine  # noqa: E402


def test_spec_decode_bench_smoke():
    r = subprocess.run([sys.executable, "bench/spec_decode_bench.py", "--smoke"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    rows, summary = lines[:-1], lines[-1]
    cases = ["ngram/repeating", "ngram/random", "draft_model/self-draft", "draft_model/independent-draft"]
    assert [(f"{x['method']}/{x['regime']}", x["batch"]) for x in rows] == [(c, b) for c in cases for b in (1, 4)]
    assert all(x["same_tokens"] for x in rows)
    assert all(x["acceptance_rate"] == 1.0 for x in rows if x["regime"] == "self-draft")
    assert all(x["decode_row_steps"] > 0 for x in rows if x["regime"] == "self-draft")   # verified as decode rows
    assert sorted(summary["largest_batch_that_pays"]) == sorted(cases)
    assert summary["recommended_from"] == "ngram/repeating"
    assert summary["recommended_disable_by_batch_size"] == (summary["largest_batch_that_pays"]["ngram/repeating"] or 1)


def test_the_crossover_is_the_last_batch_before_the_first_loss():
    assert last_paying({1: 1.8, 2: 1.5, 4: 1.1, 8: 0.9, 16: 1.01}) == 4     # 16: noise past a loss
    assert last_paying({1: 0.95, 2: 1.2}) is None
    assert last_paying({1: 1.3, 64: 1.1}) == 64


def test_refine_bisects_to_the_crossover_within_an_eighth():
    true_crossover = 41                                  # pays up to 41 sequences, not above

    def speedup(batch: int) -> float:
        return 1.2 if batch <= true_crossover else 0.9

    tried = []
    speedups = {b: speedup(b) for b in (1, 2, 4, 8, 16, 32, 64)}
    refine(speedups, lambda b: tried.append(b) or speedup(b))
    assert tried == [48, 40, 44]                         # 40 pays, 44 does not: 44 - 40 <= 40 // 8
    assert last_paying(speedups) == 40
    rows = [{"method": "ngram", "regime": "repeating", "batch": b, "speedup": s} for b, s in speedups.items()]
    assert crossover(rows)["recommended_disable_by_batch_size"] == 40
