"""Bad input raises RequestError naming the field; the engine keeps serving (a good request
completes after each); config errors name the argument."""
import pytest

from engine_fakes import assert_clean, make_engine, reference_greedy, run_all
from gpu_worker.config import EngineConfig
from gpu_worker.outputs import RequestError
from services.protocol.sampling import SamplingParams

GOOD = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return make_engine(max_len=64, block_size=4, max_n=4)


@pytest.mark.parametrize("prompt,params,field", [
    ([], GOOD, "prompt_token_ids"),
    ([5] * 64, GOOD, "prompt_token_ids"),             # no room for one generated token
    ([5, 999], GOOD, "prompt_token_ids"),              # outside the vocabulary
    ([5, -1], GOOD, "prompt_token_ids"),
    ([5, True], GOOD, "prompt_token_ids"),             # a bool is not a token id
    ([5, 6.0], GOOD, "prompt_token_ids"),
    ([5, "6"], GOOD, "prompt_token_ids"),
    ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
    ([5, 6], SamplingParams(max_tokens=-3), "max_tokens"),
    ([5, 6], SamplingParams(top_p=0.0), "top_p"),
    ([5, 6], SamplingParams(top_p=1.5), "top_p"),
    ([5, 6], SamplingParams(n=5), "n"),                # above the engine's max_n=4
    ([5, 6], SamplingParams(n=17), "n"),
    ([5, 6], SamplingParams(stop_token_ids=[10_000]), "stop_token_ids"),
])
def test_bad_request_then_good_one(engine, prompt, params, field):
    with pytest.raises(RequestError, match=field):
        engine.add_request("bad", prompt, params)
    engine.add_request("good", [5, 6, 7], GOOD)
    out = run_all(engine)
    assert out[("good", 0)]["tokens"] == reference_greedy([5, 6, 7], 3)
    assert_clean(engine)


def test_token_ids_of_any_integer_type(engine):
    """Plain ints take the fast check (min/max in C); numpy ints, tuples and int subclasses the
    per-id one; the engine stores plain ints either way and generates the same tokens."""
    import numpy as np

    class Id(int):
        pass
    for i, prompt in enumerate(([5, 6, 7], (5, 6, 7), list(np.array([5, 6, 7])), [Id(5), Id(6), Id(7)])):
        engine.add_request(f"r{i}", prompt, GOOD)
        assert all(type(t) is int for t in engine.requests[f"r{i}"].prompt_token_ids)
    out = run_all(engine)
    assert all(out[(f"r{i}", 0)]["tokens"] == reference_greedy([5, 6, 7], 3) for i in range(4))
    assert_clean(engine)


def test_duplicate_request_id(engine):
    engine.add_request("dup", [5, 6], GOOD)
    with pytest.raises(RequestError, match="request_id"):
        engine.add_request("dup", [7, 8], GOOD)
    out = run_all(engine)
    assert out[("dup", 0)]["tokens"] == reference_greedy([5, 6], 3)
    engine.add_request("dup", [5, 6], GOOD)     # free again once finished
    run_all(engine)
    assert_clean(engine)


def test_unknown_engine_argument_is_named():
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        EngineConfig.from_kwargs(model="m", max_num_seq=3)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model="m", block_size=0)


def test_explicit_max_model_len_must_fit_the_cache():
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(max_len=512, block_size=4, num_gpu_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(max_len=64, max_model_len=100)
    assert make_engine(max_len=512, block_size=4, num_gpu_blocks=4).max_model_len == 16
