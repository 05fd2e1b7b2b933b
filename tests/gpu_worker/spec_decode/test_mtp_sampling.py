"""Speculative sampling with an MTP layer keeps the target's distribution: test_draft_sampling's
chi-square test of homogeneity (same positions, parameters, seeds and false-alarm rate: about
one run in 1,000 under equal distributions), the drafts drawn by an oracle MTP layer
(gpu_worker/mtp_oracle.py, branch 0.1: q near p but not equal; about a quarter of the sampled
drafts accepted), so both acceptance and the residual draw run. Power: the same draws with every
draft accepted (the distribution of q, not p) fail the test."""
from __future__ import annotations

from gpu_worker.mtp_oracle import write_mtp_oracle
from gpu_worker.spec_decode import rejection
from tests.gpu_worker.engine.conftest import _one_torch_thread  # noqa: F401  (fixture)
from tests.gpu_worker.spec_decode.mtp_models import mtp_spec, random_mtp
from tests.gpu_worker.spec_decode.test_draft_sampling import ALPHA, DRAWS, POSITIONS, draws
from tests.gpu_worker.spec_decode.test_spec_sampling import chi_square_p


def test_sampled_distribution_with_mtp_matches_without(tmp_path, monkeypatch):
    model_dir = write_mtp_oracle(random_mtp("llama", tmp_path / "random"), tmp_path / "oracle", branch=0.1)
    spec_config = mtp_spec(k=4, disable_by_batch_size=DRAWS)
    plain, _ = draws(model_dir, None, range(DRAWS))
    spec, stats = draws(model_dir, spec_config, range(DRAWS, 2 * DRAWS))
    for p in POSITIONS:
        assert len(set(plain[p])) > 5                                    # not a point mass
        assert chi_square_p(plain[p], spec[p]) > ALPHA / 2, p
    assert 0 < stats["accepted"] < stats["proposed"]                     # both branches ran
    # acceptance uniforms ~0: every draft accepted, so tokens follow q
    uniform = rejection.hash_uniform
    monkeypatch.setattr(rejection, "hash_uniform", lambda keys, n: uniform(keys, n) * 1e-9)
    accept_all, _ = draws(model_dir, spec_config, range(DRAWS, 2 * DRAWS))
    assert min(chi_square_p(plain[p], accept_all[p]) for p in POSITIONS) < ALPHA / 2
