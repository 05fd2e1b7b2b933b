"""Sampler semantics on hand-made logits."""
import math
import re

import pytest
import torch

from gpu_worker.sampler import Sampler, SampleRequest
from services.protocol.sampling import SamplingParams

V = 8


def req(row=0, out=(), prompt=(0,), stop_ids=(), seed=0, index=0, **params):
    return SampleRequest(row, SamplingParams(**params), seed, index, list(prompt), list(out), tuple(stop_ids))


def one(logits, **kw):
    return Sampler()(torch.tensor([logits], dtype=torch.float32), [req(**kw)])[0]


BASE = [0.0, 5.0, 4.0, 1.0, -2.0, 0.5, 0.2, 3.0]   # argmax 1, then 2, then 7


def test_greedy_and_raw_logprobs():
    r = one(BASE, temperature=0.0, logprobs=3, repetition_penalty=2.0, prompt=[1])
    assert r.token_id == 2                                  # 5/2 = 2.5 < 4: penalty changed the pick
    raw = torch.log_softmax(torch.tensor(BASE), -1)
    assert r.logprob.logprob == pytest.approx(float(raw[2]))   # raw logprob, not the penalized one
    assert [t for t, _ in r.logprob.top] == [1, 2, 7]


def test_repetition_penalty_multiplies_negative_logits():
    logits = [-1.0, -2.0, -3.0, -9.0, -9.0, -9.0, -9.0, -9.0]
    assert one(logits, temperature=0.0, repetition_penalty=3.0, out=[0]).token_id == 1   # -3 vs -2


def test_presence_and_frequency_use_output_only():
    assert one(BASE, temperature=0.0, presence_penalty=2.0, prompt=[1]).token_id == 1   # prompt ignored
    assert one(BASE, temperature=0.0, presence_penalty=2.0, out=[1]).token_id == 2
    assert one(BASE, temperature=0.0, frequency_penalty=0.4, out=[1, 1]).token_id == 1   # 5 - 0.8 > 4
    assert one(BASE, temperature=0.0, frequency_penalty=0.6, out=[1, 1]).token_id == 2   # 5 - 1.2 < 4


def test_min_tokens_masks_stop_ids():
    assert one(BASE, temperature=0.0, min_tokens=2, out=[3], stop_ids=[1]).token_id == 2
    assert one(BASE, temperature=0.0, min_tokens=1, out=[3], stop_ids=[1]).token_id == 1


@pytest.mark.parametrize("extra,allowed", [
    (dict(top_k=2), {1, 2}),
    (dict(top_p=0.5), {1}),
    (dict(min_p=0.3), {1, 2}),      # p(2)/p(1) = e^-1 = 0.37 > 0.3 ; p(7)/p(1) = 0.14
])
def test_filters_restrict_the_support(extra, allowed):
    seen = {one(BASE, temperature=1.0, seed=s, **extra).token_id for s in range(60)}
    assert seen <= allowed and len(seen) == len(allowed)


def test_seeded_draw_independent_of_batch_and_reproducible():
    logits = torch.randn(5, 64)
    alone = Sampler()(logits[2:3], [req(row=0, seed=11, index=1, out=[3, 4], temperature=0.9)])[0]
    batch = [req(row=i, seed=i, temperature=1.0) for i in range(5)]
    batch[2] = req(row=2, seed=11, index=1, out=[3, 4], temperature=0.9)
    assert Sampler()(logits, batch)[2].token_id == alone.token_id
    draws = {Sampler()(logits[2:3], [req(seed=11, index=1, out=[3] * k, temperature=5.0)])[0].token_id
             for k in range(30)}
    assert len(draws) > 3     # a new position gives a new draw


def test_sampling_follows_the_distribution():
    probs = torch.softmax(torch.tensor(BASE), -1)
    counts = torch.zeros(V)
    for s in range(400):
        counts[one(BASE, temperature=1.0, seed=s).token_id] += 1
    assert abs(counts[1] / 400 - probs[1]) < 0.08 and abs(counts[2] / 400 - probs[2]) < 0.08
    assert not math.isnan(float(counts.sum()))


