"""mtp speculation (gpu_worker/spec_decode/mtp.py) on tiny models with an MTP layer
(mtp_models.py): greedy tokens identical to decoding without speculation through batching,
chunked prefill, prefix hits, n > 1 and preemption; every first draft equal to a recompute
from scratch (so the MTP's own KV and pending rows stay right through all of those); an oracle
MTP layer accepts every draft (counted under method="mtp"); aborts between verifications leak no block; exact block
accounting after every step; a model without MTP layers is refused at start; LLM(...) and
`kvmesh generate` take the method."""
from __future__ import annotations

import json

import pytest

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.mtp_oracle import write_mtp_oracle
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.devices import CPU_AND_CUDA
from tests.gpu_worker.engine.conftest import _one_torch_thread, tiny_models  # noqa: F401  (fixtures)
from tests.gpu_worker.engine.engine_fakes import assert_clean
from tests.gpu_worker.spec_decode.mtp_models import Recompute, mtp_spec, random_mtp, spy_first_drafts
from tests.gpu_worker.spec_decode.spec_fakes import prompt, repetitive
from tests.gpu_worker.spec_decode.test_draft_model import STEPS, drain, greedy

K = 3


@pytest.fixture(scope="session")
def mtp_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mtp")
    random = random_mtp("llama", root / "random")
    return {"random": random, "oracle": write_mtp_oracle(random, root / "oracle", branch=0.0),
            "partial": write_mtp_oracle(random, root / "partial", branch=0.05)}


# CPU: torch attention. CUDA (marked gpu): fp32 through the Triton kernels.
TARGETS = {"cpu": dict(device="cpu"),
           "cuda": dict(device="cuda", dtype="float32", attention_backend="triton")}
_target = TARGETS["cpu"]


@pytest.fixture(autouse=True, params=CPU_AND_CUDA)
def target(request, monkeypatch):
    monkeypatch.setattr(f"{__name__}._target", TARGETS[request.param])


def engine(model_dir: str, k: int | None = K, **kw) -> Engine:
    """k None: the same engine without speculation. No back-off: the random layer's drafts are
    mostly rejected, and every step that may draft should verify (its KV checked each time)."""
    kw.setdefault("num_gpu_blocks", 128)
    spec = mtp_spec(k, backoff_max_steps=0) if k else None
    return Engine(EngineConfig(model=model_dir, speculative_config=spec, **_target, **kw))


def spec(eng: Engine) -> dict:
    return eng.stats().extra["spec_decode"]


def test_mtp_kv_through_chunks_prefix_hits_and_preemption_equals_a_recompute(mtp_models):
    """The random MTP layer reads h_i, t_{i+1} and its KV: a first draft equal to the recompute
    at every speculative step means all three were right, whatever path the tokens took."""
    model_dir = mtp_models["random"]
    shared = prompt(36, 1)
    prompts = {"a": prompt(30, 2), "b": shared + [11, 12], "c": prompt(40, 3), "d": shared + [11, 13]}
    arrivals = {0: [("a", prompts["a"], greedy()), ("b", prompts["b"], greedy())],
                3: [("c", prompts["c"], greedy())], 20: [("d", prompts["d"], greedy())]}
    kw = dict(max_num_batched_tokens=16, block_size=8, num_gpu_blocks=16)   # 4 x 7 blocks: preempts
    plain = drain(engine(model_dir, None, **kw), arrivals)
    eng = engine(model_dir, **kw)
    seen = spy_first_drafts(eng)
    assert drain(eng, arrivals) == plain
    assert eng.block_manager.prefix_hit_tokens >= 32 and eng.stats().num_preemptions > 0
    assert spec(eng)["verify_steps"] > 20
    ref = Recompute(model_dir)
    # d's prefix hit ends at b's position 31, whose MTP slot b wrote with t_32 = shared[32]: d's too
    assert [draft for _, draft in seen] == [ref.first_draft(tokens) for tokens, _ in seen]


