"""Speculation on a decode engine (D) of a prefill/decode pair, under async scheduling: requests
prefilled on P (first token drawn there) and handed off in process decode on D with n-gram,
draft-model and MTP proposals. Greedy tokens equal one engine's without speculation; P, given the
same config, never proposes; a draft model equal to the target accepts every draft on D (its KV
of the imported prompt is caught up on D, and D's prefix hits hold it too); an oracle MTP layer
accepts every draft on D from D's first step (its KV of the prompt and P's last hidden state come
with the hand-off), and a P and a D that disagree on carrying MTP KV refuse the hand-off; an
abort of an imported sequence right after a verification, or with an async step in flight, leaks
no block on either engine."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.kv_transfer.connector import EngineKVConsumer, EngineKVProducer
from gpu_worker.kv_transfer.local import hand_off
from gpu_worker.kv_transfer.messages import (MAX_HIDDEN_BYTES, Ack, Done, Fail, LastHidden, Refuse, decode,
                                             encode)
from gpu_worker.mtp_oracle import write_mtp_oracle
from tests.gpu_worker.engine.conftest import _one_torch_thread  # noqa: F401  (fixture)
from tests.gpu_worker.kv_transfer.conftest import (MAX_STEPS, PD, check_clean, collect, engine, greedy, prompt,
                                                  run_single)
from tests.gpu_worker.spec_decode.draft_models import draft_spec
from tests.gpu_worker.spec_decode.mtp_models import Recompute, mtp_spec, random_mtp, spy_first_drafts
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


K = 3


@pytest.fixture(scope="module")
def mtp_oracle(mtp_model, tmp_path_factory) -> str:
    """mtp_model whose MTP layer predicts the target exactly (gpu_worker/mtp_oracle.py)."""
    return write_mtp_oracle(mtp_model, tmp_path_factory.mktemp("spec_pd") / "oracle", branch=0.0)


def mtp_engine(model_dir: str, **kw) -> Engine:
    return engine(model_dir, speculative_config=mtp_spec(K), **kw)


@pytest.mark.parametrize("chunk,async_p", [(None, False), (16, True)])
def test_oracle_mtp_on_d_accepts_every_draft_from_its_first_step(mtp_oracle, chunk, async_p):
    """P (whole prompts, or chunks of 16 under async scheduling: MTP rows pending across chunks,
    the last one settled a step after its launch) runs the MTP over the
    prompt; the hand-off moves its KV and the last hidden state; D's first decode step already
    proposes k drafts, all accepted, as a mixed engine's does. 5 verifications of k + 1 tokens
    after P's first token: a D without the MTP state would verify fewer or accept less."""
    steps = 1 + 5 * (K + 1)
    requests = [(f"r{i}", repetitive(25 + 9 * i, 4 + i, i), greedy(steps)) for i in range(3)]
    mixed = mtp_engine(mtp_oracle)
    want = run_single(mixed, requests)
    p_kw = {"max_num_batched_tokens": chunk, "async_scheduling": async_p} if chunk else {}
    pd = PD(mtp_engine(mtp_oracle, **p_kw), mtp_engine(mtp_oracle))
    assert pd.producer.layout.mtp_layers == pd.consumer.layout.mtp_layers == 1
    firsts = spy_first_drafts(pd.d)
    ran_first = []
    admit = pd.d.admit_imported
    pd.d.admit_imported = lambda rid, *a: (admit(rid, *a), ran_first.append(
        pd.d.speculator.proposer.can_propose(pd.d.requests[rid].seqs[0])))[0]
    assert pd.run(requests) == want
    assert ran_first == [True] * 3                         # each could draft at D's first step
    for _, ids, _ in requests:                             # D's first propose: after P's token only
        assert min(len(tokens) for tokens, _ in firsts if tokens[:len(ids)] == ids) == len(ids) + 1
    stats, mixed_stats = spec_stats(pd.d), spec_stats(mixed)
    assert stats["accepted"] == stats["proposed"] == 3 * 5 * K and stats["verify_steps"] == 3 * 5
    assert stats["accepted_per_pos"] == mixed_stats["accepted_per_pos"] == [15] * K
    assert spec_stats(pd.p)["proposed"] == 0


