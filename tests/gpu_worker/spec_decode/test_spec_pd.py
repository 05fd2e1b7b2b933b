"""Speculation on a decode engine (D) of a prefill/decode pair, under async scheduling: requests
prefilled on P (first token drawn there) and handed off in process decode on D with n-gram,
draft-model and MTP proposals. Greedy tokens equal one engine's without speculation; P, given the
same config, never proposes; a draft model equal to the target accepts every draft on D (its KV
of the imported prompt is caught up on D, and D's prefix hits hold it too); an abort of an
imported sequence right after a verification, or with an async step in flight, leaks no block on
either engine."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.kv_transfer.local import hand_off
from gpu_worker.kv_transfer.messages import Ack
from tests.gpu_worker.engine.conftest import _one_torch_thread  # noqa: F401  (fixture)
from tests.gpu_worker.kv_transfer.conftest import MAX_STEPS, PD, check_clean, engine, greedy, prompt, run_single
from tests.gpu_worker.spec_decode.draft_models import draft_spec
from tests.gpu_worker.spec_decode.mtp_models import mtp_spec, random_mtp
from tests.gpu_worker.spec_decode.spec_fakes import ngram, repetitive
from tests.gpu_worker.spec_decode.test_spec_async import phases, spec_stats, spy_modes

SHARED = prompt(40, 1)          # 2 full blocks of 16 that a later request finds on D


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    """A tiny llama with a random MTP layer: the target of every method here (its loader skips
    the MTP tensors), and its own draft model."""
    return random_mtp("llama", tmp_path_factory.mktemp("spec_pd") / "llama")


def spec_of(method: str, model_dir: str) -> str:
    """disable_by_batch_size 1: while both requests run, D's steps launch one step ahead; alone,
    a request speculates."""
    if method == "ngram":
        return ngram(k=4, lo=1, hi=3, disable_by_batch_size=1)
    if method == "draft_model":
        return draft_spec(model_dir, 3, disable_by_batch_size=1)   # the target as its own draft
    return mtp_spec(3, disable_by_batch_size=1)


def pd_engines(model_dir: str, spec: str) -> PD:
    return PD(engine(model_dir, speculative_config=spec, async_scheduling=True),
              engine(model_dir, speculative_config=spec, async_scheduling=True))


@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp"])
def test_greedy_through_pd_with_speculation_on_d_matches_one_engine(mtp_model, method):
    first = [("a", repetitive(30, 5, 2), greedy(24)), ("b", SHARED, greedy(16))]
    later = [("c", SHARED[:32] + prompt(7, 9), greedy(12))]
    want = run_single(engine(mtp_model), first + later)
    pd = pd_engines(mtp_model, spec_of(method, mtp_model))
    modes = spy_modes(pd.d)
    out = pd.run(first)
    out.update(pd.run(later))
    assert out == want
    assert pd.d.block_manager.prefix_hit_tokens == 32        # c's shared blocks were D's
    assert spec_stats(pd.p)["proposed"] == 0                 # P draws first tokens only
    stats = spec_stats(pd.d)
    assert stats["proposed"] > 0 and {"ahead", "spec"} <= set(phases(modes))
    if method == "draft_model":      # the draft's KV of imported (and D-cached) prompts is true
        assert stats["accepted"] == stats["proposed"]
    if method == "ngram":
        assert stats["accepted"] > 0


def run_aborting(pd: PD, requests: list, rid: str, at_d_step: int) -> dict:
    """Requests through P then D; `rid` aborted on D before D's step `at_d_step` (counted from
    D's first step). -> what D was doing then: {"in_flight": an async step launched,
    "verified": rid's drafts verified by D's previous step}."""
    d, verified, seen = pd.d, set(), {}
    speculative = d._speculative_step

    def spy(out, drafts):
        verified.update(seq.request.request_id for seq in drafts)
        return speculative(out, drafts)

    d._speculative_step = spy
    for rid_, ids, params in requests:
        pd.p.add_request(rid_, ids, params, export_kv=True)
    d_steps = 0
    for _ in range(MAX_STEPS):
        if not (pd.p.has_unfinished_requests() or d.has_unfinished_requests() or pd.p.exported):
            break
        if pd.p.has_unfinished_requests():
            pd.p.step()
        for exported in list(pd.p.exported):
            assert isinstance(hand_off(pd.producer, pd.consumer, exported), Ack)
        if d_steps == at_d_step and rid in d.requests:
            seen = {"in_flight": d._inflight is not None, "verified": rid in verified}
            d.abort_request(rid)
            d.block_manager.check_integrity()
        if d.has_unfinished_requests():
            verified.clear()
            d.step()
            d_steps += 1
        d.block_manager.check_integrity()
    else:
        raise AssertionError("the P/D run did not end")
    check_clean(pd.p)
    check_clean(pd.d)
    return seen


def test_abort_of_an_imported_sequence_around_verification_leaks_no_block(mtp_model):
    """The draft model as its own draft: every verification accepts, so a sequence's blocks grow
    by several tokens a step and the rejected slots of the last step are freed before the abort."""
    requests = [("a", repetitive(30, 5, 2), greedy(40)), ("b", SHARED, greedy(12))]
    spec = spec_of("draft_model", mtp_model)
    seen = [run_aborting(pd_engines(mtp_model, spec), requests, "a", k) for k in range(0, 24, 3)]
    assert any(s.get("in_flight") for s in seen) and any(s.get("verified") for s in seen), seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draft_catch_up_on_cuda(mtp_model):
    """The catch-up's forwards on the device (Triton kernels, fp32, eager), ordered with async steps."""
    kw = dict(model=mtp_model, device="cuda", dtype="float32", attention_backend="triton", enforce_eager=True,
              async_scheduling=True, num_gpu_blocks=64)
    requests = [("a", repetitive(30, 5, 2), greedy(24)), ("b", SHARED, greedy(16))]
    want = run_single(Engine(EngineConfig(**kw)), requests)
    spec = spec_of("draft_model", mtp_model)
    pd = PD(Engine(EngineConfig(**kw)), Engine(EngineConfig(speculative_config=spec, **kw)))
    assert pd.run(requests) == want
    stats = spec_stats(pd.d)
    assert stats["accepted"] == stats["proposed"] > 0