def test_batch_chunks_prefix_hits_forks_and_preemption_match_no_speculation(mtp_models):
    model_dir = mtp_models["partial"]
    shared = prompt(36, 1)
    prompts = {"a": prompt(30, 2), "b": shared + [11], "c": prompt(40, 3), "d": shared + [12]}
    arrivals = {0: [("a", prompts["a"], greedy(max_tokens=24)), ("b", prompts["b"], greedy(max_tokens=24))],
                3: [("c", prompts["c"], greedy(n=2, max_tokens=24))], 20: [("d", prompts["d"], greedy())]}
    kw = dict(max_num_batched_tokens=16, block_size=8, num_gpu_blocks=16)
    plain = drain(engine(model_dir, None, **kw), arrivals)
    eng = engine(model_dir, **kw)
    out = drain(eng, arrivals)
    assert out == plain and len(out) == 5
    assert out[("c", 1)] == out[("c", 0)]                 # greedy samples agree
    assert eng.block_manager.prefix_hit_tokens >= 32 and eng.stats().num_preemptions > 0
    stats = spec(eng)
    assert 0 < stats["accepted"] < stats["proposed"]       # both accepted and rejected drafts
    assert stats["decode_row_steps"] > 0 and stats["extend_steps"] > 0   # both verification forms


def test_an_oracle_mtp_layer_accepts_every_draft(mtp_models):
    """The target a bigram model, the MTP layer its bigram: each step proposes k drafts (room
    left by max_tokens) and accepts them all."""
    eng = engine(mtp_models["oracle"])
    steps = 1 + 5 * (K + 1)          # the prefill's token (its last row is pending), then 5 x (k + 1)
    ids = {f"r{i}": repetitive(25, 4 + i, i) for i in range(3)}
    out = drain(eng, {0: [(rid, p, greedy(max_tokens=steps)) for rid, p in ids.items()]})
    stats = spec(eng)
    assert stats["verify_steps"] == 3 * 5
    assert stats["accepted"] == stats["proposed"] == 3 * 5 * K and stats["accepted_per_pos"] == [15] * K
    assert all(len(t) == steps for t in out.values())
    # the worker's counters carry method="mtp" (gpu_worker/service/main.py publishes these stats)
    from prometheus_client import REGISTRY

    from services.metrics import SpecDecodePublisher
    name, labels = "kvmesh_spec_decode_num_accepted_tokens_total", {"method": "mtp"}
    before = REGISTRY.get_sample_value(name, labels) or 0.0
    SpecDecodePublisher().publish(stats)
    assert REGISTRY.get_sample_value(name, labels) - before == 3 * 5 * K


def test_aborts_between_verifications_leak_nothing(mtp_models):
    """Sampled and greedy requests, n > 1, aborted while they verify: no block left behind and
    no pending row kept for them; the survivors match decoding without speculation."""
    model_dir = mtp_models["partial"]
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=STEPS, ignore_eos=True, n=2, seed=5)
    keep = {"a": prompt(17, 21), "b": prompt(9, 22)}
    arrivals = {0: [("a", keep["a"], greedy()), ("x", prompt(13, 23), sampled), ("y", prompt(11, 24), greedy(n=2))],
                2: [("b", keep["b"], greedy()), ("z", prompt(21, 25), sampled)]}
    plain = drain(engine(model_dir, None, block_size=4), {0: arrivals[0][:1], 2: arrivals[2][:1]})
    eng = engine(model_dir, block_size=4)
    out = drain(eng, arrivals, abort_at={4: ["x", "y"], 7: ["z"]})
    for rid in keep:
        assert out[(rid, 0)] == plain[(rid, 0)], rid
    assert spec(eng)["verify_steps"] > 10
    assert not eng.speculator.proposer.pending


def test_a_model_without_mtp_layers_is_refused_at_start(tiny_models):
    with pytest.raises(ValueError, match="method mtp needs a model with multi-token-prediction layers"):
        engine(tiny_models["llama"])


def test_llm_and_kvmesh_generate_take_mtp(mtp_models, capsys):
    from gpu_worker import LLM
    from gpu_worker.cli_generate import main as generate_main
    model_dir = mtp_models["partial"]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    outs = []
    for k in (None, K):
        llm = LLM(model=model_dir, num_gpu_blocks=64, speculative_config=mtp_spec(k) if k else None, **_target)
        got = llm.generate(["one two three one two", "a b c d e f g h"], params, use_tqdm=False)
        outs.append([(c.token_ids, c.text, round(c.cumulative_logprob, 3)) for o in got for c in o.outputs])
        assert_clean(llm.llm_engine)
    assert outs[0] == outs[1] and spec(llm.llm_engine)["accepted"] > 0
    assert generate_main(["--model", model_dir, "--device", _target["device"], "--num-gpu-blocks", "64",
                          "--max-tokens", "20", "--temperature", "0", "--ignore-eos", "--json",
                          "--prompt", "one two three one two", "--speculative-config", mtp_spec(K)]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"] == outs[0][0][0]
