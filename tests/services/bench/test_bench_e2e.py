"""The runner + client against scripted servers whose timing is known: TTFT 50 ms, 10 ms per token."""
import asyncio
import statistics

import pytest

from services.bench.datasets import DatasetOptions, SampleRequest, load_dataset
from services.bench.metrics import compute_metrics
from services.bench.runner import RunConfig, run_benchmark
from services.bench.tokens import TokenCounter, approx_token_count

TOL_MS = 8.0
# A busy 2-core machine only adds delay (seen: a 60 ms median TTFT for the script's 50, with 16
# requests 4 at a time, and 65 ms for the fastest of them under more load): measurements may sit
# this far above the script, never more than TOL_MS below it.
NOISE_MS = 3 * TOL_MS
TIMED = ("--ttft-ms", "50", "--itl-ms", "10")


def near(measured_ms: float, scripted_ms: float, tol: float = TOL_MS, noise: float = NOISE_MS) -> bool:
    return scripted_ms - tol < measured_ms < scripted_ms + noise


def run(url, items, chat=False, **kw):
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    cfg = RunConfig(api_url=url + endpoint, model="mock-model", chat=chat, headers={}, disable_tqdm=True,
                    num_requests=kw.pop("num_requests", len(items)), **kw)
    out = asyncio.run(run_benchmark(items, cfg, approx_token_count))
    return out, compute_metrics(out.results, out.duration, [50.0, 90.0, 99.0], kw.get("slos", {}))


def reqs(n, out_len=10, prompt_words=20):
    return [SampleRequest(" ".join(["hello"] * prompt_words), prompt_words, out_len) for _ in range(n)]


@pytest.mark.parametrize("chat", [False, True])
def test_ttft_tpot_itl_match_the_script(mock_servers, chat):
    url = mock_servers.get(*TIMED)
    out, m = run(url, reqs(16), chat=chat, max_concurrency=4)
    assert m.completed == 16 and m.failed == 0
    assert near(min(r.ttft for r in out.results) * 1000, 50)   # chat: the early role chunk is not a token
    assert near(m.latency["ttft"].median, 50)
    assert near(m.latency["tpot"].median, 10) and near(m.latency["itl"].median, 10)
    assert near(m.latency["e2el"].median, 50 + 9 * 10, 2 * TOL_MS, 2 * NOISE_MS)
    assert all(len(r.itl) == 9 for r in out.results)
    # Throughput is consistent with the totals, counted from usage.
    assert m.total_output == 160 and m.output_len_sources == {"usage": 16}
    assert m.output_throughput == pytest.approx(m.total_output / out.duration)
    assert m.request_throughput == pytest.approx(16 / out.duration)
    # 16 requests of ~140 ms, 4 at a time: about 4 waves.
    assert 0.5 < out.duration < 1.5
    assert m.max_concurrent_requests == 4


def test_goodput_counts_requests_meeting_all_slos(mock_servers):
    url = mock_servers.get(*TIMED)
    out, _ = run(url, reqs(8, out_len=10), max_concurrency=8)
    dur = out.duration  # same results, judged against different SLOs

    def goodput(slos):
        return compute_metrics(out.results, dur, [99.0], slos).request_goodput

    assert goodput({"ttft": 1000, "tpot": 100}) == pytest.approx(8 / dur)
    assert goodput({"ttft": 20}) == 0.0  # TTFT is ~50 ms
    assert goodput({"ttft": 1000, "e2el": 60}) == 0.0  # E2EL is ~140 ms


def test_multi_token_chunks_follow_vllm_convention(mock_servers):
    # 16 tokens in chunks of 4: chunks 40 ms apart -> ITL (per chunk) ~40 ms, TPOT = 120 ms / 15 = 8 ms.
    url = mock_servers.get(*TIMED, "--tokens-per-chunk", "4")
    out, m = run(url, reqs(6, out_len=16), max_concurrency=6)
    assert all(len(r.itl) == 3 for r in out.results)
    assert near(m.latency["itl"].median, 40)
    assert near(m.latency["tpot"].median, 8, TOL_MS / 2, NOISE_MS / 2)
    assert m.total_output == 96


def test_failures_counted_by_reason(mock_servers):
    url = mock_servers.get(*TIMED, "--fail", "500:4,429:5")
    out, m = run(url, reqs(20, out_len=3), max_concurrency=1)
    # Requests 4, 8, 12, 16, 20 -> 500; 5, 10, 15 -> 429 (20 already failed with 500).
    assert m.failure_reasons == {"HTTP 500": 5, "HTTP 429": 3}
    assert (m.completed, m.failed) == (12, 8)
    errors = [r.error for r in out.results]
    assert errors[3].startswith("HTTP 500: ") and "scripted failure" in errors[3] and errors[0] == ""


