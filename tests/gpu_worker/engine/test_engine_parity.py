"""Engine output == Hugging Face transformers (fp32, CPU) on tiny random models of every
architecture, through every scheduling path: single, staggered batch, chunked prefill, prefix
hit, preemption, n > 1. Greedy tokens must be identical for STEPS steps, and the logprob of each
chosen token (raw log-softmax) within LOGPROB_ATOL of HF's.

Each test runs on the CPU (torch attention) and, where CUDA is, again on the GPU as it serves:
fp32, Triton kernels, decode and prefill CUDA graphs (TARGETS; the GPU runs are marked gpu)."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.devices import CPU_AND_CUDA

STEPS = 32
LOGPROB_ATOL = 1e-4   # fp32: observed differences are ~1e-6


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n=1, logprobs=0, steps=STEPS):
    return SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, n=n, logprobs=logprobs)


TARGETS = {"cpu": dict(device="cpu"),
           "cuda": dict(device="cuda", dtype="float32", attention_backend="triton", cuda_graph_max_bs=16)}
_target = TARGETS["cpu"]


@pytest.fixture(autouse=True, params=CPU_AND_CUDA)
def target(request, monkeypatch):
    """Where engine() builds its engines for this test."""
    monkeypatch.setattr(f"{__name__}._target", TARGETS[request.param])


def engine(model_dir: str, **kw) -> Engine:
    kw.setdefault("num_gpu_blocks", 128)
    eng = Engine(EngineConfig(model=model_dir, **_target, **kw))
    eng.batch_sizes = []                    # tokens per forward, to check which path ran
    forward = eng.runner.forward

    def recording_forward(batch):
        eng.batch_sizes.append(batch.num_tokens)
        return forward(batch)
    eng.runner.forward = recording_forward
    return eng


def drain(eng: Engine, out: dict | None = None, arrivals: dict | None = None) -> dict:
    """Step to the end; arrivals = {step: [(rid, prompt, params)]} are added at that step."""
    out = {} if out is None else out
    arrivals = dict(arrivals or {})
    step = 0
    while eng.has_unfinished_requests() or arrivals:
        for rid, ids, params in arrivals.pop(step, []):
            eng.add_request(rid, ids, params)
        for d in eng.step():
            rec = out.setdefault((d.request_id, d.index), {"tokens": [], "logprobs": [], "cached": 0})
            rec["tokens"] += d.new_token_ids
            rec["logprobs"] += d.new_logprobs or []
            rec["cached"] = d.num_cached_tokens
        step += 1
    eng.block_manager.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    return out


def check(hf, ids: list[int], rec: dict) -> None:
    tokens, ref_lp = hf.greedy(ids, STEPS)
    assert rec["tokens"] == tokens
    if rec["logprobs"]:
        got = torch.tensor([lp.logprob for lp in rec["logprobs"]])
        want = ref_lp[torch.arange(STEPS), torch.tensor(tokens)]
        assert torch.allclose(got, want, atol=LOGPROB_ATOL), (got - want).abs().max()


def test_single_request_tokens_and_logits(arch_model):
    model_dir, hf = arch_model
    ids = prompt(21, 0)
    eng = engine(model_dir)
    eng.add_request("a", ids, greedy(logprobs=5))
    rec = drain(eng)[("a", 0)]
    check(hf, ids, rec)
    first = rec["logprobs"][0].top                      # the first step's top-5 logits vs HF
    ref = torch.topk(hf.greedy(ids, STEPS)[1][0], 5)
    assert [t for t, _ in first] == ref.indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in first]), ref.values, atol=LOGPROB_ATOL)


def test_staggered_batch_of_mixed_lengths(arch_model):
    model_dir, hf = arch_model
    prompts = {"a": prompt(3, 1), "b": prompt(17, 2), "c": prompt(40, 3), "d": prompt(9, 4)}
    eng = engine(model_dir, max_num_batched_tokens=32)
    arrivals = {0: [("a", prompts["a"], greedy(logprobs=0)), ("b", prompts["b"], greedy())],
                2: [("c", prompts["c"], greedy(logprobs=0))], 5: [("d", prompts["d"], greedy())]}
    out = drain(eng, arrivals=arrivals)
    for rid, ids in prompts.items():
        check(hf, ids, out[(rid, 0)])


def test_prompt_much_longer_than_the_chunk(arch_model):
    model_dir, hf = arch_model
    ids = prompt(150, 5)
    eng = engine(model_dir, max_num_batched_tokens=16)
    eng.add_request("long", ids, greedy(logprobs=0))
    check(hf, ids, drain(eng)[("long", 0)])
    assert eng.batch_sizes[:10] == [16] * 9 + [6]       # 150 tokens in 10 chunks


def test_second_request_hits_the_prefix_cache(arch_model):
    model_dir, hf = arch_model
    shared = prompt(40, 6)
    first, second = shared + prompt(5, 7), shared + prompt(7, 8)
    eng = engine(model_dir)
    eng.add_request("first", first, greedy())
    out = drain(eng)
    eng.add_request("second", second, greedy(logprobs=0))
    drain(eng, out)
    assert out[("first", 0)]["cached"] == 0
    assert out[("second", 0)]["cached"] == 32            # two full 16-token blocks
    assert eng.batch_sizes[-STEPS] == len(second) - 32    # only the uncached tail was computed
    check(hf, first, out[("first", 0)])
    check(hf, second, out[("second", 0)])


def test_preemption_gives_identical_tokens(arch_model):
    model_dir, hf = arch_model
    prompts = {f"r{i}": prompt(20, 10 + i) for i in range(4)}
    eng = engine(model_dir, num_gpu_blocks=9)        # each request needs 4 blocks of 16
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, greedy(logprobs=0))
    out = drain(eng)
    assert eng.stats().num_preemptions > 0
    for rid, ids in prompts.items():
        check(hf, ids, out[(rid, 0)])


def test_n3_greedy_and_seeded_samples(arch_model):
    model_dir, hf = arch_model
    ids = prompt(13, 20)
    eng = engine(model_dir)
    eng.add_request("g", ids, greedy(n=3, logprobs=0))
    out = drain(eng)
    for i in range(3):
        check(hf, ids, out[("g", i)])

    seeded = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = drain_one(engine(model_dir), ids, seeded)
    assert alone == drain_one(engine(model_dir), ids, seeded)
    busy = engine(model_dir, num_gpu_blocks=10, max_num_batched_tokens=24)
    for i in range(4):
        busy.add_request(f"x{i}", prompt(30, 30 + i), SamplingParams(temperature=1.0, max_tokens=20,
                                                                     ignore_eos=True))
    busy.step()
    assert drain_one(busy, ids, seeded) == alone


def drain_one(eng: Engine, ids: list[int], params: SamplingParams) -> list[list[int]]:
    eng.add_request("s", ids, params)
    out = drain(eng)
    return [out[("s", i)]["tokens"] for i in range(params.n)]


def test_logit_bias_matches_transformers_sequence_bias(arch_model):
    """logit_bias == transformers' SequenceBiasLogitsProcessor with one-token sequences, greedy,
    beside an unbiased request in the same batches."""
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    model_dir, hf = arch_model
    ids = prompt(12, 7)
    plain = hf.greedy(ids, STEPS)[0]
    with torch.no_grad():
        first = hf.model(input_ids=torch.tensor([ids])).logits[0, -1].topk(3).indices.tolist()
    bias = {first[0]: -100.0, first[2]: 1.5, 17: 4.0, 999: -3.0}        # ban HF's pick, favour others
    proc = SequenceBiasLogitsProcessor(sequence_bias={(t,): b for t, b in bias.items()})
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(STEPS):
            input_ids = torch.tensor([ids + tokens])
            scores = proc(input_ids, hf.model(input_ids=input_ids).logits[:, -1].float())
            tokens.append(int(scores.argmax(-1)))
    assert tokens != plain and first[0] not in tokens       # the bias changed the path

    eng = engine(model_dir)
    eng.add_request("biased", ids, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True,
                                                  logit_bias=bias))
    eng.add_request("plain", ids, greedy())
    out = drain(eng)
    assert out[("biased", 0)]["tokens"] == tokens
    assert out[("plain", 0)]["tokens"] == plain
