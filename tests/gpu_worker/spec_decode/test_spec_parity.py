"""Speculative decoding on tiny random models of every architecture: greedy tokens identical to
transformers (and so to decoding without speculation) through a staggered batch with chunked
prefill, prefix hits, preemption and n > 1, with drafts really accepted (repetitive prompts;
greedy decoding of random weights falls into cycles that n-gram drafts predict)."""
from __future__ import annotations

import pytest

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.devices import CPU_AND_CUDA
from tests.gpu_worker.engine.conftest import HFReference, arch_model, tiny_models  # noqa: F401  (fixtures)
from tests.gpu_worker.engine.engine_fakes import assert_clean, collect
from tests.gpu_worker.spec_decode.spec_fakes import MAX_STEPS, ngram, prompt, repetitive

STEPS = 32


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, n=n)


def drain(eng: Engine, arrivals: dict[int, list]) -> dict:
    out: dict = {}
    arrivals = dict(arrivals)
    for step in range(MAX_STEPS):
        for rid, ids, params in arrivals.pop(step, []):
            eng.add_request(rid, ids, params)
        if not (eng.has_unfinished_requests() or arrivals):
            break
        collect(eng.step(), out)
        eng.block_manager.check_integrity()
    assert_clean(eng)
    return {k: v["tokens"] for k, v in out.items()}


# CPU: torch attention. CUDA (marked gpu): fp32 through the Triton kernels as served, every
# decode step replaying CUDA graphs, verification steps as decode rows included where no prefill
# chunk shares the step (test_spec_decode_rows.py counts the replays).
TARGETS = {"cpu": dict(device="cpu"),
           "cuda": dict(device="cuda", dtype="float32", attention_backend="triton", cuda_graph_max_bs=16)}
_target = TARGETS["cpu"]


@pytest.fixture(autouse=True, params=CPU_AND_CUDA)
def target(request, monkeypatch):
    """Where spec_engine() builds its engines for this test."""
    monkeypatch.setattr(f"{__name__}._target", TARGETS[request.param])


def spec_engine(model_dir: str, **kw) -> Engine:
    kw.setdefault("num_gpu_blocks", 128)
    return Engine(EngineConfig(model=model_dir, speculative_config=ngram(k=4, lo=1, hi=3), **_target, **kw))


def test_batch_chunks_prefix_hits_and_forks_match_transformers(arch_model):
    model_dir, hf = arch_model
    shared = repetitive(36, 6, 1)
    prompts = {"a": repetitive(30, 5, 2), "b": shared + [11], "c": prompt(40, 3), "d": shared + [12]}
    eng = spec_engine(model_dir, max_num_batched_tokens=16, block_size=8)
    arrivals = {0: [("a", prompts["a"], greedy()), ("b", prompts["b"], greedy())],
                3: [("c", prompts["c"], greedy(n=2))], 40: [("d", prompts["d"], greedy())]}
    out = drain(eng, arrivals)
    for rid, ids in prompts.items():
        assert out[(rid, 0)] == hf.greedy(ids, STEPS)[0], rid
    assert out[("c", 1)] == out[("c", 0)]                 # greedy samples agree
    assert eng.block_manager.prefix_hit_tokens >= 32       # d reused b's prompt blocks
    spec = eng.stats().extra["spec_decode"]
    assert spec["accepted"] > 0 and spec["decode_row_steps"] > 0    # verification as decode rows


def test_preemption_matches_transformers(arch_model):
    model_dir, hf = arch_model
    prompts = {f"r{i}": repetitive(20, 3 + i, 10 + i) for i in range(4)}
    eng = spec_engine(model_dir, num_gpu_blocks=9)        # each request needs 4 blocks of 16
    out = drain(eng, {0: [(rid, ids, greedy()) for rid, ids in prompts.items()]})
    assert eng.stats().num_preemptions > 0
    for rid, ids in prompts.items():
        assert out[(rid, 0)] == hf.greedy(ids, STEPS)[0], rid
    spec = eng.stats().extra["spec_decode"]
    assert spec["accepted"] > 0 and spec["decode_row_steps"] > 0
