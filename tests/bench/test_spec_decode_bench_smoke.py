"""bench/spec_decode_bench.py --smoke runs its whole flow on the CPU (its numbers mean nothing):
every line it prints says speculation gave the plain engine's tokens."""
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
    assert [(x["regime"], x["batch"]) for x in lines] == [("repeating", 1), ("repeating", 4), ("random", 1),
                                                          ("random", 4)]
    assert all(x["same_tokens"] for x in lines)
