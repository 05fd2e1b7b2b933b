"""Scheduler + engine loop on a fake runner (logits are a function of the KV-cached context)."""
import pytest

from engine_fakes import assert_clean, collect, make_engine, reference_greedy, run_all
from services.protocol.sampling import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, **GREEDY, **kw)


def prompt(n, start=2):
    return [(start + 7 * i) % 40 + 2 for i in range(n)]


def test_single_request_matches_reference():
    eng = make_engine(block_size=4)
    eng.add_request("a", prompt(9), greedy(12))
    out = run_all(eng)
    assert out[("a", 0)]["tokens"] == reference_greedy(prompt(9), 12)
    assert out[("a", 0)]["finish"] == "length"
    assert_clean(eng)


def test_chunked_prefill_respects_token_budget_and_mixes_decodes():
    eng = make_engine(block_size=4, max_num_batched_tokens=8)
    eng.add_request("short", prompt(3), greedy(20))
    collect(eng.step(), {})
    eng.add_request("long", prompt(37, 5), greedy(5))   # needs 5 chunks next to the decode
    out = {}
    while eng.has_unfinished_requests():
        collect(eng.step(), out)
        assert eng.runner.batches[-1].num_tokens <= 8
    mixed = [b for b in eng.runner.batches if b.num_seqs == 2 and b.max_query_len > 1]
    assert mixed, "prefill chunks should share steps with the running decode"
    assert out[("long", 0)]["tokens"] == reference_greedy(prompt(37, 5), 5)
    assert_clean(eng)


def test_without_chunking_a_prompt_is_computed_whole():
    eng = make_engine(block_size=4, max_num_batched_tokens=64, enable_chunked_prefill=False)
    assert eng.max_model_len == 64
    eng.add_request("a", prompt(40), greedy(3))
    eng.add_request("b", prompt(30, 3), greedy(3))
    out = run_all(eng)
    assert eng.runner.batches[0].max_query_len == 40 and eng.runner.batches[0].num_seqs == 1
    assert out[("b", 0)]["tokens"] == reference_greedy(prompt(30, 3), 3)
    assert_clean(eng)


def test_max_num_seqs_caps_the_batch():
    eng = make_engine(block_size=4, max_num_seqs=2)
    for i in range(5):
        eng.add_request(f"r{i}", prompt(5, i), greedy(4))
    out = {}
    while eng.has_unfinished_requests():
        collect(eng.step(), out)
        assert eng.runner.batches[-1].num_seqs <= 2
    for i in range(5):
        assert out[(f"r{i}", 0)]["tokens"] == reference_greedy(prompt(5, i), 4)
    assert_clean(eng)


def test_prefix_hit_reports_cached_tokens_and_same_output():
    eng = make_engine(block_size=4)
    eng.add_request("a", prompt(18), greedy(4))
    first = run_all(eng)
    eng.add_request("b", prompt(18), greedy(4))
    second = run_all(eng)
    assert first[("a", 0)]["cached"] == 0
    assert second[("b", 0)]["cached"] == 16
    assert second[("b", 0)]["tokens"] == first[("a", 0)]["tokens"] == reference_greedy(prompt(18), 4)
    assert eng.stats().prefix_hit_tokens == 16
    assert_clean(eng)


def test_prefix_caching_disabled():
    eng = make_engine(block_size=4, enable_prefix_caching=False)
    for rid in ("a", "b"):
        eng.add_request(rid, prompt(18), greedy(2))
        out = run_all(eng)
        assert out[(rid, 0)]["cached"] == 0
    assert eng.block_manager.cached_block_hashes() == []
    assert_clean(eng)


def test_preemption_lowest_priority_latest_first_and_identical_results():
    # 12 blocks of 4 tokens; three requests that each grow to 4 blocks cannot all fit.
    eng = make_engine(block_size=4, num_gpu_blocks=10)
    eng.add_request("early", prompt(6, 1), greedy(10))
    eng.add_request("late", prompt(6, 2), greedy(10))
    eng.add_request("vip", prompt(6, 3), greedy(10), priority=-1)
    order = []
    out = {}
    while eng.has_unfinished_requests():
        before = {s.request_id for s in eng.scheduler.running}
        collect(eng.step(), out)
        preempted = before - {s.request_id for s in eng.scheduler.running} - {
            k[0] for k, v in out.items() if v["finish"]}
        order += sorted(preempted)
        eng.block_manager.check_integrity()
    assert eng.stats().num_preemptions > 0
    assert order[0] == "late", order          # lowest priority (0), latest arrival first
    assert "vip" not in order
    for rid, start in (("early", 1), ("late", 2), ("vip", 3)):
        assert out[(rid, 0)]["tokens"] == reference_greedy(prompt(6, start), 10)
    assert_clean(eng)