def test_bf16_logits_give_what_their_float32_copy_gives():
    """An eager step hands the sampler its head's bf16 logits (ModelRunner.forward): every path
    (greedy, ties included; penalties; min_tokens; seeded draws with filters; raw logprobs) must
    choose what it chooses on the exact float32 copy of the same values."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 300, generator=g) * 4).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1          # a tie: the first index wins
    reqs = [req(0, temperature=0.0, logprobs=2),
            req(1, temperature=0.0, repetition_penalty=1.5, prompt=[3, 4], out=[5]),
            req(2, temperature=0.0, min_tokens=3, stop_ids=[int(logits[2].argmax())], out=[1]),
            req(3, temperature=0.8, top_k=20, seed=11),
            req(4, temperature=1.0, top_p=0.9, min_p=0.05, seed=12, logprobs=1),
            req(5, temperature=0.0, frequency_penalty=0.5, out=[int(logits[5].argmax())] * 3)]
    got, want = Sampler()(logits, reqs), Sampler()(logits.float(), reqs)
    assert got[0].token_id == 7
    assert [r.token_id for r in got] == [r.token_id for r in want]
    for a, b in zip(got, want):
        assert (a.logprob is None) == (b.logprob is None)
        if a.logprob is not None:
            assert a.logprob.logprob == b.logprob.logprob and a.logprob.top == b.logprob.top
    assert logits.dtype == torch.bfloat16                    # the caller's tensor is left alone


def test_greedy_rows_of_bf16_logits_are_not_copied_to_float32(monkeypatch):
    """The point of taking bf16 logits: an all-greedy batch without logprobs costs one argmax,
    no (R, V) float32 copy."""
    logits = torch.randn(4, 50).to(torch.bfloat16)
    want = logits.float().argmax(-1).tolist()
    casts = []
    real_float, real_to = torch.Tensor.float, torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "float", lambda t: casts.append("float") or real_float(t))
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: casts.append(("to", a)) or real_to(t, *a, **k))
    out = Sampler()(logits, [req(i, temperature=0.0) for i in range(4)])
    assert [r.token_id for r in out] == want
    assert casts == []


def test_logit_bias_moves_greedy_and_bans_tokens():
    assert one(BASE, temperature=0.0, logit_bias={7: 2.5}).token_id == 7          # 3 + 2.5 > 5
    assert one(BASE, temperature=0.0, logit_bias={1: -100.0, 2: -100.0}).token_id == 7
    r = one(BASE, temperature=0.0, logit_bias={7: 2.5}, logprobs=1)
    assert r.logprob.logprob == pytest.approx(float(torch.log_softmax(torch.tensor(BASE), -1)[7]))  # raw
    for seed in range(20):                                   # a banned token is never drawn
        assert one(BASE, temperature=1.0, seed=seed, logit_bias={1: -100.0}).token_id != 1


def test_logit_bias_comes_before_penalties_and_keeps_min_tokens_masks():
    # bias first: 3 + 2.5 = 5.5 > 5, then presence 2.0 on output token 7 -> 3.5 < 5: token 1 wins
    assert one(BASE, temperature=0.0, logit_bias={7: 2.5}, presence_penalty=2.0, out=[7]).token_id == 1
    # a stop id masked under min_tokens stays masked whatever its bias
    assert one(BASE, temperature=0.0, logit_bias={1: 100.0}, min_tokens=2, max_tokens=4, stop_ids=[1]).token_id == 2


def test_logit_bias_per_row_in_a_batch():
    x = torch.tensor([BASE, BASE, BASE], dtype=torch.float32)
    before = x.clone()
    rs = [req(0, temperature=0.0, logit_bias={3: 10.0}), req(1, temperature=0.0),
          req(2, temperature=0.0, logit_bias={3: 1.0, 4: 20.0})]
    assert [r.token_id for r in Sampler()(x, rs)] == [3, 1, 4]
    assert torch.equal(x, before)                            # the logits are not changed in place


@pytest.mark.parametrize("bias, needle", [
    ({-1: 1.0}, "token ids must be in"), ({V: 1.0}, "token ids must be in [0, 8)"),
    ({1: 101.0}, "biases must be in [-100, 100]"), ({1: float("nan")}, "biases must be in"),
    ({i: 1.0 for i in range(1025)}, "at most 1024 token ids"),
])
def test_logit_bias_is_bounded(bias, needle):
    from services.protocol.sampling import SamplingParamsError
    with pytest.raises(SamplingParamsError, match=re.escape(needle)):
        SamplingParams(logit_bias=bias).validate(V)


def test_allowed_token_ids_mask_every_other_token_per_row():
    """vLLM's allowed_token_ids: greedy and drawn tokens come from the list; logprobs stay raw."""
    x = torch.tensor([BASE, BASE, BASE], dtype=torch.float32)
    rs = [req(0, temperature=0.0, allowed_token_ids=[3, 4]), req(1, temperature=0.0),
          req(2, temperature=0.0, allowed_token_ids=[6], logprobs=0)]
    got = Sampler()(x, rs)
    assert [r.token_id for r in got] == [3, 1, 6]
    assert got[2].logprob.logprob == pytest.approx(float(torch.log_softmax(torch.tensor(BASE), -1)[6]))
    for seed in range(20):
        assert one(BASE, temperature=1.0, seed=seed, allowed_token_ids=[0, 4, 5]).token_id in (0, 4, 5)


