"""draft_model speculation on tiny random models of every architecture, the draft of the same
family (draft_models.py): greedy tokens identical to decoding without speculation (itself
identical to transformers: tests/gpu_worker/engine/) through batching, chunked prefill, prefix
hits, n > 1 and preemption, and to transformers directly for one architecture; a draft equal
to the target accepts every draft; an independent draft (acceptance ~0) rolls everything back;
exact block accounting after every step; a draft that cannot serve the target is refused at start."""
from __future__ import annotations

import json
import shutil

import pytest

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.devices import CPU_AND_CUDA
from tests.gpu_worker.engine.conftest import HFReference, _one_torch_thread, tiny_models  # noqa: F401  (fixtures)
from tests.gpu_worker.engine.engine_fakes import assert_clean, collect
from tests.gpu_worker.spec_decode.draft_models import draft_spec, near_copy, small_draft
from tests.gpu_worker.spec_decode.spec_fakes import MAX_STEPS, prompt, repetitive

STEPS = 16
K = 3


@pytest.fixture(scope="session")
def drafts(tiny_models, tmp_path_factory) -> dict[str, dict[str, str]]:
    """{arch: {"near": dir, "small": dir}} beside the session's tiny targets."""
    root = tmp_path_factory.mktemp("drafts")
    return {arch: {"near": near_copy(target, root / f"{arch}-near", noise=0.3),
                   "small": small_draft(arch, root / f"{arch}-small")} for arch, target in tiny_models.items()}


