"""Speculative steps on the fake runner: the same tokens as without speculation through batching,
chunked prefill, prefix hits, preemption, n > 1, stops and aborts; exact block accounting after
every test; drafts really accepted (the fake model cycles), so no test passes vacuously."""
from __future__ import annotations

import pytest

from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.engine.engine_fakes import assert_clean, collect
from tests.gpu_worker.spec_decode.spec_fakes import MAX_STEPS, fake_engine, ngram


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def drive(eng: Engine, arrivals: dict[int, list] | None = None, abort_at: dict[int, list] | None = None) -> dict:
    """Step until idle (bounded); arrivals {step: [(rid, prompt, params)]}, abort_at {step: [rid]}."""
    out: dict = {}
    arrivals, abort_at = dict(arrivals or {}), dict(abort_at or {})
    for step in range(MAX_STEPS):
        for rid, ids, params in arrivals.pop(step, []):
            eng.add_request(rid, ids, params)
        for rid in abort_at.pop(step, []):
            eng.abort_request(rid)
        if not (eng.has_unfinished_requests() or arrivals):
            break
        collect(eng.step(), out)
        eng.block_manager.check_integrity()
        for seq in eng.scheduler.running:        # rejected drafts' slots were given back
            assert len(seq.block_table) == eng.block_manager.blocks_for(seq.num_computed_tokens)
    assert not eng.has_unfinished_requests()
    assert_clean(eng)
    return {k: v["tokens"] for k, v in out.items()}


def both(arrivals, abort_at=None, **kw) -> tuple[dict, dict, Engine]:
    """The tokens without and with speculation, and the speculating engine."""
    plain = drive(fake_engine(None, **kw), arrivals, abort_at)
    eng = fake_engine(ngram(), **kw)
    return plain, drive(eng, arrivals, abort_at), eng


def accepted(eng: Engine) -> int:
    return eng.stats().extra["spec_decode"]["accepted"]


def prompts(n: int) -> dict[str, list[int]]:
    return {f"r{i}": [(7 * i + 3 * j) % 47 + 2 for j in range(5 + 3 * i)] for i in range(n)}


def test_batch_staggered_with_chunked_prefill_gives_identical_tokens():
    ps = prompts(6)
    arrivals = {0: [(r, p, greedy()) for r, p in list(ps.items())[:3]],
                4: [(r, p, greedy(29)) for r, p in list(ps.items())[3:]]}
    plain, spec, eng = both(arrivals, max_num_batched_tokens=8, block_size=4, num_gpu_blocks=256)
    assert spec == plain and len(spec) == 6
    assert accepted(eng) > 10
    stats = eng.stats().extra["spec_decode"]
    assert stats["mean_accepted_length"] > 1.0 and 0 < stats["acceptance_rate"] <= 1.0


def test_prefix_hits_register_only_accepted_kv():
    shared = [5, 9, 11, 5, 9, 11, 5, 9, 11, 3, 4, 6]
    arrivals = {0: [("a", shared + [7], greedy())], 30: [("b", shared + [8], greedy())],
                60: [("c", shared + [7], greedy())]}
    plain, spec, eng = both(arrivals, block_size=4, num_gpu_blocks=64)
    assert spec == plain and accepted(eng) > 0
    assert eng.block_manager.prefix_hit_tokens >= 2 * 12


def test_preemption_under_a_small_pool_gives_identical_tokens():
    ps = prompts(5)
    arrivals = {0: [(r, p, greedy(60)) for r, p in ps.items()]}
    plain, spec, eng = both(arrivals, block_size=4, num_gpu_blocks=40)
    assert spec == plain
    assert eng.stats().num_preemptions > 0 and accepted(eng) > 0


def test_n_samples_share_the_prompt_and_speculate_apart():
    arrivals = {0: [("n", [2, 3, 4, 2, 3], SamplingParams(temperature=0.8, seed=5, n=4, max_tokens=30,
                                                            ignore_eos=True))]}
    plain, spec, eng = both(arrivals, block_size=4, num_gpu_blocks=64)
    assert spec == plain and len(spec) == 4 and accepted(eng) > 0


