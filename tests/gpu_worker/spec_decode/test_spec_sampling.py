"""Sampling with speculation keeps the target's distribution: on a tiny random model, the token
drawn at a fixed output position (after speculative steps) over many seeds, with and without
speculation, passes a chi-square test of homogeneity. The two runs use disjoint seeds, so this
tests the distributions, not the fact that a seed gives the same tokens both ways.

False-alarm rate: the test fails when p < ALPHA = 1e-3 under the null hypothesis (equal
distributions), i.e. about once in 1,000 runs if the seeds were random; the seeds are fixed, so a
given code version passes or fails deterministically."""
from __future__ import annotations

import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.engine.conftest import tiny_models  # noqa: F401  (fixture)
from tests.gpu_worker.engine.engine_fakes import assert_clean
from tests.gpu_worker.spec_decode.spec_fakes import MAX_STEPS, ngram, step_to_end

ALPHA = 1e-3
DRAWS = 400              # seeds per run
POSITION = 7             # the output position compared (positions 1.. are speculated)
MIN_EXPECTED = 5         # categories expected rarer than this in either run are pooled


def last_tokens(model_dir: str, spec: str | None, seeds: range, params: dict) -> tuple[list[int], dict]:
    eng = Engine(EngineConfig(model=model_dir, device="cpu", num_gpu_blocks=1024, max_num_seqs=DRAWS,
                              speculative_config=spec))
    ids = _prompt(eng)
    before = dict(eng.stats().extra.get("spec_decode", {}))     # the greedy prompt's own drafts
    for s in seeds:
        eng.add_request(f"s{s}", ids, SamplingParams(seed=s, max_tokens=POSITION + 1, ignore_eos=True, **params))
    tokens = step_to_end(eng)
    assert_clean(eng)
    assert all(len(t) == POSITION + 1 for t in tokens.values())
    after = eng.stats().extra.get("spec_decode", {})
    return [t[POSITION] for t in tokens.values()], {k: after[k] - before[k] for k in ("proposed", "accepted")
                                                     if k in after}


def _prompt(eng: Engine) -> list[int]:
    """A third of the vocabulary, then the model's own greedy continuation of it. Greedy decoding
    of random weights falls into cycles, so the sampled tokens often continue one and n-gram
    drafts from it are often accepted; a token off the cycle most likely occurred in the first
    part, so its draft (the next id) is verified and usually rejected: both branches run."""
    ids = list(range(3, eng.vocab_size // 3))
    eng.add_request("greedy", ids, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            break
        for d in eng.step():
            ids += d.new_token_ids
    return ids


def chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of the chi-square test that samples a and b come from one distribution."""
    cats = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(c) for c in cats], [b.count(c) for c in cats]], dtype=torch.float64)
    expected = counts.sum(0, keepdim=True) * counts.sum(1, keepdim=True) / counts.sum()   # (2, C)
    rare = (expected < MIN_EXPECTED).any(0)
    if rare.any():                                        # pool the rare categories into one
        counts = torch.cat([counts[:, ~rare], counts[:, rare].sum(1, keepdim=True)], dim=1)
        expected = counts.sum(0, keepdim=True) * counts.sum(1, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_chi_square_helper_rejects_different_distributions():
    assert chi_square_p([0] * 200 + [1] * 200, [0] * 300 + [1] * 100) < ALPHA
    assert chi_square_p([0] * 200 + [1] * 200, [1] * 205 + [0] * 195) > 0.5


def test_sampled_distribution_with_speculation_matches_without(tiny_models):
    model_dir = tiny_models["llama"]
    # presence_penalty only: a repetition penalty would also push the drafts (prompt tokens) away
    params = dict(temperature=0.6, top_p=0.9, top_k=20, presence_penalty=0.2)
    plain, _ = last_tokens(model_dir, None, range(DRAWS), params)
    spec, stats = last_tokens(model_dir, ngram(k=4, lo=1, hi=3, disable_by_batch_size=DRAWS),
                              range(DRAWS, 2 * DRAWS), params)
    assert len(set(plain)) > 3                                               # not a point mass
    assert chi_square_p(plain, spec) > ALPHA
    assert stats["accepted"] > 0 and stats["proposed"] > stats["accepted"]   # both branches ran
