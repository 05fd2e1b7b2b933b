"""bench/fp32_dots_speed.py's whole flow on the CPU: a child per F32_DOTS precision, both kernels
checked against their fp32 references, the JSON and the table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fp32_dots_speed_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/fp32_dots_speed.py", "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "fp32_dots_speed.json").read_text())
    assert [x["precision"] for x in res] == ["tf32", "tf32x3", "ieee"]
    assert set(res[1]["rows"]) == {"float32", "bfloat16"}            # bf16 once, beside the default
    cases = [m for x in res for rows in x["rows"].values() for m in rows.values()]
    assert len(cases) == 8 and all(m["err"] < 1e-4 for m in cases)   # the interpreter's dots are fp32
    assert r.stdout.count(" prefill 2 x 24 ") == 4 and r.stdout.count(" decode 3 x 40 ") == 4