def test_abort_between_verifications_leaks_nothing():
    ps = prompts(4)
    arrivals = {0: [(r, p, greedy(80)) for r, p in ps.items()]}
    eng = fake_engine(ngram(), block_size=4, num_gpu_blocks=128)
    out = drive(eng, arrivals, abort_at={12: ["r0", "r2"], 13: ["r1"]})
    assert accepted(eng) > 0 and len(out["r3", 0]) == 80


def test_stop_token_and_max_tokens_inside_accepted_drafts():
    ids = [4, 8, 4, 8, 4, 8]
    plain = drive(fake_engine(None), {0: [("a", ids, greedy(200))]})["a", 0]
    stop = plain[25]                               # a token the cycle emits: stop at its first
    arrivals = {0: [("s", ids, SamplingParams(temperature=0.0, max_tokens=200, stop_token_ids=[stop], ignore_eos=True)),
                    ("m", ids, greedy(23))]}
    p, s, eng = both(arrivals)
    assert s == p and len(s["m", 0]) == 23 and s["s", 0][-1] == stop and stop not in s["s", 0][:-1]
    assert accepted(eng) > 0


def test_penalties_min_tokens_logit_bias_and_logprobs_as_without_speculation():
    params = SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.05, frequency_penalty=0.1,
                            min_tokens=10, logit_bias={3: 1.5}, logprobs=2, ignore_eos=True)
    outs = []
    for spec in (None, ngram()):
        eng = fake_engine(spec)
        got: dict = {}
        eng.add_request("p", [3, 6, 3, 6, 3], params)
        for _ in range(MAX_STEPS):
            if not eng.has_unfinished_requests():
                break
            collect(eng.step(), got)
        assert_clean(eng)
        rec = got["p", 0]
        outs.append((rec["tokens"], [(lp.token_id, round(lp.logprob, 5), lp.top) for lp in rec["logprobs"]]))
    assert outs[0] == outs[1] and len(outs[0][1]) == 40
    assert accepted(eng) > 0


def test_disable_by_batch_size_switches_drafts_off():
    ps = prompts(3)
    arrivals = {0: [(r, p, greedy()) for r, p in ps.items()]}
    eng = fake_engine(ngram(disable_by_batch_size=2))
    drive(eng, arrivals)
    stats = eng.stats().extra["spec_decode"]
    assert stats["proposed"] == 0                    # 3 running > 2: never a draft
    eng = fake_engine(ngram(disable_by_batch_size=3))
    drive(eng, arrivals)
    assert eng.stats().extra["spec_decode"]["proposed"] > 0


@pytest.mark.parametrize("seed", range(20))
def test_seeded_sampling_gives_the_same_tokens(seed):
    """The verifier draws each position with the key a plain step would use: seed for seed the
    same tokens (the fake runner's logits are exact), with top-k, top-p, min-p and penalties."""
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.9, min_p=0.02, presence_penalty=0.2,
                            seed=seed, max_tokens=30, ignore_eos=True)
    plain, spec, eng = both({0: [("s", [9, 2, 9, 2, 9], params)]})
    assert spec == plain


def test_a_request_that_opts_out_never_verifies_drafts():
    ids = [4, 8, 4, 8, 4, 8]
    eng = fake_engine(ngram())
    out = drive(eng, {0: [("out", ids, greedy(speculative=False))]})
    assert eng.stats().extra["spec_decode"]["proposed"] == 0
    assert all(b.max_query_len == 1 for b in eng.runner.batches[1:])      # one token a step
    both_ways = drive(fake_engine(ngram()), {0: [("in", ids, greedy())]})
    assert both_ways["in", 0] == out["out", 0]


