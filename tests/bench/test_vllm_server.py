"""bench/vllm_server.py and serve_bench's vllm rows: what the peer server is started with (vLLM
itself runs only on the device, in the serve_bench `vllm` section), and how its numbers are set
beside kvmesh's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import serve_bench  # noqa: E402
from vllm_server import VllmServer  # noqa: E402


class _Log:
    def __init__(self, path: Path) -> None:
        self.fh, self.headers = open(path, "ab"), []

    def header(self, text: str) -> None:
        self.headers.append(text)


def _server(tmp_path: Path, site: Path) -> VllmServer:
    return VllmServer(tmp_path / "model", site, 16384, 0.9, _Log(tmp_path / "log"), lambda _msg: None,
                      ["--max-num-seqs=256"])


def test_command_serves_dummy_weights_of_the_model_on_loopback(tmp_path):
    cmd = _server(tmp_path, tmp_path / "site").command(4321)
    args = dict(zip(cmd[3::2], cmd[4::2]))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert args["--model"] == str(tmp_path / "model") and args["--load-format"] == "dummy"
    assert args["--host"] == "127.0.0.1" and args["--port"] == "4321" and args["--dtype"] == "bfloat16"
    assert args["--max-model-len"] == "16384" and args["--gpu-memory-utilization"] == "0.9"
    assert cmd[-1] == "--max-num-seqs=256"


def test_environment_has_only_vllms_site_on_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/site:/repo")
    env = _server(tmp_path, tmp_path / "vsite").environment()
    assert env["PYTHONPATH"] == str(tmp_path / "vsite")     # our wheels' pins differ from vLLM's
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and env["HF_HUB_OFFLINE"] == "1"


def test_start_without_vllm_in_the_site_names_the_flag(tmp_path):
    (tmp_path / "site").mkdir()
    server = _server(tmp_path, tmp_path / "site")
    with pytest.raises(RuntimeError, match="no vllm package in --vllm-site"):
        server.start(5)
    assert server.proc is None
    server.stop()                                            # nothing started: nothing to stop


def test_vllm_rows_give_kvmesh_over_vllm_with_the_better_direction():
    ours = {"total_token_throughput": 33000.0, "p99_itl_ms": 45.0, "mean_ttft_ms": 200.0,
            "median_ttft_ms": 150.0, "median_tpot_ms": 12.0}
    theirs = {"total_token_throughput": 30000.0, "p99_itl_ms": 180.0, "mean_ttft_ms": 600.0,
              "median_ttft_ms": 300.0, "median_tpot_ms": 13.2, "failed": 0}
    lines = serve_bench._vllm_lines("c64", "vllm c=64", ours, theirs)
    by_metric = {line[23:49].strip(): line for line in lines}
    assert "1.100x vLLM" in by_metric["total tok/s"]            # higher is better: ours / theirs
    assert "4.000x vLLM" in by_metric["p99 ITL ms"]             # lower is better: theirs / ours
    assert "30000.00" in by_metric["total tok/s"]
    assert serve_bench._vllm_lines("c1", "vllm c=1", ours, None) == []


def test_the_vllm_section_makes_the_same_runs_as_single():
    class Args:
        c1_prompts = c64_prompts = ph_prompts = 0
        single_runs = ["c1", "c64"]
    runs = serve_bench.single_runs(Args, serve_bench.Scale())
    assert [k for k, _, _ in runs] == ["c1", "c64"]
    c64 = runs[1][2]
    assert c64[c64.index("--random-input-len") + 1] == "1024" and c64[c64.index("--max-concurrency") + 1] == "64"
    Args.single_runs = ["c64"]
    assert [k for k, _, _ in serve_bench.single_runs(Args, serve_bench.Scale())] == ["c64"]
    Args.single_runs = ["ph"]                       # prefill-heavy: 4096 in / 256 out, 64 in flight
    (ph,) = [c for k, _, c in serve_bench.single_runs(Args, serve_bench.Scale()) if k == "ph"]
    assert [ph[ph.index(f) + 1] for f in ("--random-input-len", "--random-output-len", "--max-concurrency")] == \
        ["4096", "256", "64"]
