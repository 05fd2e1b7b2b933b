"""The pure helpers of the device scripts in bench/: vLLM's peer workload reproduced exactly,
kernel names sorted into families, and engine_perf.py's whole flow on the CPU (--smoke)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from kernel_profile import family, format_profile  # noqa: E402
from peer_workload import vllm_peer_sharegpt_lengths  # noqa: E402


def test_peer_workload_is_vllms():
    """run_peer.py measured these means (../shared/peer-vllm/, results_vllm_peer_2026-11-29.json)."""
    reqs = vllm_peer_sharegpt_lengths()
    assert len(reqs) == 1000
    assert sum(i for i, _ in reqs) / 1000 == pytest.approx(211.396, abs=1e-9)
    assert sum(o for _, o in reqs) / 1000 == pytest.approx(182.132, abs=1e-9)
    assert all(4 <= i <= 1024 and 4 <= o <= 1024 for i, o in reqs)


@pytest.mark.parametrize("name, fam", [
    ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "gemm (cublas)"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm (cublas)"),
    ("_gemv_kernel", "gemv (triton)"), ("_splitk_reduce_kernel", "gemv (triton)"),
    ("_decode_stage1_kernel", "decode attention"), ("_prefill_kernel_v2", "prefill attention"),
    ("_rmsnorm_kernel", "rmsnorm"), ("_rope_kv_write_kernel", "rope + kv write"),
    ("_swiglu_kernel", "swiglu"), ("_gumbel_argmax_kernel", "sampling"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16>", "embedding"),
    ("Memset (Device)", "copy / fill"), ("void at::native::vectorized_elementwise_kernel<4>", "other"),
])
def test_kernel_families(name, fam):
    assert family(name) == fam


def test_format_profile_orders_by_time():
    text = format_profile({"rmsnorm": (0.5, 65), "gemm (cublas)": (3.0, 129), "total": (3.5, 194)})
    assert text == "gemm (cublas) 3.000 ms 86% x129; rmsnorm 0.500 ms 14% x65; total 3.500 ms"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_engine_perf_smoke(tmp_path):
    """Every part that runs on the CPU, the prefill graphs (eager stand-in) and vLLM's workload."""
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    r = subprocess.run([sys.executable, "bench/engine_perf.py", "--smoke", "--model-dir", str(tmp_path / "tiny"),
                        "--budget", "200", "--skip", "ablation,sharegpt", "--sharegpt-temperature", "0",
                        "--sharegpt-seqs", "16", "--sharegpt-gc-ab", "--graph-max-bs", "8",
                        "--sharegpt-graph-cap", "4", "--closedloop-budgets", "64,256", "--closedloop-piecewise-ab",
                        "--live-profile", "mixed:1:1000:2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "engine_perf.json").read_text())
    errors = {k: v for k, v in res.items() if "ERROR" in v["value"] or "SKIPPED" in v["value"]}
    assert not errors, errors
    assert res["parity graphs vs eager (long)"]["value"] == "ok"
    assert "ttft 1 x 16 tokens (prefill graph)" in res and "ttft 1 x 16 tokens (eager)" in res
    # prefill at ~32k prompt tokens per length (S(): 1,024) and at vLLM's 16,384 (S(): 512)
    assert "tok/s" in res["prefill L=64 x16"]["value"] and "tok/s" in res["prefill L=64 x8 (vLLM's workload)"]["value"]
    scaled = sum(max(4, i // 32) for i, _ in vllm_peer_sharegpt_lengths(1000 // 32))   # --smoke's S()
    assert f"in {scaled} / out" in res["sharegpt 1000 reqs async"]["note"]            # vLLM's lengths
    # the A/B variants of the wide run, each with its step profile by rows
    for suffix in (" graphs<=4", " gc unfrozen", ""):
        assert "total tok/s" in res["sharegpt 1000 reqs async max_num_seqs=16" + suffix]["value"]
        assert "host " in res["sharegpt rows async max_num_seqs=16" + suffix]["value"]
    for budget in (64, 256):                                   # conc = min(64, S(640)) = 20
        for suffix in (" eager mixed", ""):                    # piecewise graphs hidden, then used
            label = f"closed-loop c20 budget={budget}{suffix}"
            assert "total tok/s" in res[label]["value"]
            assert "mixed tok <=" in res[label + " rows"]["value"]       # steps by kind and size
            trace = json.loads((tmp_path / "out" / f"closedloop_trace_c20_budget{budget}{suffix.replace(' ', '_')}.json").read_text())
            # idle: a call that launched nothing and only read the last step's tokens back (every
            # running sequence was at its last token: the engine schedules no step for it)
            kinds = [k for k, *_ in trace]
            assert set(kinds) - {"idle"} == {"decode", "mixed"} and all(t[3] > 0 for t in trace)
            assert kinds.count("idle") <= 20                 # each ends a request: at most one per request
    assert "live profile" in r.stdout and list((tmp_path / "out").glob("live_profile_mixed_*tok.txt"))


@pytest.mark.parametrize("script", ["sweep_gemm_rows.py", "sweep_decode_batch.py"])
def test_row_sweeps_smoke(tmp_path, script):
    """The two sweeps behind the ShareGPT profile run their whole flow on the CPU and write JSON."""
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    args = ["--smoke"] + (["--rows", "2,8"] if script == "sweep_gemm_rows.py" else [])
    r = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / script.replace(".py", ".json")).read_text())
    if script == "sweep_gemm_rows.py":
        assert [t["rows"] for t in res["table"]] == [2, 8]
        assert set(res["table"][0]["per_gemm"]) == {"qkv", "o_proj", "gate_up", "down", "lm_head"}
    else:
        assert res[0]["B"] == 3 and res[0]["err"] < 1e-3       # the kernel matches its reference


def test_gemv_fusion_sweep_smoke(tmp_path):
    """bench/sweep_gemv_fusions.py's whole flow on the CPU: every fused variant checked against
    the reference (err recorded), the unfused and fused layer sums, the JSON."""
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/sweep_gemv_fusions.py", "--smoke", "--ms", "1"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "sweep_gemv_fusions.json").read_text())
    assert {row["layer"] for row in res["rows"]} == {"qkv", "o_proj", "gate_up", "down"}
    assert all(row["err"] < 1e-2 for row in res["rows"])
    assert set(res["sums"]) == {"bf16 M=1", "fp8 M=1"} and "FUSED_TUNED entries" in r.stdout


def test_pdl_decode_ab_smoke(tmp_path):
    """bench/pdl_decode_ab.py's whole flow on the CPU (tiny model, graphs eager): every variant of
    both weight kinds measured once, greedy tokens compared with the mode's run without PDL."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/pdl_decode_ab.py", "--smoke", "--rounds", "1",
                        "--model-dir", str(tmp_path / "tiny")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    runs = json.loads((tmp_path / "pdl_decode_ab.json").read_text())["runs"]
    assert {(x["weights"], x["mode"]) for x in runs} == {("bf16", "cublas"), ("bf16", "fused"), ("bf16", "gemv"),
                                                        ("fp8", "gemv"), ("fp8", "fused")}
    assert all(x["sync_tok_s"] > 0 and x["tok_s_8k"] > 0 and len(x["tokens"]) == 8 for x in runs)
    assert "DIFFER" not in r.stdout and sum(line.endswith(" same") for line in r.stdout.splitlines()) == 7


def test_pdl_decode_ab_variants_flag(tmp_path):
    """--variants runs just the listed mode:pdl pairs for both weights; a bad one names the flag."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/pdl_decode_ab.py", "--smoke", "--rounds", "1", "--model-dir", str(tmp_path / "tiny")]
    r = subprocess.run(cmd + ["--variants", "gemv-ropekernel:1,gemv-only:3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    runs = json.loads((tmp_path / "pdl_decode_ab.json").read_text())["runs"]
    assert [(x["weights"], x["mode"], x["pdl"]) for x in runs] == [
        ("bf16", "gemv-ropekernel", 1), ("bf16", "gemv-only", 3), ("fp8", "gemv-ropekernel", 1), ("fp8", "gemv-only", 3)]
    bad = subprocess.run(cmd + ["--variants", "gemv:1,turbo:1"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--variants" in bad.stderr and "turbo" in bad.stderr


def test_pdl_decode_ab_attention_flag(tmp_path):
    """--attention crosses every variant with each decode-attention configuration (fp8 skipped
    with --fp8-variants none); a bad configuration names the flag."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/pdl_decode_ab.py", "--smoke", "--rounds", "1", "--model-dir", str(tmp_path / "tiny"),
           "--variants", "gemv:0"]
    r = subprocess.run(cmd + ["--attention", "u+2p,s4x32,s1x64h1+2p", "--fp8-variants", "none",
                              "--fp8-lm-head-variants", "gemv:0", "--fp8-attention", "s8x16"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    runs = json.loads((tmp_path / "pdl_decode_ab.json").read_text())["runs"]
    assert [(x["weights"], x["attn"]) for x in runs] == [("bf16", "u+2p"), ("bf16", "s4x32"), ("bf16", "s1x64h1+2p"),
                                                        ("fp8_lm_head", "s8x16")]
    res = json.loads((tmp_path / "pdl_decode_ab.json").read_text())
    assert [m["attn"] for m in res["means"]] == ["u+2p", "s4x32", "s1x64h1+2p", "s8x16"]
    assert "per attention configuration" in r.stdout and res["best_attention"] is None     # gemv:0 only
    bad = subprocess.run(cmd + ["--attention", "s8x16,split,s8x12"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--attention" in bad.stderr and "'split', 's8x12'" in bad.stderr


def test_sweep_gemv_in_graph_smoke(tmp_path):
    """bench/sweep_gemv_in_graph.py's flow on the CPU (tiny model: the timings are NaN, so the
    starting configs stay): both weight kinds swept, A/B'd, TUNED lines printed."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/sweep_gemv_in_graph.py", "--smoke", "--model-dir",
                        str(tmp_path / "tiny")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "sweep_gemv_in_graph.json").read_text())
    assert set(res) == {"16bit", "fp8"}
    for kind in res.values():
        assert kind["best"] == kind["start"] and len(kind["rows"]) == 8 and kind["ab"]["same_tokens"]
    assert r.stdout.count("GemvConfig(") == 8


def test_sweep_gemv_in_graph_shapes_flag(tmp_path):
    """--shapes picks the shapes swept; lm_head's key is 16-bit under any weights (the head stays
    bf16 with fp8 layers); an unknown name is refused naming the flag."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/sweep_gemv_in_graph.py", "--smoke", "--model-dir", str(tmp_path / "tiny")]
    r = subprocess.run(cmd + ["--shapes", "lm_head,qkv"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "sweep_gemv_in_graph.json").read_text())
    assert all(set(kind["best"]) == {"lm_head", "qkv"} for kind in res.values())
    assert r.stdout.count("('16bit', 1, 128256, 4096): GemvConfig(") == 2 and "('fp8', 1, 6144, 4096)" in r.stdout
    bad = subprocess.run(cmd + ["--shapes", "qkv,head"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "--shapes" in bad.stderr and "'qkv,head'" in bad.stderr


def test_pdl_decode_ab_cublas_head_mode(tmp_path):
    """gemv-cublashead switches the 16-bit head's GEMV off for its runs and back on for the others."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/pdl_decode_ab.py", "--smoke", "--model-dir", str(tmp_path / "tiny"),
                        "--variants", "gemv-cublashead:1,gemv:1", "--fp8-variants", "none", "--rounds", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    runs = json.loads((tmp_path / "pdl_decode_ab.json").read_text())["runs"]
    assert [x["mode"] for x in runs] == ["gemv-cublashead", "gemv"]


def test_sweep_gemm_sustained_smoke(tmp_path):
    """bench/sweep_gemm_sustained.py's flow on the CPU: a row per shape and backend, both rates."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/sweep_gemm_sustained.py", "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "sweep_gemm_sustained.json").read_text())
    assert [x["shape"] for x in rows] == ["square 64", "qkv M=32"]
    assert all(x["burst_tflops"] > 0 and x["sustained_tflops"] > 0 for x in rows)


def test_gpu_bench_engine_smoke(tmp_path):
    """bench/gpu_bench.py's ceilings and engine sections on the CPU: the engine as a GPU worker
    runs it (async scheduling), every engine line measured."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/gpu_bench.py", "--smoke", "--sections", "ceilings,engine"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert not res["errors"], res["errors"]
    text = json.dumps(res)
    for line in ("batch-1 decode ctx=128", "batched decode B=8", "prefill L=256", "offline throughput 12 reqs",
                 "async scheduling True"):
        assert line in text, line


def test_decode_sweep_splits_with_fused_rope_smoke(tmp_path):
    """--splits with --rope: the split configs run with RoPE + KV write fused in (on copies of the
    cache: the outputs checked against the default stay right) and are reported per split."""
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/sweep_decode_batch.py", "--smoke", "--splits", "1,2", "--rope"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "WRONG" not in r.stdout and "by split: 2:" in r.stdout
    res = json.loads((tmp_path / "sweep_decode_batch.json").read_text())
    assert list(res[0]["by_split"]) == ["2"] and res[0]["err"] < 1e-3


def test_decode_sweep_merges_smoke(tmp_path):
    """--merges sweeps each split count under every merge (best reported per split/merge), with
    --exact lengths; a bad --tiles is refused naming the flag."""
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/sweep_decode_batch.py", "--smoke", "--splits", "2", "--merges",
                        "last,two_pass", "--exact", "--max-context-len", "64"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "WRONG" not in r.stdout
    res = json.loads((tmp_path / "sweep_decode_batch.json").read_text())
    assert list(res[0]["by_split"]) == ["2/last", "2/two_pass"] and res[0]["err"] < 1e-3
    bad = subprocess.run([sys.executable, "bench/sweep_decode_batch.py", "--smoke", "--splits", "2", "--tiles", "64:4"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--tiles" in bad.stderr
