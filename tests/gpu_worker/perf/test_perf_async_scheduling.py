"""async_scheduling (one step ahead) gives the same tokens as the plain step loop: randomized
arrivals, priorities, n > 1, aborts, chunking, preemption, EOS, seeded sampling and penalties,
on the engine tests' fake runner (its KV store catches any wrong input token or slot)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_fakes import assert_clean, collect, make_engine, reference_greedy  # noqa: E402

from services.protocol.sampling import SamplingParams  # noqa: E402


def workload(async_scheduling: bool, seed: int, penalties: bool):
    rng = random.Random(seed)
    eng = make_engine(block_size=4, num_gpu_blocks=14, max_num_batched_tokens=20, max_num_seqs=6,
                      async_scheduling=async_scheduling)
    shared = [rng.randrange(2, 50) for _ in range(9)]
    specs, aborted, out = {}, set(), {}
    for _ in range(600):
        if len(specs) < 30 and rng.random() < 0.5:
            rid = f"r{len(specs)}"
            ids = (shared if rng.random() < 0.5 else []) + [rng.randrange(2, 50) for _ in range(rng.randrange(1, 20))]
            kind = rng.random()
            extra = {}
            if kind < 0.4:
                extra = dict(temperature=0.0, ignore_eos=True)
            elif kind < 0.7:
                extra = dict(temperature=1.0, seed=rng.randrange(100), ignore_eos=rng.random() < 0.5)
            else:
                extra = dict(temperature=0.0, ignore_eos=False, min_tokens=rng.randrange(0, 3))
            if penalties and rng.random() < 0.3:
                extra["presence_penalty"] = 0.5
            params = SamplingParams(max_tokens=rng.randrange(1, 24), n=rng.choice([1, 1, 2, 3]), **extra)
            eng.add_request(rid, ids, params, priority=rng.choice([0, 0, 1]))
            specs[rid] = (ids, params)
        if specs and rng.random() < 0.04:
            rid = rng.choice(sorted(specs))
            eng.abort_request(rid)
            aborted.add(rid)
        collect(eng.step(), out)
        eng.block_manager.check_integrity()
        if len(specs) == 30 and not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests()
    assert_clean(eng)
    return specs, aborted, out, eng.stats().num_preemptions


@pytest.mark.parametrize("seed,penalties", [(0, False), (1, False), (2, True)])
def test_async_matches_sync(seed, penalties):
    specs, aborted_a, out_a, preempt_a = workload(True, seed, penalties)
    _, aborted_s, out_s, _ = workload(False, seed, penalties)
    assert preempt_a > 0
    compared = 0
    for rid, (ids, params) in specs.items():
        if rid in aborted_a or rid in aborted_s:        # aborts land one step later in async
            continue
        for i in range(params.n):
            a, s = out_a[(rid, i)], out_s[(rid, i)]
            assert a["tokens"] == s["tokens"] and a["finish"] == s["finish"], (rid, i)
            if params.temperature == 0.0 and params.ignore_eos and not params.presence_penalty:
                assert a["tokens"] == reference_greedy(ids, params.max_tokens)
            compared += 1
    assert compared > 20


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_step_for_the_token_that_ends_a_request(async_scheduling):
    """A request that ends by length runs one forward per token it samples, also one step ahead:
    the placeholder of its last token is never scheduled (a wasted decode that a lone request's
    next prompt would queue behind on the GPU). Its tokens and finish are unchanged."""
    eng = make_engine(block_size=4, num_gpu_blocks=32, async_scheduling=async_scheduling)
    out = {}
    for rid, max_tokens in (("a", 3), ("b", 1), ("c", 5)):
        before = eng.runner.forward_calls
        eng.add_request(rid, [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
        while eng.has_unfinished_requests():
            collect(eng.step(), out)
        assert eng.runner.forward_calls - before == max_tokens, rid
        assert out[(rid, 0)]["tokens"] == reference_greedy([5, 6, 7, 8, 9], max_tokens)
        assert out[(rid, 0)]["finish"] == "length"
    assert_clean(eng)