def test_bad_words_ban_the_last_token_after_the_rest_of_the_word():
    """vLLM's bad words: a one-token word is always banned; a longer one's last token only when
    the output ends in its other tokens (the prompt does not count)."""
    words = [[1], [7, 2]]
    assert one(BASE, temperature=0.0, bad_words_token_ids=words).token_id == 2
    assert one(BASE, temperature=0.0, bad_words_token_ids=words, out=[7]).token_id == 7   # 1 and 2 banned
    assert one(BASE, temperature=0.0, bad_words_token_ids=words, out=[7, 0], prompt=[7]).token_id == 2
    assert one(BASE, temperature=0.0, bad_words_token_ids=[[5, 6, 1]], out=[6]).token_id == 1   # too short
    assert one(BASE, temperature=0.0, bad_words_token_ids=[[5, 6, 1]], out=[0, 5, 6]).token_id == 2
    for seed in range(20):
        assert one(BASE, temperature=1.0, seed=seed, bad_words_token_ids=words, out=[7]).token_id not in (1, 2)


@pytest.mark.parametrize("fields, needle", [
    ({"allowed_token_ids": []}, "invalid allowed_token_ids: must list 1 to"),
    ({"allowed_token_ids": [V]}, "invalid allowed_token_ids: ids must be in [0, 8)"),
    ({"allowed_token_ids": list(range(4097))}, "invalid allowed_token_ids"),
    ({"bad_words": ["  "]}, "invalid bad_words"), ({"bad_words": ["x" * 257]}, "invalid bad_words"),
    ({"bad_words": ["x"] * 65}, "invalid bad_words: at most 64"),
    ({"bad_words_token_ids": [[]]}, "invalid bad_words"), ({"bad_words_token_ids": [[V]]}, "invalid bad_words"),
])
def test_token_masks_are_bounded(fields, needle):
    from services.protocol.sampling import SamplingParamsError
    with pytest.raises(SamplingParamsError, match=re.escape(needle)):
        SamplingParams(**fields).validate(V)


@pytest.mark.parametrize("extra", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, top_k=3, min_p=0.1)])
def test_a_row_whose_masks_leave_no_token_is_blocked(extra):
    """allowed_token_ids all banned by bad words (or min_tokens' stop ids): the row is blocked,
    with no logprob (no NaN), and the other rows draw as alone."""
    x = torch.tensor([BASE, BASE, BASE], dtype=torch.float32)
    rs = [req(0, allowed_token_ids=[3, 4], bad_words_token_ids=[[3], [4]], logprobs=2, **extra),
          req(1, temperature=0.0, logprobs=1),
          req(2, allowed_token_ids=[5], min_tokens=2, stop_ids=[5], **extra)]
    got = Sampler()(x, rs)
    assert [r.blocked for r in got] == [True, False, True]
    assert got[0].logprob is None and got[2].logprob is None
    assert got[1] == Sampler()(x[1:2], [req(0, temperature=0.0, logprobs=1)])[0]


def test_rejection_sampling_blocks_a_row_with_no_token_instead_of_drawing_from_nan():
    """A draft model's verification (gpu_worker/spec_decode/rejection.py): p of a row whose masks
    leave no token is NaN; that row's result is blocked (never token 0), the accepted draft
    before it stands, and no NaN reaches a logprob."""
    from gpu_worker.spec_decode.rejection import verify
    logits = torch.tensor([BASE, BASE, BASE], dtype=torch.float32)
    words = [[3, 3], [3, 5]]
    rows = [req(j, out=[3] * j, temperature=1.0, seed=4, logprobs=1, allowed_token_ids=[3, 5],
                bad_words_token_ids=words) for j in range(3)]
    q = torch.zeros(2, V)
    q[:, 3] = 1.0                                         # the draft drew 3 for sure: p(3) / q(3) decides
    logits[0, 3] = 50.0                                   # p(3) = 1 at the first position: accepted
    [got] = verify(logits, [([3, 3], rows, q)])
    assert got.results[0].token_id == 3 and not got.results[0].blocked
    assert got.results[1].blocked and got.results[1].logprob is None
    assert all(not math.isnan(r.logprob.logprob) for r in got.results if r.logprob is not None)
