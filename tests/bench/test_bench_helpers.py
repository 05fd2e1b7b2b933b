"""The device scripts in bench/ on the CPU: vLLM's peer workload reproduced exactly, kernel names
sorted into families, the whole flows of engine_perf.py, gpu_bench.py and offline_bench.py at toy
sizes, and plot.py drawing from the stored results."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_timing import family, format_profile  # noqa: E402
from offline_bench import vllm_peer_sharegpt_lengths  # noqa: E402


def test_peer_workload_is_vllms():
    """vLLM's peer run measured these means (bench/results/vllm_peer_2026-12-02.json)."""
    reqs = vllm_peer_sharegpt_lengths()
    assert len(reqs) == 1000
    assert sum(i for i, _ in reqs) / 1000 == pytest.approx(211.396, abs=1e-9)
    assert sum(o for _, o in reqs) / 1000 == pytest.approx(182.132, abs=1e-9)
    assert all(4 <= i <= 1024 and 4 <= o <= 1024 for i, o in reqs)


@pytest.mark.parametrize("name, fam", [
    ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "gemm (cublas)"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm (cublas)"),
    ("_gemv_kernel", "gemv (triton)"), ("_splitk_reduce_kernel", "gemv (triton)"),
    ("_decode_stage1_kernel", "decode attention"), ("_prefill_kernel", "prefill attention"),
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


def test_gpu_bench_sustained_gemm_smoke(tmp_path):
    """gpu_bench.py's sustained section on the CPU: a row per shape and backend, both rates, which
    plot.py draws."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/gpu_bench.py", "--smoke", "--sections", "sustained"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert not res["errors"], res["errors"]
    rows = res["sustained_gemm"]
    assert [x["shape"] for x in rows] == ["square 64", "qkv M=32"]
    assert all(x["burst_tflops"] > 0 and x["sustained_tflops"] > 0 for x in rows)
    r = subprocess.run([sys.executable, "bench/plot.py", "gemm", "--gemm", str(tmp_path / "gpu_bench.json"),
                        "--out", str(tmp_path / "gemm.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "gemm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_gpu_bench_kv_transfer_smoke(tmp_path):
    """bench/gpu_bench.py's kv_transfer section on the CPU: a hand-off per path (zmq frames after the
    first token, zmq frames streamed during the prefill, the same through the shared-memory ring,
    D reading P's cache, NIXL where installed), each acknowledged by the decode worker, with its
    bytes, P's prefill time and the overlap; the streamed paths stream, the cache read does not,
    and the device-copy ceiling of that read is beside it."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/gpu_bench.py", "--smoke", "--sections", "kv_transfer"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert not res["errors"], res["errors"]
    text = json.dumps(res)
    same_host = ["shm", "shm_streamed", "cuda_ipc"] if "shm L=128" in text else []
    paths = ["zmq", "zmq_streamed"] + same_host + (["nixl"] if "nixl L=128" in text else [])
    rows = res["sections"]["kv_transfer"]
    transfers = {m.split(" L=")[0]: r["note"] for m, r in rows.items() if "transfer after" in m}
    assert sorted(transfers) == sorted(paths)
    for path, note in transfers.items():
        assert "prefill on P" in note and note.endswith("; ack"), (path, note)
        assert f"{path} L=128 first token -> D's first decode token" in rows
    for path in ("zmq_streamed", "shm_streamed")[:1 + bool(same_host)]:
        assert re.search(path + r" L=128 transfer[^;]*;[^;]*; [1-9]\d* blocks streamed during the prefill", text), path
    if same_host:
        assert re.search(r"cuda_ipc L=128 transfer[^;]*;[^;]*; 0 blocks streamed", text), text
        assert "device copy ceiling L=128" in text


def test_plot_vs_vllm_from_stored_results(tmp_path):
    """plot.py vs-vllm draws the README's figure from the stored JSON it cites."""
    out = tmp_path / "vs.png"
    r = subprocess.run([sys.executable, "bench/plot.py", "vs-vllm", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_offline_bench_kvmesh_smoke(tmp_path):
    """offline_bench.py through kvmesh's LLM(...) at toy sizes on the CPU: every line, with the
    --engine-arg values reaching the engine; a malformed --engine-arg is refused naming the flag."""
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "services.cli", "make-model", "--arch", "llama", "--size", "tiny",
                    str(model)], cwd=ROOT, check=True, capture_output=True, timeout=200)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHONPATH": str(ROOT)}
    args = ["--engine-arg", "device=cpu", "--engine-arg", "dtype=float32", "--engine-arg", "attention_backend=torch",
            "--engine-arg", "max_model_len=1024", "--engine-arg", "max_num_seqs=8"]
    r = subprocess.run([sys.executable, "bench/offline_bench.py", "--engine", "kvmesh", "--model-dir", str(model),
                        "--scale", "0.02", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "out" / "offline_bench_kvmesh.json").read_text())
    assert res["engine_args"]["max_num_seqs"] == 8
    for key in ("bs1_decode_tok_s_ctx128", "bs1_decode_tok_s_ctx8192", "prefill_tok_s_512", "prefill_tok_s_2048",
                "prefill_tok_s_8192", "decode_bs64_out_tok_s", "decode_bs256_out_tok_s", "sharegpt_like_total_tok_s"):
        assert res[key] > 0, key
    bad = subprocess.run([sys.executable, "bench/offline_bench.py", "--engine", "kvmesh", "--model-dir", str(model),
                          "--engine-arg", "max_num_seqs"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0 and "--engine-arg" in bad.stderr
