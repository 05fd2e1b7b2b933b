"""`kvmesh bench serve` against a real `kvmesh serve` (tiny llama, CPU) with no --tokenizer: the
prompts are sized with the server's /tokenize, and the server counts exactly the requested length."""
import json

import httpx

from services.bench.metrics import in_flight_steps
from services.cli import main as kvmesh_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(url: str, out_dir, *extra: str) -> dict:
    rc = kvmesh_main(["bench", "serve", "--base-url", url, "--random-input-len", "64", "--random-output-len", "6",
                      "--num-prompts", "6", "--max-concurrency", "3", "--ignore-eos", "--disable-tqdm",
                      "--save-result", "--result-dir", str(out_dir), "--result-filename", "run.json", *extra])
    assert rc == 0
    return json.loads((out_dir / "run.json").read_text())


def test_completions_prompts_are_exactly_the_requested_length(kvmesh_server, tmp_path, capsys):
    result = bench(kvmesh_server, tmp_path)
    printed = capsys.readouterr()
    assert f"Tokenizer: the server's /tokenize ({kvmesh_server}/tokenize)" in printed.out
    assert "Note:" not in printed.err  # the server counted what the benchmark built
    assert result["completed"] == 6, result["errors"]
    # usage.prompt_tokens: the bos the tokenizer adds is one of the 64
    assert result["server_prompt_tokens"] == [64] * 6 and result["input_lens"] == [64] * 6
    assert result["total_input_tokens"] == 6 * 64
    # the in-flight series the plot draws: back to 0 at the last finish, and nothing after it
    flight = in_flight_steps(sorted([(s, 1) for s in result["start_times"]] + [(e, -1) for e in result["end_times"]]))
    assert flight.level[-1] == 0 and flight.times[-1] == max(result["end_times"])
    assert 1 <= flight.level.max() == result["max_concurrent_requests"] <= 3  # --max-concurrency 3
    for name in ("run-latency-cdf.png", "run-throughput.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_chat_messages_are_the_requested_length_plus_the_template(kvmesh_server, tmp_path):
    result = bench(kvmesh_server, tmp_path, "--backend", "openai-chat")
    assert result["completed"] == 6, result["errors"]
    # the template's fixed tokens: a one-message chat minus the message alone, as the server counts them
    with httpx.Client(base_url=kvmesh_server, trust_env=False, timeout=30) as http:
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hello"}]}).json()["count"]
        alone = http.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False}).json()["count"]
    assert chat - alone > 0
    assert result["input_lens"] == [64] * 6
    assert result["server_prompt_tokens"] == [64 + chat - alone] * 6


def test_multi_turn_against_kvmesh_reports_reused_history_per_turn(kvmesh_server, tmp_path, capsys):
    rc = kvmesh_main(["bench", "serve", "--base-url", kvmesh_server, "--dataset-name", "multi-turn",
                      "--multi-turn-users", "2", "--multi-turn-turns", "3", "--multi-turn-history-tokens", "150",
                      "--multi-turn-output-len", "4", "--ignore-eos", "--disable-tqdm", "--save-result",
                      "--result-dir", str(tmp_path), "--result-filename", "mt.json"])
    assert rc == 0
    assert "TTFT by turn (ms)" in capsys.readouterr().out
    result = json.loads((tmp_path / "mt.json").read_text())
    assert result["completed"] == 6, result["errors"]
    rows = result["ttft_by_turn"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and all(r["completed"] == 2 for r in rows)
    # the server's prefix cache holds each conversation's earlier turns: the later turns reuse them
    assert rows[0]["cached_token_ratio"] < 0.5 < rows[2]["cached_token_ratio"]
    assert (tmp_path / "mt-ttft-by-turn.png").read_bytes()[:8] == PNG_MAGIC
