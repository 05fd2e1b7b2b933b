"""Expert parallelism (all-to-all dispatch/combine) and MoE tensor parallelism over 2 gloo ranks
reproduce the single-rank layer. The ranks are plain subprocesses (no pickle)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[2]


def test_moe_ep2_and_tp2_match_single_rank():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = str(HERE / "moe_rank_main.py")
    rank0 = subprocess.Popen([sys.executable, script, "0", "2", "0"], env=env, stdout=subprocess.PIPE, text=True)
    port = rank0.stdout.readline().strip()
    rank1 = subprocess.run([sys.executable, script, "1", "2", port], env=env, capture_output=True, text=True,
                           timeout=120)
    out0, _ = rank0.communicate(timeout=120)
    assert rank1.returncode == 0, rank1.stderr[-3000:]
    assert rank0.returncode == 0
    assert "rank 0 ok" in out0 and "rank 1 ok" in rank1.stdout
