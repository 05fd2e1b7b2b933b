"""Speculative sampling with an MTP layer keeps the target's distribution: test_draft_sampling's
chi-square test of homogeneity (same positions, parameters, seeds and false-alarm rate: about
one run in 1,000 under equal distributions), the drafts drawn by the 'partial' oracle MTP layer
(mtp_models.py), whose q is close to p but not equal, so both acceptance and the residual draw
run. The test's power against a verifier that lets q through is shown by test_draft_sampling
(the same rejection.py)."""
from __future__ import annotations

from gpu_worker.mtp_oracle import write_mtp_oracle
from tests.gpu_worker.engine.conftest import _one_torch_thread  # noqa: F401  (fixture)
from tests.gpu_worker.spec_decode.mtp_models import mtp_spec, random_mtp
from tests.gpu_worker.spec_decode.test_draft_sampling import ALPHA, DRAWS, POSITIONS, draws
from tests.gpu_worker.spec_decode.test_spec_sampling import chi_square_p


def test_sampled_distribution_with_mtp_matches_without(tmp_path):
    model_dir = write_mtp_oracle(random_mtp("llama", tmp_path / "random"), tmp_path / "partial", branch=0.05)
    plain, _ = draws(model_dir, None, range(DRAWS))
    spec, stats = draws(model_dir, mtp_spec(k=4, disable_by_batch_size=DRAWS), range(DRAWS, 2 * DRAWS))
    for p in POSITIONS:
        assert len(set(plain[p])) > 5                                    # not a point mass
        assert chi_square_p(plain[p], spec[p]) > ALPHA / 2, p
    assert 0 < stats["accepted"] < stats["proposed"]                     # both branches ran
