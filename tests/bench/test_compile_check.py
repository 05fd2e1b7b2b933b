"""bench/compile_check.py compiles a decode layer's attention kernels for sm_90 here, with no GPU
(Triton's bundled ptxas): the GPU-only code the interpreter never runs (PDL, atomics, cache
modifiers, the JIT's specializations) must compile, and each configuration must launch the
kernels and grids it is meant to."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_attention_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT=str(tmp_path), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "bench/compile_check.py", "--attention", "u+2p,s8x16,s1x64h1"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "compile_check.json").read_text())["rows"]
    launches = {}                                          # (config, context) -> [(kernel, grid, atomics)]
    for x in rows:
        launches.setdefault((x["config"], x["case"].split()[0]), []).append((x["kernel"], x["grid"], x["atom"] > 0))
    assert all(x["regs"] > 0 for x in rows)                # every launch compiled and was read back
    # the defaults: RoPE + KV write its own kernel, 8 programs at 128 tokens; 32 splits merged by a
    # second kernel at 8k
    assert launches[("u+2p", "128")] == [("_rope_kv_write_kernel", [1], False), ("_decode_stage1_kernel", [1, 8, 1], False)]
    assert launches[("u+2p", "8k")] == [("_decode_stage1_kernel", [1, 8, 32], False), ("_decode_stage2_kernel", [1, 32], False)]
    # one kernel a layer: 8 partitions merged in the launch (an atomic), or a program per query head
    assert launches[("s8x16", "128")] == [("_decode_stage1_kernel", [1, 8, 8], True)]
    assert launches[("s8x16", "8k")] == [("_decode_stage1_kernel", [1, 8, 32], True)]
    assert launches[("s1x64h1", "128")] == [("_decode_stage1_kernel", [1, 32, 1], False)]
    bad = subprocess.run([sys.executable, "bench/compile_check.py", "--attention", "s8x16,turbo"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--attention" in bad.stderr and "turbo" in bad.stderr


def test_prefill_attention_kernels_compile_for_sm90(tmp_path):
    """Both prefill kernels under their default configurations, TMA descriptors included: every
    one compiles and reads its tiles through TMA (UTMALDG); the fresh kernel without spilling for
    fresh prompts, and behind a cached prefix spilling no more than v2 (Triton 3.9 spills 32 bytes
    of both at 128 x 128 tiles; 3.6, the H200's, neither)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT=str(tmp_path), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "bench/compile_check.py", "--prefill"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "compile_check_prefill.json").read_text())["rows"]
    assert {x["kernel"] for x in rows} == {"_prefill_kernel_v2", "_fresh_prefill_kernel"}
    fresh = [x for x in rows if x["config"].startswith("fresh default")]
    assert {x["case"] for x in fresh} == {"fresh", "behind 1k"}
    assert all(x["tma"] > 0 and x["mma"] > 0 for x in fresh)
    v2_stack = max(x["stack"] for x in rows if x["kernel"] == "_prefill_kernel_v2")
    assert all(x["stack"] == 0 if x["case"] == "fresh" else x["stack"] <= v2_stack for x in fresh)
    bad = subprocess.run([sys.executable, "bench/compile_check.py", "--prefill", "FreshConfig(64", "turbo"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--prefill" in bad.stderr and "FreshConfig(64" in bad.stderr