def test_connection_refused_is_a_reason():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, m = run(f"http://127.0.0.1:{port}", reqs(3), max_concurrency=3)
    assert m.failure_reasons == {"connection error": 3}


def test_multi_turn_history_grows_and_prefix_is_cached(mock_servers):
    url = mock_servers.get(*TIMED)
    convs = load_dataset(DatasetOptions(name="multi-turn", num_prompts=2, multi_turn_num_turns=3,
                                        multi_turn_user_len=40, multi_turn_output_len=5), TokenCounter(), seed=3)
    out, m = run(url, convs, chat=True, max_concurrency=2, think_time=0.02)
    assert len(out.results) == 6 and m.completed == 6
    for conv in (out.results[:3], out.results[3:]):
        prompts = [r.usage_prompt_tokens for r in conv]
        assert prompts[0] < prompts[1] < prompts[2]  # each turn resends the history plus a new message
        assert [r.prompt_len for r in conv] == [40, 85, 130]  # our own count: user 40 + reply 5 per turn
        assert conv[0].cached_tokens == 0 and conv[2].cached_tokens >= 64
    assert 0.0 < m.cached_token_ratio < 1.0


def test_multi_turn_ttft_by_turn_and_one_user_per_conversation(mock_servers):
    """Each conversation's turns name one `user`; with a prefix-caching server whose TTFT grows with
    uncached prompt tokens (1 ms each), TTFT per turn stays flat as the history grows, since only the
    last reply and the new message are new; the turn table says so, per turn index."""
    import httpx

    url = mock_servers.get("--ttft-ms", "20", "--itl-ms", "2", "--prefill-ms-per-token", "1")
    users, turns, user_len, out_len = 3, 5, 40, 4
    convs = load_dataset(DatasetOptions(name="multi-turn", multi_turn_users=users, multi_turn_num_turns=turns,
                                        multi_turn_user_len=user_len, multi_turn_output_len=out_len),
                         TokenCounter(), seed=1)
    before = httpx.get(url + "/mock/users", trust_env=False).json()["users"]
    out, m = run(url, convs, chat=True)
    assert m.completed == users * turns
    seen = {u: n for u, n in httpx.get(url + "/mock/users", trust_env=False).json()["users"].items()
            if u not in before}
    assert len(seen) == users and set(seen.values()) == {turns}         # one user per conversation, every turn
    rows = m.ttft_by_turn
    assert [r.turn for r in rows] == list(range(1, turns + 1)) and all(r.completed == users for r in rows)
    assert all(a.mean_prompt_tokens < b.mean_prompt_tokens for a, b in zip(rows, rows[1:]))
    assert rows[0].cached_token_ratio == 0.0 and rows[-1].cached_token_ratio > 0.6
    # uncached at a later turn: the new message, the last reply, 2 role tokens, < a block of the old
    # prompt; the bounds leave room for a loaded machine, and stay far below the ~250 ms a server
    # recomputing the whole history would take at the last turn
    assert rows[0].median_ttft_ms > 20 + user_len - TOL_MS
    assert rows[-1].mean_prompt_tokens > turns * user_len                # while the whole history was sent
    assert rows[-1].median_ttft_ms < 20 + (user_len + out_len + 2 + 16) + (rows[-1].mean_prompt_tokens - 20) / 2


def test_duration_mode_stops_sending(mock_servers):
    url = mock_servers.get(*TIMED)
    out, m = run(url, reqs(3, out_len=2), request_rate=40.0, duration=0.5, num_requests=0)
    assert 8 <= len(out.results) <= 35 and m.failed == 0
    assert max(r.start_time - out.t0 for r in out.results) < 0.55


def test_warmups_are_not_measured(mock_servers):
    url = mock_servers.get(*TIMED)
    seen = []
    cfg = RunConfig(api_url=url + "/v1/completions", model="mock-model", chat=False, headers={}, disable_tqdm=True,
                    num_requests=3, num_warmups=2, max_concurrency=2)
    out = asyncio.run(run_benchmark(reqs(3, out_len=2), cfg, approx_token_count, on_warmup=seen.extend))
    assert len(seen) == 2 and all(r.success for r in seen)
    assert len(out.results) == 3
    assert statistics.median(r.ttft for r in out.results) > 0.04
