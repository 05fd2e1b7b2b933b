"""The batched sampler: counter-based noise, batch invariance, the logprob rows, penalties."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.sampler import Sampler, SampleRequest, draw_keys, gumbel_draw, hash_uniform
from services.protocol.sampling import SamplingParams


def req(row, out=(), position=-1, seed=0, index=0, prompt=(0,), **params):
    return SampleRequest(row, SamplingParams(**params), seed, index, list(prompt), list(out), (), position)


def test_keys_are_stable_and_distinct():
    a = draw_keys([5, 5, 5, 6], [0, 1, 0, 0], [3, 3, 4, 3])
    assert a.dtype == np.int64 and (a >= 0).all() and len(set(a.tolist())) == 4
    assert draw_keys([5], [1], [3]).tolist() == [a[1]]


def test_hash_uniform_is_uniform_and_open():
    u = hash_uniform(torch.from_numpy(draw_keys([1, 2], [0, 0], [0, 0])), 50_000)
    assert u.shape == (2, 50_000) and float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.std()) - 12 ** -0.5) < 0.01
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
    assert float((hist - 0.1).abs().max()) < 0.01


def test_gumbel_draw_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, float("-inf")]])
    keys = torch.from_numpy(draw_keys(list(range(3000)), [0] * 3000, [0] * 3000))
    draws = gumbel_draw(logits.expand(3000, 4), keys)
    freq = torch.bincount(draws, minlength=4).double() / 3000
    assert torch.allclose(freq, torch.softmax(logits[0].double(), 0), atol=0.03) and freq[3] == 0


def test_a_row_draws_the_same_token_in_any_batch():
    logits = torch.randn(6, 300)
    mine = req(0, position=7, seed=42, index=2, temperature=0.7, top_k=50)
    alone = Sampler()(logits[3:4], [mine])[0].token_id
    others = [req(i, position=i, seed=i, temperature=[0.0, 1.0][i % 2]) for i in range(6)]
    others[3] = mine._replace(row=3)
    assert Sampler()(logits, others)[3].token_id == alone
    assert Sampler()(logits[[3, 3]], [mine, mine._replace(row=1)])[1].token_id == alone


def test_logprobs_only_for_rows_that_ask():
    logits = torch.randn(3, 40)
    out = Sampler()(logits, [req(0, temperature=0.0), req(1, temperature=0.0, logprobs=2),
                             req(2, temperature=1.0, logprobs=0)])
    assert out[0].logprob is None and len(out[1].logprob.top) == 2 and out[2].logprob.top == ()
    raw = torch.log_softmax(logits, -1)
    assert out[1].logprob.logprob == pytest.approx(float(raw[1, out[1].token_id]))
    assert out[2].logprob.logprob == pytest.approx(float(raw[2, out[2].token_id]))


def test_batched_penalties_match_one_row_at_a_time():
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    reqs = [req(0, out=[1, 1, 2], prompt=[3], temperature=0.0, repetition_penalty=1.7),
            req(1, out=[5], prompt=[6, 7], temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5),
            req(2, temperature=0.0),
            req(3, out=[9, 9, 9], prompt=[9], temperature=0.0, repetition_penalty=0.5, frequency_penalty=-1.0)]
    batched = [r.token_id for r in Sampler()(logits, reqs)]
    single = [Sampler()(logits[i:i + 1], [r._replace(row=0)])[0].token_id for i, r in enumerate(reqs)]
    assert batched == single


def test_launch_keeps_logits_only_for_logprobs_and_never_aliases_them():
    """A pending draw must not depend on the logits tensor it was given: under async_scheduling
    that may be a CUDA graph's output, rewritten by the next replay before `results()`."""
    logits = torch.randn(2, 30)
    plain = Sampler().launch(logits, [req(0, temperature=0.0), req(1, temperature=0.0)])
    assert plain.raw is None                                  # nothing to keep alive
    asked = Sampler().launch(logits, [req(0, temperature=0.0, logprobs=2), req(1, temperature=0.0)])
    assert asked.raw is not None and asked.raw.data_ptr() != logits.data_ptr()
    expected = torch.log_softmax(logits[0], dim=-1)
    logits.fill_(0.0)                                         # "the next replay"
    res = asked.stage().results()
    assert res[0].token_id == int(expected.argmax()) and res[1].logprob is None
    assert abs(res[0].logprob.logprob - float(expected.max())) < 1e-5
