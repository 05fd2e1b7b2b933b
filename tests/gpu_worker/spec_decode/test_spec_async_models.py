"""draft_model and mtp speculation with one-step-ahead scheduling on tiny models
(test_spec_async.py: the step kinds, n-gram). The batch crosses disable_by_batch_size both ways,
so async steps and speculative steps alternate and each proposer's catch-up runs over async steps
(launched before their input token is known): a draft equal to the target and an oracle MTP layer
still accept every draft, a random MTP layer's first drafts equal a recompute from scratch, and
greedy tokens equal decoding without speculation through chunked prefill and preemption; sampled
tokens keep the target's distribution (test_draft_sampling's chi-square test, its false-alarm
rate: about one run in 1,000 under equal distributions)."""
from __future__ import annotations

import pytest

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.mtp_oracle import write_mtp_oracle
from tests.gpu_worker.devices import CPU_AND_CUDA
from tests.gpu_worker.engine.conftest import _one_torch_thread, tiny_models  # noqa: F401  (fixtures)
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.engine.engine_fakes import assert_clean
from tests.gpu_worker.spec_decode.draft_models import draft_spec, near_copy
from tests.gpu_worker.spec_decode.mtp_models import Recompute, mtp_spec, random_mtp, spy_first_drafts
from tests.gpu_worker.spec_decode.spec_fakes import MAX_STEPS, ngram, prompt, repetitive
from tests.gpu_worker.spec_decode.test_draft_sampling import ALPHA
from tests.gpu_worker.spec_decode.test_spec_sampling import chi_square_p
from tests.gpu_worker.spec_decode.test_spec_async import drive, greedy, phases, spec_stats, spy_modes

# CPU: torch attention. CUDA (marked gpu): fp32 through the Triton kernels, eager.
TARGETS = {"cpu": dict(device="cpu"),
           "cuda": dict(device="cuda", dtype="float32", attention_backend="triton", enforce_eager=True)}
_target = TARGETS["cpu"]


@pytest.fixture(autouse=True, params=CPU_AND_CUDA)
def target(request, monkeypatch):
    monkeypatch.setattr(f"{__name__}._target", TARGETS[request.param])


def model_engine(model_dir: str, spec: str | None, **kw) -> Engine:
    """spec None: the same engine without speculation, synchronous."""
    return Engine(EngineConfig(model=model_dir, speculative_config=spec, async_scheduling=spec is not None,
                               **{**_target, **kw}))


def model_arrivals() -> dict[int, list]:
    """a speculates alone, b and c join (3 running > 2: async steps, chunked prefills) and end
    first, a speculates again alone."""
    return {0: [("a", repetitive(30, 5, 2), greedy(40))],
            3: [("b", prompt(36, 1), greedy(10)), ("c", prompt(40, 3), greedy(14))]}


MODEL_KW = dict(max_num_batched_tokens=16, block_size=8)


def test_ngram_across_both_kinds_of_step_matches_no_speculation(tiny_models):
    """As served: async steps replay decode CUDA graphs (on the GPU), verifications run eager."""
    model_dir = tiny_models["llama"]
    kw = dict(num_gpu_blocks=128, **MODEL_KW, **({"enforce_eager": False, "cuda_graph_max_bs": 16}
                                                 if _target["device"] == "cuda" else {}))
    plain = drive(model_engine(model_dir, None, **kw), model_arrivals())
    eng = model_engine(model_dir, ngram(k=4, lo=1, hi=3, disable_by_batch_size=2), **kw)
    modes = spy_modes(eng)
    assert drive(eng, model_arrivals()) == plain
    # both kinds of step, the verifications where drafts pay (how many: the back-off's, backoff.py)
    assert phases(modes)[:3] == ["ahead", "spec", "ahead"] and spec_stats(eng)["accepted"] > 0


def test_draft_equal_to_the_target_accepts_every_draft_across_async_steps(tiny_models):
    """The draft's KV follows every target forward, async ones included (their inputs taken on
    the device from the previous draw): a draft equal to the target keeps proposing the target's
    own argmax, so every draft is accepted, and the output is unchanged."""
    model_dir = tiny_models["qwen3"]
    plain = drive(model_engine(model_dir, None, num_gpu_blocks=128, **MODEL_KW), model_arrivals())
    eng = model_engine(model_dir, draft_spec(model_dir, 3, disable_by_batch_size=2), num_gpu_blocks=128, **MODEL_KW)
    modes = spy_modes(eng)
    assert drive(eng, model_arrivals()) == plain
    assert phases(modes)[:4] == ["ahead", "spec", "ahead", "spec"]
    stats = spec_stats(eng)
    assert stats["accepted"] == stats["proposed"] > 0


