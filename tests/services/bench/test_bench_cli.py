"""`kvmesh bench serve` end to end: sweeps, JSON keys, plots, flag errors."""
import json

import pytest

from services.bench.cli import main
from services.cli import main as kvmesh_main

VLLM_KEYS = {"duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "total_token_throughput", "request_goodput", "ttfts", "itls", "input_lens",
             "output_lens", "errors", "generated_texts"} | {
    f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_sweep_writes_one_result_per_rate_and_plots(mock_servers, tmp_path, capsys):
    url = mock_servers.get("--ttft-ms", "20", "--itl-ms", "5")
    rc = kvmesh_main(["bench", "serve", "--base-url", url, "--num-prompts", "6", "--random-input-len", "30",
                      "--random-output-len", "4", "--request-rate", "20,inf", "--max-concurrency", "3",
                      "--goodput", "ttft:500", "tpot:100", "--metric-percentiles", "50,90,99",
                      "--save-result", "--result-dir", str(tmp_path), "--result-filename", "run.json",
                      "--disable-tqdm", "--num-warmups", "2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert printed.count("Serving Benchmark Result") == 2 and "P90 TTFT (ms):" in printed
    assert "Sweep summary" in printed
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "run-20qps.json" in files and "run-infqps.json" in files
    for rate, name in (("20", "run-20qps.json"), ("inf", "run-infqps.json")):
        result = json.loads((tmp_path / name).read_text())
        assert VLLM_KEYS <= result.keys()
        assert result["completed"] == 6 and len(result["ttfts"]) == 6 and result["errors"] == [""] * 6
        assert result["total_output_tokens"] == 24 and result["model_id"] == "mock-model"
        assert result["request_goodput"] == pytest.approx(result["request_throughput"])
        assert result["request_rate"] == (20.0 if rate == "20" else "inf")
        assert "p50_ttft_ms" in result and "p90_itl_ms" in result
    pngs = [p for p in tmp_path.iterdir() if p.suffix == ".png"]
    assert {p.name for p in pngs} >= {"run-20qps-latency-cdf.png", "run-20qps-throughput.png",
                                      "run-infqps-latency-cdf.png", "run-sweep.png"}
    assert all(p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000 for p in pngs)


def test_chat_backend_with_default_model_and_api_key(mock_servers, tmp_path, capsys, tiny_tokenizer):
    url = mock_servers.get("--ttft-ms", "10", "--itl-ms", "2", "--api-key", "sekret")
    args = ["bench", "serve", "--base-url", url + "/v1", "--backend", "openai-chat", "--dataset-name",
            "sharegpt-synthetic", "--num-prompts", "4", "--disable-tqdm", "--no-plots", "--save-result",
            "--result-dir", str(tmp_path), "--api-key", "sekret", "--extra-body", '{"max_tokens": 3}']
    assert kvmesh_main(args) == 0
    (path,) = tmp_path.glob("openai-chat-infqps-mock-model-*.json")
    result = json.loads(path.read_text())
    assert result["completed"] == 4 and result["total_output_tokens"] == 12
    # A wrong key: the server's /tokenize refuses it before any request is sent...
    with pytest.raises(SystemExit) as exc:
        kvmesh_main(args[:-4] + ["--api-key", "wrong"])
    assert "HTTP 401" in str(exc.value) and "--api-key" in str(exc.value) and "--tokenizer" in str(exc.value)
    # ... and with a local tokenizer every request fails with 401, counted by reason: the run measured
    # nothing, so it exits 1 with one line saying why (the JSON result keeps its shape).
    capsys.readouterr()
    assert kvmesh_main(args[:-4] + ["--api-key", "wrong", "--tokenizer", tiny_tokenizer]) == 1
    out, err = capsys.readouterr()
    assert "HTTP 401:" in out
    (line,) = [x for x in err.splitlines() if "requests failed" in x]
    assert line.startswith("kvmesh bench: all 4 requests failed (the first: HTTP 401: ") and "invalid API key" in line
    (path,) = sorted(tmp_path.glob("openai-chat-infqps-mock-model-*.json"))[-1:]
    failed = json.loads(path.read_text())
    assert failed.keys() == result.keys() and failed["completed"] == 0 and failed["failed"] == 4


def test_some_requests_failed_is_said_on_stderr_and_exits_0(mock_servers, tmp_path, capsys):
    url = mock_servers.get("--ttft-ms", "5", "--itl-ms", "1", "--fail", "500:2")
    rc = kvmesh_main(["bench", "serve", "--base-url", url, "--num-prompts", "4", "--random-input-len", "16",
                      "--random-output-len", "2", "--max-concurrency", "1", "--disable-tqdm", "--no-plots"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Failed requests:                         2" in out
    assert "kvmesh bench: WARNING: 2 of 4 requests failed (the first: HTTP 500: " in err


@pytest.mark.parametrize("argv, flag", [
    (["--request-rate", "fast"], "--request-rate"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--goodput", "foo:1"], "--goodput"),
    (["--metric-percentiles", "120"], "--metric-percentiles"),
    (["--percentile-metrics", "ttft,xyz"], "--percentile-metrics"),
    (["--dataset-name", "nope"], "--dataset-name"),
    (["--num-prompts", "many"], "--num-prompts"),
    (["--dataset-name", "multi-turn", "--backend", "openai"], "multi-turn"),
    (["--prompt-token-ids"], "--prompt-token-ids"),
    (["--dataset-name", "multi-turn", "--multi-turn-turns", "0"], "--multi-turn-turns"),
    (["--dataset-name", "multi-turn", "--multi-turn-users", "0"], "--multi-turn-users"),
    (["--duration", "5"], "--duration"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--endpoint", "/v1/chat/completions", "--backend", "openai"], "--endpoint"),
    (["--bogus-flag"], "--bogus-flag"),
    (["--base-url", "127.0.0.1:8000"], "--base-url"),     # else every request fails and the run exits 0
    (["--metric-percentiles", "p99"], "--metric-percentiles"),
    # refused before the run starts, not a traceback once it has, nor a length silently made 1
    (["--burstiness", "0"], "--burstiness"),
    (["--random-input-len", "-5"], "--random-input-len"),
    (["--random-output-len", "0"], "--random-output-len"),
    (["--random-prefix-len", "-1"], "--random-prefix-len"),
    (["--gsp-question-len", "0"], "--gsp-question-len"),
    (["--sharegpt-output-len", "0"], "--sharegpt-output-len"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--multi-turn-think-time", "-1"], "--multi-turn-think-time"),
])
def test_bad_flags_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", "m", *argv])
    assert exc.value.code == 2
    # the error line itself: the usage above it names every flag
    assert flag in capsys.readouterr().err.strip().splitlines()[-1]


def test_missing_dataset_file_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--model", "m", "--dataset-name", "sharegpt"])
    assert "--dataset-path" in capsys.readouterr().err


def test_prompts_are_sized_with_the_servers_tokenize(mock_servers, tmp_path, capsys):
    url = mock_servers.get("--ttft-ms", "5", "--itl-ms", "1")
    rc = kvmesh_main(["bench", "serve", "--base-url", url, "--num-prompts", "4", "--random-input-len", "64",
                      "--random-output-len", "3", "--save-result", "--result-dir", str(tmp_path),
                      "--result-filename", "r.json", "--disable-tqdm"])
    assert rc == 0
    assert f"Tokenizer: the server's /tokenize ({url}/tokenize)" in capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["server_prompt_tokens"] == [64] * 4 and result["input_lens"] == [64] * 4
    assert result["tokenizer_id"] == f"the server's /tokenize ({url}/tokenize)"


def test_no_tokenizer_at_all_is_a_clear_error_naming_the_flag(mock_servers):
    url = mock_servers.get("--no-tokenize")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--base-url", url, "--num-prompts", "2", "--disable-tqdm", "--no-plots"])
    message = str(exc.value)
    assert "--tokenizer" in message and f"{url}/tokenize" in message and "HTTP 404" in message


def test_multi_turn_reports_ttft_per_turn_with_a_plot(mock_servers, tmp_path, capsys):
    url = mock_servers.get("--ttft-ms", "10", "--itl-ms", "1", "--prefill-ms-per-token", "0.2")
    rc = kvmesh_main(["bench", "serve", "--base-url", url, "--dataset-name", "multi-turn", "--multi-turn-users", "3",
                      "--multi-turn-turns", "4", "--multi-turn-history-tokens", "200", "--multi-turn-output-len", "5",
                      "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "mt.json"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT by turn (ms)" in printed
    result = json.loads((tmp_path / "mt.json").read_text())
    assert result["completed"] == 12 and result["multi_turn_users"] == 3 and result["multi_turn_turns"] == 4
    assert sorted(result["turns"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [row["turn"] for row in result["ttft_by_turn"]] == [1, 2, 3, 4]
    assert all(row["completed"] == 3 for row in result["ttft_by_turn"])
    assert result["input_lens"][result["turns"].index(3)] >= 200 - 15     # the last turn: ~200 tokens of history
    png = tmp_path / "mt-ttft-by-turn.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000


def test_multi_turn_history_too_short_names_the_flag(mock_servers, capsys):
    url = mock_servers.get("--ttft-ms", "10", "--itl-ms", "1", "--prefill-ms-per-token", "0.2")
    with pytest.raises(SystemExit) as exc:
        kvmesh_main(["bench", "serve", "--base-url", url, "--dataset-name", "multi-turn", "--multi-turn-turns", "10",
                     "--multi-turn-history-tokens", "50", "--disable-tqdm"])
    assert exc.value.code == 2 and "--multi-turn-history-tokens 50" in capsys.readouterr().err


def test_a_prompt_longer_than_the_servers_context_names_the_length_flag(mock_servers, capsys):
    """The server refusing to count a prompt the flags asked for is a usage error (exit 2) naming
    the flag that set its length, not a bare 'shorten the prompt' the user never wrote."""
    url = mock_servers.get("--max-model-len", "50")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--base-url", url, "--num-prompts", "2", "--random-input-len", "80",
              "--disable-tqdm", "--no-plots"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--random-input-len" in err and "maximum context length is 50" in err
