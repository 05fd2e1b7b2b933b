"""add_request(resume_output=...): a request that ran elsewhere up to some tokens goes on here as if
it had never moved: greedy tokens identical to transformers, seeded draws, penalties, min_tokens and
the max_tokens budget all continuing at the right output positions, for each of n samples."""
from __future__ import annotations

import pytest
import torch

from engine_fakes import assert_clean, make_engine, run_all
from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.outputs import RequestError
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.engine.conftest import HFReference

PROMPT = [5, 9, 2, 7, 3, 11, 4]


def seeded(n: int = 3, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=1234, n=n, max_tokens=20, ignore_eos=True,
                          frequency_penalty=0.5, repetition_penalty=1.2, min_tokens=12, **kw)


def test_a_resumed_seeded_request_draws_what_the_whole_run_drew():
    eng = make_engine(max_len=128, block_size=4, max_n=4)
    eng.add_request("whole", PROMPT, seeded())
    whole = run_all(eng)
    cut = {0: 7, 1: 1, 2: 20}                  # sample 2 had ended (all 20 tokens streamed)
    outputs = [whole[("whole", i)]["tokens"][:k] for i, k in cut.items()]
    eng.add_request("moved", PROMPT, seeded(), resume_output=outputs, resume_ended=[2])
    moved = run_all(eng)
    for i in (0, 1):
        assert outputs[i] + moved[("moved", i)]["tokens"] == whole[("whole", i)]["tokens"]
        assert moved[("moved", i)]["finish"] == "length"
    assert ("moved", 2) not in moved           # an ended sample draws nothing
    assert_clean(eng)


def test_bad_resume_output_is_refused_and_nothing_is_queued():
    eng = make_engine(max_len=64, block_size=4, max_n=4)
    for outputs, ended in (([[1]], []),                       # n=2: one list per sample
                           ([[1], [10_000]], []),            # outside the vocabulary
                           ([[1] * 20, [2]], []),            # no budget left (max_tokens=20)
                           ([[1], [2]], [0, 1])):            # every sample ended
        with pytest.raises(RequestError, match="resume"):
            eng.add_request("bad", PROMPT, seeded(n=2), resume_output=outputs, resume_ended=ended)
        assert not eng.has_unfinished_requests()
    assert_clean(eng)


def test_a_resumed_greedy_request_is_token_identical_to_transformers(tiny_models):
    model_dir = tiny_models["llama"]
    hf = HFReference(model_dir)
    prompt = torch.randint(3, 1000, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    steps = 16
    want, _ = hf.greedy(prompt, steps)
    eng = Engine(EngineConfig(model=model_dir, device="cpu", num_gpu_blocks=64, block_size=4))
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, n=2, logprobs=0)
    eng.add_request("moved", prompt, params, resume_output=[want[:5], want[:11]])
    out = run_all(eng)
    assert want[:5] + out[("moved", 0)]["tokens"] == want
    assert want[:11] + out[("moved", 1)]["tokens"] == want
    assert len(out[("moved", 0)]["logprobs"]) == steps - 5        # logprobs go on with the tokens
    assert_clean(eng)