def greedy(n: int = 1, max_tokens: int = STEPS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def drain(eng: Engine, arrivals: dict[int, list], abort_at: dict[int, list] | None = None) -> dict:
    """Step until idle (bounded); arrivals {step: [(rid, prompt, params)]}, abort_at {step: [rid]}."""
    out: dict = {}
    arrivals, abort_at = dict(arrivals), dict(abort_at or {})
    for step in range(MAX_STEPS):
        for rid, ids, params in arrivals.pop(step, []):
            eng.add_request(rid, ids, params)
        for rid in abort_at.pop(step, []):
            eng.abort_request(rid)
        if not (eng.has_unfinished_requests() or arrivals):
            break
        collect(eng.step(), out)
        eng.block_manager.check_integrity()
        for seq in eng.scheduler.running:        # rejected drafts' slots were given back
            assert len(seq.block_table) == eng.block_manager.blocks_for(seq.num_computed_tokens)
    assert_clean(eng)
    return {key: v["tokens"] for key, v in out.items()}


# CPU: torch attention. CUDA (marked gpu): fp32 through the Triton kernels, both models eager.
TARGETS = {"cpu": dict(device="cpu"),
           "cuda": dict(device="cuda", dtype="float32", attention_backend="triton", enforce_eager=True)}
_target = TARGETS["cpu"]


@pytest.fixture(autouse=True, params=CPU_AND_CUDA)
def target(request, monkeypatch):
    monkeypatch.setattr(f"{__name__}._target", TARGETS[request.param])


def engine(model_dir: str, draft_dir: str | None, k: int = K, **kw) -> Engine:
    """draft_dir None: the same engine without speculation."""
    kw.setdefault("num_gpu_blocks", 128)
    return Engine(EngineConfig(model=model_dir, speculative_config=draft_spec(draft_dir, k) if draft_dir else None,
                               **_target, **kw))


def spec(eng: Engine) -> dict:
    return eng.stats().extra["spec_decode"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_batch_chunks_prefix_hits_and_forks_match_no_speculation(arch, tiny_models, drafts):
    model_dir = tiny_models[arch]
    shared = prompt(36, 1)
    prompts = {"a": prompt(30, 2), "b": shared + [11], "c": prompt(40, 3), "d": shared + [12]}
    arrivals = {0: [("a", prompts["a"], greedy()), ("b", prompts["b"], greedy())],
                3: [("c", prompts["c"], greedy(n=2))], 20: [("d", prompts["d"], greedy())]}
    kw = dict(max_num_batched_tokens=16, block_size=8)
    plain = drain(engine(model_dir, None, **kw), arrivals)
    eng = engine(model_dir, drafts[arch]["near"], **kw)
    out = drain(eng, arrivals)
    assert out == plain and len(out) == 5
    assert out[("c", 1)] == out[("c", 0)]                 # greedy samples agree
    assert eng.block_manager.prefix_hit_tokens >= 32       # d reused b's prompt blocks
    stats = spec(eng)
    assert 0 < stats["accepted"] < stats["proposed"]       # both accepted and rejected drafts
    assert stats["decode_row_steps"] > 0 and stats["extend_steps"] > 0   # both verification forms


def test_preemption_matches_transformers(drafts, tiny_models):
    model_dir = tiny_models["llama"]
    hf = HFReference(model_dir)
    arch = "llama"
    prompts = {f"r{i}": prompt(20 + i, 10 + i) for i in range(4)}
    eng = engine(model_dir, drafts[arch]["near"], num_gpu_blocks=9)   # each request needs 3 blocks of 16
    out = drain(eng, {0: [(rid, ids, greedy()) for rid, ids in prompts.items()]})
    assert eng.stats().num_preemptions > 0
    for rid, ids in prompts.items():
        assert out[(rid, 0)] == hf.greedy(ids, STEPS)[0], rid
    assert spec(eng)["accepted"] > 0


def test_a_draft_equal_to_the_target_accepts_every_draft(tiny_models):
    """p == q at greedy: every draft is the target's own argmax. max_tokens leaves room for k
    drafts at every step, so each verification accepts exactly k (mean accepted length k + 1)."""
    model_dir = tiny_models["qwen3"]
    eng = engine(model_dir, model_dir)
    steps = 1 + 5 * (K + 1)                 # the prefill's token, then 5 steps of k + 1
    ids = {f"r{i}": repetitive(25, 4 + i, i) for i in range(3)}
    out = drain(eng, {0: [(rid, p, greedy(max_tokens=steps)) for rid, p in ids.items()]})
    stats = spec(eng)
    assert stats["verify_steps"] == 3 * 5
    assert stats["accepted"] == stats["proposed"] == 3 * 5 * K
    assert stats["mean_accepted_length"] == K + 1 and stats["acceptance_rate"] == 1.0
    assert stats["accepted_per_pos"] == [15] * K
    assert all(len(t) == steps for t in out.values())


def test_an_independent_draft_rolls_back_and_aborts_leak_nothing(tiny_models, drafts):
    """Acceptance ~0: nearly every draft's KV (both models') is rolled back; requests aborted
    between verifications, and samples of n > 1, leave no block behind; the survivors match
    transformers."""
    model_dir = tiny_models["llama"]
    hf = HFReference(model_dir)
    eng = engine(model_dir, drafts["llama"]["small"], block_size=4)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=STEPS, ignore_eos=True, n=2, seed=5)
    keep = {"a": prompt(17, 21), "b": prompt(9, 22)}
    arrivals = {0: [("a", keep["a"], greedy()), ("x", prompt(13, 23), sampled), ("y", prompt(11, 24), greedy(n=2))],
                2: [("b", keep["b"], greedy()), ("z", prompt(21, 25), sampled)]}
    out = drain(eng, arrivals, abort_at={4: ["x", "y"], 7: ["z"]})
    for rid, ids in keep.items():
        assert out[(rid, 0)] == hf.greedy(ids, STEPS)[0], rid
    stats = spec(eng)
    assert stats["verify_steps"] > 10 and stats["proposed"] > 30


def test_seeded_sampling_repeats_and_reports_logprobs(tiny_models, drafts):
    model_dir = tiny_models["llama"]
    params = SamplingParams(temperature=0.8, top_k=40, presence_penalty=0.3, max_tokens=STEPS, ignore_eos=True,
                            seed=11, logprobs=2)
    runs = []
    for _ in range(2):
        eng = engine(model_dir, drafts["llama"]["near"])
        eng.add_request("s", prompt(20, 30), params)
        deltas = []
        for _ in range(MAX_STEPS):
            if not eng.has_unfinished_requests():
                break
            deltas += eng.step()
        assert_clean(eng)
        tokens = [t for d in deltas for t in d.new_token_ids]
        logprobs = [lp for d in deltas for lp in d.new_logprobs]
        assert len(tokens) == len(logprobs) == STEPS
        assert all(lp.token_id == t and len(lp.top) == 2 for lp, t in zip(logprobs, tokens))
        assert spec(eng)["accepted"] > 0
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_a_draft_that_cannot_serve_the_target_is_refused_at_start(tiny_models, drafts, tmp_path):
    from gpu_worker.make_model import make_model
    model_dir = tiny_models["llama"]
    other_vocab = make_model(tmp_path / "vocab", arch="llama", size="tiny", vocab_size=2048, progress=False)
    with pytest.raises(ValueError, match="vocabulary of 2048 tokens but the target has 1024"):
        engine(model_dir, str(other_vocab))
    other_tok = tmp_path / "tok"
    shutil.copytree(drafts["llama"]["near"], other_tok)
    tok = json.loads((other_tok / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        engine(model_dir, str(other_tok))
    with pytest.raises(ValueError, match="is not a loadable model directory"):
        engine(model_dir, str(tmp_path / "missing"))