@pytest.mark.parametrize("bad", ["dtype", "size", "name"])
def test_a_bad_last_hidden_fails_the_hand_off_and_an_oversized_one_never_decodes(mtp_model, bad):
    """D checks P's hidden state against its MTP layer (dtype, width) before admitting: a bad one
    fails the request with the reason, both engines' blocks freed."""
    pd = PD(mtp_engine(mtp_model), mtp_engine(mtp_model))
    last_hidden = pd.producer.last_hidden
    broken = {"dtype": lambda h: LastHidden("float16", h.data[:len(h.data) // 2]),
              "size": lambda h: LastHidden(h.dtype, h.data + h.data[:4]),
              "name": lambda h: LastHidden("complex64", h.data)}[bad]
    pd.producer.last_hidden = lambda rid: broken(last_hidden(rid))
    pd.p.add_request("a", prompt(20, 3), greedy(4), export_kv=True)
    while pd.p.has_unfinished_requests():
        pd.p.step()
    answer = hand_off(pd.producer, pd.consumer, "a")
    assert isinstance(answer, Fail) and "invalid last_hidden" in answer.reason, answer
    check_clean(pd.p)
    check_clean(pd.d)
    too_big = Done("a", 0, last_hidden=LastHidden("float32", bytes(MAX_HIDDEN_BYTES + 1)))
    with pytest.raises(ValueError, match="malformed"):
        decode(encode(too_big))


def test_a_prefill_engine_decoding_an_export_itself_drafts_from_its_first_step(mtp_oracle):
    """keep_export (no decode engine took it): the MTP's pending row left on the request comes
    back, so P speculates at once, as a mixed engine does."""
    steps = 1 + 3 * (K + 1)
    p = mtp_engine(mtp_oracle)
    ids = repetitive(30, 5, 1)
    p.add_request("a", ids, greedy(steps), export_kv=True)
    out: dict = {}
    collect(out, p.step())
    assert p.exported["a"].handoff_hidden is not None and p.keep_export("a")
    while p.has_unfinished_requests():
        collect(out, p.step())
    assert out == run_single(mtp_engine(mtp_oracle), [("a", ids, greedy(steps))])
    stats = spec_stats(p)
    assert stats["accepted"] == stats["proposed"] == 3 * K and stats["verify_steps"] == 3
    check_clean(p)


def test_mtp_drafts_on_d_equal_a_recompute(mtp_model):
    """The random MTP layer reads h_i, t_{i+1} and its own KV: every draft D draws, from its
    first step on, equals one computed from scratch over the whole context, so the MTP KV that P
    wrote in chunks (and that D's prefix hit on b's blocks holds) and P's last hidden state landed
    right on D."""
    shared = prompt(40, 5)
    requests = [("a", shared + [7, 8, 9], greedy(10)), ("b", prompt(37, 6), greedy(10))]
    pd = PD(mtp_engine(mtp_model, max_num_batched_tokens=16), mtp_engine(mtp_model))
    seen = spy_first_drafts(pd.d)
    pd.run(requests)
    pd.run([("c", shared + [7, 1], greedy(6))])
    assert pd.d.block_manager.prefix_hit_tokens == 32
    ref = Recompute(mtp_model)
    assert len(seen) >= 6 and [d for _, d in seen] == [ref.first_draft(tokens) for tokens, _ in seen]
    for rid, ids, _ in requests:                           # drafted at D's first step
        assert any(tokens == ids + tokens[len(ids):len(ids) + 1] for tokens, _ in seen), rid


def test_blocks_streamed_from_an_mtp_prefill_hold_their_final_mtp_kv(mtp_model):
    """engine.prefilled_blocks (what a prefill worker streams while later chunks run) names a
    block only once the MTP row of its last position, which waits for the next token, is written."""
    p = mtp_engine(mtp_model, max_num_batched_tokens=16)
    p.add_request("a", prompt(50, 4), greedy(4), export_kv=True)
    mtp_k, mtp_v = p.speculator.handoff_caches()[0]      # (num_blocks, block_size, kv heads, head dim)
    early: dict[int, tuple] = {}
    while p.has_unfinished_requests():
        p.step()
        for b in p.prefilled_blocks("a"):
            early.setdefault(b, (mtp_k[b].clone(), mtp_v[b].clone()))
    assert len(early) == 2                                # blocks 0 and 1 (rows 15 and 31 written a chunk later)
    assert all(torch.equal(k, mtp_k[b]) and torch.equal(v, mtp_v[b]) for b, (k, v) in early.items())
    assert p.release_export("a")
    check_clean(p)


@pytest.mark.parametrize("mtp_on", ["p", "d"])
def test_p_and_d_that_disagree_on_mtp_kv_refuse_the_hand_off(mtp_model, mtp_on):
    """One side carries the MTP layer's KV, the other not: D refuses before any block moves,
    naming mtp_layers and the fix; P frees its blocks; D reserved none."""
    p = mtp_engine(mtp_model) if mtp_on == "p" else engine(mtp_model)
    d = mtp_engine(mtp_model) if mtp_on == "d" else engine(mtp_model)
    producer, consumer = EngineKVProducer(p), EngineKVConsumer(d)
    p.add_request("a", prompt(20, 3), greedy(4), export_kv=True)
    while p.has_unfinished_requests():
        p.step()
    answer = hand_off(producer, consumer, "a")
    assert isinstance(answer, Refuse), answer
    assert "mtp_layers" in answer.reason and '"method": "mtp"' in answer.reason, answer.reason
    check_clean(p)
    check_clean(d)
    assert consumer.blocks_received == 0


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mtp_hand_off_on_cuda(mtp_oracle):
    """P's MTP catch-up over chunked prompts, the MTP KV and hidden state moved device to host to
    device, and D's first-step drafts (Triton kernels, fp32, eager)."""
    kw = dict(model=mtp_oracle, device="cuda", dtype="float32", attention_backend="triton", enforce_eager=True,
              num_gpu_blocks=64, speculative_config=mtp_spec(K))
    steps = 1 + 5 * (K + 1)
    requests = [(f"r{i}", repetitive(25 + 9 * i, 4 + i, i), greedy(steps)) for i in range(3)]
    want = run_single(Engine(EngineConfig(**kw)), requests)
    pd = PD(Engine(EngineConfig(max_num_batched_tokens=16, async_scheduling=True, **kw)), Engine(EngineConfig(**kw)))
    assert pd.run(requests) == want
    stats = spec_stats(pd.d)
    assert stats["accepted"] == stats["proposed"] == 3 * 5 * K and stats["verify_steps"] == 3 * 5