def test_aborting_one_sample_between_verifications_frees_only_its_blocks():
    params = SamplingParams(temperature=0.7, seed=3, n=3, max_tokens=60, ignore_eos=True)
    eng = fake_engine(ngram(), block_size=4, num_gpu_blocks=128)
    eng.add_request("n", [2, 3, 4, 2, 3, 4], params)
    out: dict = {}
    for step in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            break
        if step == 10:
            eng.abort_request("n", 1)
            eng.block_manager.check_integrity()
        collect(eng.step(), out)
        eng.block_manager.check_integrity()
    assert_clean(eng)
    plain = fake_engine(None, block_size=4, num_gpu_blocks=128)
    plain.add_request("n", [2, 3, 4, 2, 3, 4], params)
    want: dict = {}
    for _ in range(MAX_STEPS):
        if not plain.has_unfinished_requests():
            break
        collect(plain.step(), want)
    assert [out["n", i]["tokens"] for i in (0, 2)] == [want["n", i]["tokens"] for i in (0, 2)]
    assert len(out["n", 1]["tokens"]) < 60 and accepted(eng) > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_allowed_token_ids_and_bad_words_as_without_speculation(async_scheduling):
    """The masks hold at every verified position (a draft's own tokens count as output for bad
    words): greedy tokens are those of one plain engine, and random draws keep to the masks."""
    reqs = {"allowed": dict(allowed_token_ids=[3, 6, 9]), "bad": dict(bad_words_token_ids=[[3, 6], [9]])}
    outs = []
    for spec in (None, ngram()):
        eng = fake_engine(spec, async_scheduling=async_scheduling)
        got: dict = {}
        for rid, mask in reqs.items():
            eng.add_request(rid, [3, 6, 3, 6, 3], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, **mask))
            eng.add_request(rid + "-drawn", [3, 6, 3, 6, 3],
                            SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True, **mask))
        for _ in range(MAX_STEPS):
            if not eng.has_unfinished_requests():
                break
            collect(eng.step(), got)
        assert_clean(eng)
        for rid in ("allowed", "allowed-drawn"):
            assert set(got[rid, 0]["tokens"]) <= {3, 6, 9}
        for rid in ("bad", "bad-drawn"):
            toks = got[rid, 0]["tokens"]
            assert 9 not in toks and all((a, b) != (3, 6) for a, b in zip(toks, toks[1:]))
        outs.append((got["allowed", 0]["tokens"], got["bad", 0]["tokens"]))
    assert outs[0] == outs[1]
    assert accepted(eng) > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("spec", [None, "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draw_with_no_token_left_fails_its_request_only(async_scheduling, spec, temperature):
    """allowed_token_ids [3, 6] with every two-token bad word of them: the second draw has no
    token. That request fails with an error naming its masks (nothing past the first token is
    emitted, no token 0); the request batched with it gives its own tokens; nothing leaks."""
    ids = [3, 6, 3, 6, 3]
    stuck = SamplingParams(temperature=temperature, seed=2, max_tokens=30, ignore_eos=True, n=2, logprobs=1,
                           allowed_token_ids=[3, 6], bad_words_token_ids=[[3, 3], [3, 6], [6, 3], [6, 6]])
    alone = drive(fake_engine(None), {0: [("ok", ids, greedy(30))]})
    eng = fake_engine(ngram() if spec else None, async_scheduling=async_scheduling)
    got: dict = {}
    eng.add_request("ok", ids, greedy(30))
    eng.add_request("stuck", ids, stuck)
    failed = []
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            break
        collect(eng.step(), got)
        failed += eng.take_failed()
    assert_clean(eng)
    assert [(rid, busy) for rid, _, busy in failed] == [("stuck", False)]
    assert "no token can be generated at output position 1: allowed_token_ids and bad_words" in failed[0][1]
    for index in (0, 1):
        rec = got.get(("stuck", index), {"tokens": [], "finish": None})
        assert len(rec["tokens"]) <= 1 and set(rec["tokens"]) <= {3, 6} and rec["finish"] is None
    assert got["ok", 0]["tokens"] == alone["ok", 0]


@pytest.mark.parametrize("fields", [dict(allowed_token_ids=[3], bad_words_token_ids=[[3], [4, 3]]),
                                    dict(allowed_token_ids=[3], min_tokens=1, stop_token_ids=[3])])
def test_allowed_token_ids_that_the_first_draw_bans_whole_are_refused(fields):
    from gpu_worker.outputs import RequestError
    eng = fake_engine(None)
    with pytest.raises(RequestError, match=r"invalid allowed_token_ids: .* ban every one of them"):
        eng.add_request("r", [3, 6], SamplingParams(max_tokens=4, **fields))
    assert_clean(eng)
