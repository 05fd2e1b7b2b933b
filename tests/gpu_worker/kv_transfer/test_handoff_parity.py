"""Tokens through a prefill engine and a decode engine joined by the KV hand-off are those of one
engine serving the request alone, and (greedy) those of Hugging Face transformers, for every
architecture and scheduling path; both block pools are whole and empty after every test."""
from __future__ import annotations

import pytest

from services.protocol.sampling import SamplingParams
from tests.gpu_worker.kv_transfer.conftest import PD, engine, greedy, prompt, run_single

STEPS = 12


def test_short_and_long_prompts_match_transformers(arch_model):
    model_dir, hf = arch_model
    requests = [("short", prompt(5, 1), greedy(STEPS)), ("one_block", prompt(16, 2), greedy(STEPS)),
                ("long", prompt(150, 3), greedy(STEPS))]
    pd = PD(engine(model_dir), engine(model_dir))
    out = pd.run(requests)
    single = run_single(engine(model_dir), requests)
    for rid, ids, _ in requests:
        assert out[(rid, 0)] == single[(rid, 0)] == hf.greedy(ids, STEPS)[0], rid
    assert pd.producer.blocks_sent == 1 + 1 + 10        # ceil(5/16) + 1 + ceil(150/16): D had nothing


def test_chunked_prefill_on_p(arch_model):
    model_dir, hf = arch_model
    ids = prompt(150, 5)
    p = engine(model_dir, max_num_batched_tokens=16)
    steps = []
    step = p.step
    p.step = lambda: (steps.append(1), step())[1]
    out = PD(p, engine(model_dir)).run([("long", ids, greedy(STEPS))])
    assert len(steps) == 10                               # 150 tokens in 10 chunks, all on P
    assert out[("long", 0)] == hf.greedy(ids, STEPS)[0]


def test_prefix_hit_on_p(arch_model):
    model_dir, hf = arch_model
    shared = prompt(48, 6)
    first, second = shared + prompt(5, 7), shared + prompt(7, 8)
    pd = PD(engine(model_dir), engine(model_dir, enable_prefix_caching=False))
    out = pd.run([("first", first, greedy(STEPS))], arrivals={3: [("second", second, greedy(STEPS))]})
    assert pd.p.block_manager.prefix_hit_tokens == 48     # P computed only second's tail
    assert out[("first", 0)] == hf.greedy(first, STEPS)[0]
    assert out[("second", 0)] == hf.greedy(second, STEPS)[0]


def test_prefix_hit_on_d_moves_only_the_missing_blocks(arch_model):
    model_dir, hf = arch_model
    shared = prompt(48, 9)                                # 3 full blocks of 16
    first, second = shared + prompt(5, 10), shared + prompt(7, 11)
    pd = PD(engine(model_dir, enable_prefix_caching=False), engine(model_dir))
    out = pd.run([("first", first, greedy(STEPS))])
    assert pd.producer.blocks_sent == 4
    out.update(pd.run([("second", second, greedy(STEPS))]))
    assert pd.producer.blocks_sent == 4 + 1               # D held the 3 shared blocks: 1 moved
    assert pd.consumer.blocks_received == 5
    assert pd.d.block_manager.prefix_hit_tokens == 48
    assert out[("first", 0)] == hf.greedy(first, STEPS)[0]
    assert out[("second", 0)] == hf.greedy(second, STEPS)[0]


def test_n_samples(arch_model):
    model_dir, hf = arch_model
    ids = prompt(21, 12)
    requests = [("n3", ids, greedy(STEPS, n=3))]
    out = PD(engine(model_dir), engine(model_dir)).run(requests)
    want = hf.greedy(ids, STEPS)[0]
    assert [out[("n3", i)] for i in range(3)] == [want] * 3


def test_seeded_sampling_matches_one_engine(arch_model):
    model_dir, _ = arch_model
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=STEPS, ignore_eos=True, n=2)
    unseeded = SamplingParams(temperature=1.0, max_tokens=STEPS, ignore_eos=True)
    requests = [("seeded", prompt(30, 13), params), ("engine_seed", prompt(9, 14), unseeded)]
    out = PD(engine(model_dir), engine(model_dir, seed=99)).run(requests)
    single = run_single(engine(model_dir), requests)
    assert out == single
    assert out[("seeded", 0)] != out[("seeded", 1)]       # the samples really were drawn


def test_preemption_on_d(arch_model):
    model_dir, hf = arch_model
    requests = [(f"r{i}", prompt(40, 20 + i), greedy(24)) for i in range(4)]
    d = engine(model_dir, num_gpu_blocks=12)              # 4 x 4 blocks by the end: D must preempt
    out = PD(engine(model_dir), d).run(requests)
    assert d.scheduler.num_preemptions > 0
    for rid, ids, _ in requests:
        assert out[(rid, 0)] == hf.greedy(ids, 24)[0], rid


@pytest.mark.parametrize("async_p,async_d", [(True, False), (False, True)])
def test_async_scheduling_on_either_side(arch_model, async_p, async_d):
    model_dir, hf = arch_model
    requests = [("a", prompt(33, 30), greedy(STEPS)), ("b", prompt(7, 31), greedy(STEPS, n=2))]
    out = PD(engine(model_dir, async_scheduling=async_p), engine(model_dir, async_scheduling=async_d)).run(requests)
    assert out[("a", 0)] == hf.greedy(requests[0][1], STEPS)[0]
    assert out[("b", 0)] == out[("b", 1)] == hf.greedy(requests[1][1], STEPS)[0]


def test_async_p_never_preempts_a_prefill_whose_first_token_is_being_read(arch_model):
    """Async scheduling: a higher-priority prompt that needs blocks arrives while an exported
    request's first token is still on its way back; that request leaves with its blocks held for
    the hand-off at the next read-back, so it is not the victim (its KV is what D needs)."""
    model_dir, hf = arch_model
    low, high = prompt(60, 40), prompt(40, 41)            # 4 + 3 blocks > P's 6
    p = engine(model_dir, num_gpu_blocks=6, async_scheduling=True)
    pd = PD(p, engine(model_dir))
    out = pd.run([], arrivals={0: [("low", low, greedy(STEPS), 1)], 1: [("high", high, greedy(STEPS), 0)]})
    for rid, ids in (("low", low), ("high", high)):
        assert out[(rid, 0)] == hf.greedy(ids, STEPS)[0], rid


def test_fp8_kv_cache_hands_off_as_one_engine_serves_it(llama):
    """kv_cache_dtype fp8 on both sides: D writes the frames' bytes into its fp8 blocks (the CPU
    has no index_copy_ for float8, which killed the decode worker's engine thread)."""
    requests = [("short", prompt(5, 21), greedy(STEPS)), ("long", prompt(40, 22), greedy(STEPS))]
    out = PD(engine(llama, kv_cache_dtype="fp8"), engine(llama, kv_cache_dtype="fp8")).run(requests)
    single = run_single(engine(llama, kv_cache_dtype="fp8"), requests)
    for rid, _, _ in requests:
        assert out[(rid, 0)] == single[(rid, 0)], rid
