"""Speculative sampling with a draft model keeps the target's distribution: on a tiny random
model, the tokens drawn at two output positions (both after speculative steps) over many seeds,
with and without draft_model speculation, pass a chi-square test of homogeneity, with top-k,
top-p, min-p and all three penalties applied. The runs use disjoint seeds, so this compares
distributions, not seeds. Power: the draft's own distribution (the draft decoding alone) fails the
same test against the target's, so a verifier that let the draft's q through would be caught.

False-alarm rate: each position fails at p < ALPHA / 2 under the null hypothesis (equal
distributions), so the test fails about once in 1 / ALPHA = 1,000 runs with random seeds; the
seeds are fixed, so a given code version passes or fails deterministically."""
from __future__ import annotations

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.engine.conftest import _one_torch_thread, tiny_models  # noqa: F401  (fixtures)
from tests.gpu_worker.engine.engine_fakes import assert_clean
from tests.gpu_worker.spec_decode.draft_models import draft_spec, near_copy
from tests.gpu_worker.spec_decode.spec_fakes import prompt, step_to_end
from tests.gpu_worker.spec_decode.test_spec_sampling import chi_square_p

ALPHA = 1e-3
DRAWS = 300              # seeds per run
POSITIONS = (1, 5)       # output positions compared (position 0 is the prefill's draw)
PARAMS = dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, presence_penalty=0.2,
              frequency_penalty=0.1, repetition_penalty=1.05)


def draws(model_dir: str, spec: str | None, seeds: range) -> tuple[dict[int, list[int]], dict]:
    """{position: the token each seed drew there}, and the speculation stats."""
    eng = Engine(EngineConfig(model=model_dir, device="cpu", num_gpu_blocks=512, max_num_seqs=DRAWS,
                              speculative_config=spec))
    ids = prompt(12, 7)
    for s in seeds:
        eng.add_request(f"s{s}", ids, SamplingParams(seed=s, max_tokens=max(POSITIONS) + 1, ignore_eos=True,
                                                      **PARAMS))
    tokens = step_to_end(eng)
    assert_clean(eng)
    assert len(tokens) == len(seeds) and all(len(t) == max(POSITIONS) + 1 for t in tokens.values())
    return {p: [t[p] for t in tokens.values()] for p in POSITIONS}, eng.stats().extra.get("spec_decode", {})


def test_sampled_distribution_with_a_draft_model_matches_without(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    draft_dir = near_copy(model_dir, tmp_path / "near", noise=0.3)
    plain, _ = draws(model_dir, None, range(DRAWS))
    spec, stats = draws(model_dir, draft_spec(draft_dir, k=4, disable_by_batch_size=DRAWS), range(DRAWS, 2 * DRAWS))
    for p in POSITIONS:
        assert len(set(plain[p])) > 5                                    # not a point mass
        assert chi_square_p(plain[p], spec[p]) > ALPHA / 2, p
    assert 0 < stats["accepted"] < stats["proposed"]                     # both branches ran
    drafts_own, _ = draws(draft_dir, None, range(DRAWS))
    assert min(chi_square_p(plain[p], drafts_own[p]) for p in POSITIONS) < ALPHA / 2   # the test has power


def test_a_draft_models_verified_draws_keep_to_allowed_token_ids_and_bad_words(tiny_models, tmp_path):
    """Rejection sampling's p (and the draft's q) are masked as a plain draw is: no emitted token,
    accepted draft or residual draw, is outside allowed_token_ids or a banned bad-word ending."""
    model_dir = tiny_models["llama"]
    draft_dir = near_copy(model_dir, tmp_path / "near", noise=0.3)
    eng = Engine(EngineConfig(model=model_dir, device="cpu", num_gpu_blocks=256, max_num_seqs=64,
                              speculative_config=draft_spec(draft_dir, k=4, disable_by_batch_size=64)))
    ids = prompt(12, 7)
    allowed = list(range(3, 40))
    for s in range(24):
        eng.add_request(f"a{s}", ids, SamplingParams(seed=s, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed))
        eng.add_request(f"b{s}", ids, SamplingParams(seed=s, max_tokens=8, ignore_eos=True,
                                                     bad_words_token_ids=[[t] for t in range(3, 40)]))
    tokens = step_to_end(eng)
    assert_clean(eng)
    assert eng.stats().extra["spec_decode"]["accepted"] > 0
    for rid, toks in tokens.items():
        assert len(toks) == 8
        assert all((3 <= t < 40) == rid.startswith("a") for t in toks), (rid, toks)