def test_draft_model_through_preemption_matches_no_speculation(tiny_models):
    model_dir = tiny_models["llama"]
    arrivals = {0: [(f"r{i}", prompt(20 + i, 10 + i), greedy(16)) for i in range(3)]}
    kw = dict(num_gpu_blocks=7, block_size=16)          # 3 requests need 2-3 blocks each: preempts
    plain = drive(model_engine(model_dir, None, **kw), arrivals)
    eng = model_engine(model_dir, draft_spec(model_dir, 3, disable_by_batch_size=2), **kw)
    modes = spy_modes(eng)
    assert drive(eng, arrivals) == plain
    assert eng.stats().num_preemptions > 0 and "async" in modes and "spec" in modes
    assert spec_stats(eng)["accepted"] == spec_stats(eng)["proposed"] > 0


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mtp-async")
    random = random_mtp("llama", root / "random")
    return {"random": random, "oracle": write_mtp_oracle(random, root / "oracle", branch=0.0)}


def test_mtp_catch_up_over_async_steps_equals_a_recompute(mtp_models):
    """An async step launches before its input token is known; the MTP's catch-up on it (the
    pending row reads that token) runs after the previous step settles: every first draft of a
    random MTP layer equals a recompute from scratch, through chunks and preemption."""
    model_dir = mtp_models["random"]
    kw = dict(num_gpu_blocks=12, **MODEL_KW)                          # 3 x 6-7 blocks of 8: preempts
    plain = drive(model_engine(model_dir, None, **kw), model_arrivals())
    eng = model_engine(model_dir, mtp_spec(3, disable_by_batch_size=2), **kw)
    modes, seen = spy_modes(eng), spy_first_drafts(eng)
    assert drive(eng, model_arrivals()) == plain
    assert phases(modes)[:4] == ["ahead", "spec", "ahead", "spec"] and eng.stats().num_preemptions > 0
    ref = Recompute(model_dir)
    assert len(seen) > 10 and [d for _, d in seen] == [ref.first_draft(tokens) for tokens, _ in seen]


def test_an_oracle_mtp_layer_accepts_every_draft_across_async_steps(mtp_models):
    """... with c aborted while a step that holds it is in flight: no block and no pending row
    left for it."""
    eng = model_engine(mtp_models["oracle"], mtp_spec(3, disable_by_batch_size=2), num_gpu_blocks=128, **MODEL_KW)
    modes, hits = spy_modes(eng), []
    out = drive(eng, model_arrivals(), abort_at={8: ["c"]}, in_flight_aborts=hits)
    assert hits == [(8, "c")] and len(out.get(("c", 0), [])) < 14 and len(out["a", 0]) == 40
    assert "async" in modes
    stats = spec_stats(eng)
    assert stats["accepted"] == stats["proposed"] > 0
    assert not eng.speculator.proposer.pending            # no pending row kept for ended sequences


WAVE = 150               # seeds per wave; disable_by_batch_size: one wave speculates, two do not
POSITIONS = (2, 3, 4, 5)  # the second wave's output positions compared (drafted after an async step)


def wave_draws(model_dir: str, spec: str | None, seeds: range) -> tuple[dict[int, list[int]], dict]:
    """{position: the token each seed of the second wave drew there}, and the speculation stats.
    The first WAVE seeds draw 3 tokens; the rest start two steps later: with async scheduling the
    first wave speculates alone, both together step ahead without drafts, and the second
    speculates once the first ends. No penalties: they read the tokens on the host, which steps
    synchronously anyway."""
    eng = model_engine(model_dir, spec, num_gpu_blocks=512, max_num_seqs=len(seeds))
    modes = spy_modes(eng)
    ids, early, late = prompt(12, 7), list(seeds)[:WAVE], list(seeds)[WAVE:]
    params = dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, ignore_eos=True)
    for s in early:
        eng.add_request(f"s{s}", ids, SamplingParams(seed=s, max_tokens=3, **params))
    tokens: dict[str, list[int]] = {}
    for step in range(MAX_STEPS):
        if step == 2:
            for s in late:
                eng.add_request(f"s{s}", ids, SamplingParams(seed=s, max_tokens=8, **params))
        if not eng.has_unfinished_requests():
            break
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert_clean(eng)
    got = [tokens[f"s{s}"] for s in late]
    assert all(len(t) == 8 for t in got)
    if spec is not None:
        assert phases(modes)[:4] == ["ahead", "spec", "ahead", "spec"], modes
    return {p: [t[p] for t in got] for p in POSITIONS}, eng.stats().extra.get("spec_decode", {})


def test_sampled_distribution_across_both_kinds_of_step_matches_without(tiny_models, tmp_path):
    if _target["device"] != "cpu":
        pytest.skip("the distribution is tested on the CPU; the GPU runs the greedy tests")
    model_dir = tiny_models["llama"]
    draft_dir = near_copy(model_dir, tmp_path / "near", noise=0.6)   # accepting every draft fails it
    plain, _ = wave_draws(model_dir, None, range(2 * WAVE))
    spec_config = draft_spec(draft_dir, k=4, disable_by_batch_size=WAVE)
    spec, stats = wave_draws(model_dir, spec_config, range(2 * WAVE, 4 * WAVE))
    for p in POSITIONS:
        assert len(set(plain[p])) > 5                                    # not a point mass
        assert chi_square_p(plain[p], spec[p]) > ALPHA / len(POSITIONS), p
    assert 0 < stats["accepted"] < stats["proposed"]                     # both branches ran