def test_seeded_sampling_survives_preemption():
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    alone = make_engine(block_size=4)
    alone.add_request("s", prompt(6), params)
    ref = run_all(alone)[("s", 0)]["tokens"]
    tight = make_engine(block_size=4, num_gpu_blocks=8)
    tight.add_request("s", prompt(6), params)
    for i in range(3):
        tight.add_request(f"x{i}", prompt(6, 10 + i), greedy(12))
    out = run_all(tight)
    assert tight.stats().num_preemptions > 0
    assert out[("s", 0)]["tokens"] == ref
    assert_clean(tight)


def test_n_samples_share_prompt_blocks_copy_on_write():
    eng = make_engine(block_size=4)
    eng.add_request("g", prompt(6), greedy(5, n=3))
    out = run_all(eng)
    ref = reference_greedy(prompt(6), 5)
    assert [out[("g", i)]["tokens"] for i in range(3)] == [ref] * 3
    assert len(eng.runner.copies) == 2      # two of three samples copy the shared partial block
    assert eng.runner.batches[0].num_seqs == 1   # the prompt is computed once
    assert_clean(eng)


def test_n_seeded_samples_differ_and_reproduce():
    def run():
        eng = make_engine(block_size=4)
        eng.add_request("g", prompt(6), SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8,
                                                       ignore_eos=True))
        out = run_all(eng)
        assert_clean(eng)
        return [out[("g", i)]["tokens"] for i in range(3)]
    a, b = run(), run()
    assert a == b
    assert len({tuple(x) for x in a}) > 1


def test_eos_stop_token_and_min_tokens():
    eng = make_engine(block_size=4)
    ref = reference_greedy(prompt(5), 6)
    eng.add_request("stop_id", prompt(5), SamplingParams(temperature=0, stop_token_ids=[ref[2]], max_tokens=10))
    out = run_all(eng)
    assert out[("stop_id", 0)]["tokens"] == ref[:3] and out[("stop_id", 0)]["finish"] == "stop"
    eng.add_request("min", prompt(5), SamplingParams(temperature=0, stop_token_ids=[ref[2]], min_tokens=4,
                                                     max_tokens=4))
    out = run_all(eng)
    toks = out[("min", 0)]["tokens"]
    assert toks[:2] == ref[:2] and toks[2] != ref[2] and len(toks) == 4
    assert_clean(eng)


def test_max_model_len_caps_output():
    eng = make_engine(max_len=16, block_size=4)
    eng.add_request("a", prompt(10), SamplingParams(temperature=0, ignore_eos=True, max_tokens=None))
    out = run_all(eng)
    assert len(out[("a", 0)]["tokens"]) == 6 and out[("a", 0)]["finish"] == "length"
    assert_clean(eng)


@pytest.mark.parametrize("when", [0, 1, 3, 8])
def test_abort_frees_everything(when):
    eng = make_engine(block_size=4, max_num_batched_tokens=8)
    eng.add_request("a", prompt(20), greedy(10, n=2))
    eng.add_request("b", prompt(9, 4), greedy(6))
    out = {}
    for _ in range(when):
        collect(eng.step(), out)
    eng.abort_request("a")
    eng.abort_request("unknown")
    eng.block_manager.check_integrity()
    run_all(eng, out)
    assert out[("b", 0)]["tokens"] == reference_greedy(prompt(9, 4), 6)
    assert_clean(eng)


def test_abort_one_sample():
    eng = make_engine(block_size=4)
    eng.add_request("g", prompt(6), greedy(6, n=3))
    out = {}
    collect(eng.step(), out)
    eng.abort_request("g", index=1)
    run_all(eng, out)
    assert len(out[("g", 1)]["tokens"]) == 1
    assert len(out[("g", 2)]["tokens"]) == 6
    assert_clean(eng)


def test_high_priority_arrival_preempts_lower_priority_running():
    eng = make_engine(block_size=4, num_gpu_blocks=7)
    eng.add_request("low", prompt(14, 1), greedy(12), priority=5)     # grows to 7 blocks
    out = {}
    for _ in range(4):
        collect(eng.step(), out)
    eng.add_request("high", prompt(10, 2), greedy(4), priority=0)     # needs 3 blocks now
    collect(eng.step(), out)
    assert [s.request_id for s in eng.scheduler.running] == ["high"]
    assert eng.stats().num_preemptions == 1
    run_all(eng, out)
    assert out[("high", 0)]["tokens"] == reference_greedy(prompt(10, 2), 4)
    assert out[("low", 0)]["tokens"] == reference_greedy(prompt(14, 1), 12)
    assert_clean(eng)


def test_same_priority_arrival_waits_instead_of_preempting():
    eng = make_engine(block_size=4, num_gpu_blocks=7)
    eng.add_request("first", prompt(14, 1), greedy(12))
    for _ in range(4):
        eng.step()
    eng.add_request("second", prompt(10, 2), greedy(4))
    eng.step()
    assert [s.request_id for s in eng.scheduler.running] == ["first"]
    run_all(eng)
    assert eng.stats().num_preemptions == 0
    assert_clean(eng)
