"""prompt_logprobs == transformers' log_softmax over the prompt (fp32, CPU, a tiny llama), through
one chunk, chunked prefill, a cached prefix and preemption; sampling is the same as without them."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.outputs import RequestError
from services.protocol.sampling import MAX_PROMPT_LOGPROBS_TOKENS, SamplingParams

ATOL = 1e-4
K = 5


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def params(prompt_logprobs: int | None = K, n: int = 1, steps: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, n=n, prompt_logprobs=prompt_logprobs)


@pytest.fixture(scope="module")
def llama(tiny_models):
    from transformers import AutoModelForCausalLM
    model_dir = tiny_models["llama"]
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def reference(hf, ids: list[int]) -> torch.Tensor:
    """(P, V): row p is the log-softmax of the logits at position p (predicting token p + 1)."""
    return torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def engine(model_dir: str, **kw) -> Engine:
    kw.setdefault("num_gpu_blocks", 64)
    return Engine(EngineConfig(model=model_dir, device="cpu", **kw))


def drain(eng: Engine) -> dict:
    out: dict = {}
    while eng.has_unfinished_requests():
        for d in eng.step():
            rec = out.setdefault((d.request_id, d.index), {"tokens": [], "prompt": [], "cached": 0})
            rec["tokens"] += d.new_token_ids
            rec["cached"] = d.num_cached_tokens
            if d.prompt_logprobs is not None:
                rec["prompt"].append(d.prompt_logprobs)
    eng.block_manager.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    return out


def check(hf, ids: list[int], entries: list, k: int = K) -> None:
    ref = reference(hf, ids)
    assert len(entries) == len(ids) and entries[0].logprob is None and entries[0].token_id == ids[0]
    for p in range(1, len(ids)):
        e, row = entries[p], ref[p - 1]
        assert e.token_id == ids[p]
        assert abs(e.logprob - float(row[ids[p]])) < ATOL, (p, e.logprob, float(row[ids[p]]))
        assert e.rank == int((row >= row[ids[p]]).sum())
        want = row.topk(k)
        assert [t for t, _ in e.top] == want.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in e.top]), want.values, atol=ATOL)


def test_one_chunk_matches_transformers_and_sampling_is_unchanged(llama):
    model_dir, hf = llama
    ids = prompt(37, 1)
    eng = engine(model_dir)
    eng.add_request("asks", ids, params())
    eng.add_request("plain", ids, params(None))      # in the same steps: its tokens are the same
    out = drain(eng)
    [entries] = out[("asks", 0)]["prompt"]
    check(hf, ids, entries)
    assert out[("plain", 0)]["prompt"] == [] and out[("asks", 0)]["tokens"] == out[("plain", 0)]["tokens"]


def test_chunked_prefill_and_k0(llama):
    model_dir, hf = llama
    ids = prompt(70, 2)
    eng = engine(model_dir, max_num_batched_tokens=16)
    eng.add_request("r", ids, params(0))
    [entries] = drain(eng)[("r", 0)]["prompt"]
    check(hf, ids, entries, k=0)


def test_a_cached_prefix_is_computed_again_for_the_positions_it_needs(llama):
    model_dir, hf = llama
    ids = prompt(50, 3)
    eng = engine(model_dir)
    eng.add_request("warm", ids, params(None))
    drain(eng)
    eng.add_request("asks", ids, params())
    out = drain(eng)
    assert out[("asks", 0)]["cached"] == 0           # no prefix hit: its rows were needed
    check(hf, ids, out[("asks", 0)]["prompt"][0])
    eng.add_request("after", ids, params(None))      # the cache still serves the others
    assert drain(eng)[("after", 0)]["cached"] == 48


def test_n_samples_carry_them_once(llama):
    model_dir, hf = llama
    ids = prompt(20, 4)
    eng = engine(model_dir)
    eng.add_request("n3", ids, params(n=3))
    out = drain(eng)
    assert [len(out[("n3", i)]["prompt"]) for i in range(3)] == [1, 0, 0]
    check(hf, ids, out[("n3", 0)]["prompt"][0])


def test_preempted_mid_prompt_still_exact(llama):
    model_dir, hf = llama
    prompts = {f"r{i}": prompt(40, 10 + i) for i in range(3)}
    eng = engine(model_dir, num_gpu_blocks=8, max_num_batched_tokens=16)   # 3 blocks a request
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params(steps=12))
    out = drain(eng)
    assert eng.stats().num_preemptions > 0
    for rid, ids in prompts.items():
        check(hf, ids, out[(rid, 0)]["prompt"][0])


def test_bounds_name_the_field(llama, monkeypatch):
    model_dir, _ = llama
    eng = engine(model_dir)
    with pytest.raises(RequestError, match="invalid prompt_logprobs"):
        eng.add_request("k", [5, 6], params(21))
    assert MAX_PROMPT_LOGPROBS_TOKENS == 8192
    monkeypatch.setattr("gpu_worker.engine.MAX_PROMPT_LOGPROBS_TOKENS", 30)   # the tiny model's context is 2048
    with pytest.raises(RequestError, match="invalid prompt_logprobs: prompts of at most 30"):
        eng.add_request("long", [5] * 31, params())
    assert not eng.has_unfinished_requests()


def test_a_resumed_request_makes_none(llama, monkeypatch):
    """Moved mid-stream (resume_output), it streamed them already: never refused for them either."""
    model_dir, _ = llama
    eng = engine(model_dir)
    monkeypatch.setattr("gpu_worker.engine.MAX_PROMPT_LOGPROBS_TOKENS", 10)
    eng.add_request("moved", prompt(20, 5), params(), resume_output=[[7, 8]])
    assert drain(eng)[("moved", 0)]["prompt"] == []


def test_a_prompt_beside_verifying_drafts(llama):
    """A draft model speculates (the target as its own draft): the prompt's chunk runs in steps that
    verify another request's drafts, through the proposer's forward hook."""
    from tests.gpu_worker.spec_decode.draft_models import draft_spec
    model_dir, hf = llama
    eng = engine(model_dir, speculative_config=draft_spec(model_dir, 3))
    first, second = prompt(12, 6), prompt(45, 7)
    eng.add_request("decoding", first, params(None, steps=24))
    out: dict = {}
    for _ in range(3):
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    eng.add_request("asks", second, params())
    rest = drain(eng)
    assert eng.stats().extra["spec_decode"]["extend_steps"] > 0      # a verification beside a prefill
    check(hf, second, rest[("asks", 0)]["prompt"][0])
    plain = engine(model_dir)
    plain.add_request("decoding", first, params(None, steps=24))
    assert out["decoding"] + rest[("decoding", 0)]["tokens"] == drain(plain)[("decoding", 0)]["tokens"]


def test_a_prefill_worker_sends_them_with_the_first_token(llama):
    """P/D: the prefill engine (export_kv) computes the prompt and streams them with its first
    token; the decode engine, which imports the KV, has none to make."""
    model_dir, hf = llama
    ids = prompt(30, 8)
    eng = engine(model_dir)
    eng.add_request("pd", ids, params(), export_kv=True)
    deltas = []
    while not deltas:
        deltas = eng.step()
    [d] = deltas
    assert d.finish_reason == "kv_handoff"
    check(hf, ids, d.prompt_logprobs)
    assert eng.release_export("pd")
    eng.block_manager.check_integrity()
    assert eng.block_manager.num_used_blocks == 0


def test_the_worker_publishes_whether_its_engine_makes_them(llama, monkeypatch):
    """The registry record's `prompt_logprobs` (the scheduler routes such requests by it) says what
    add_request would refuse: a tensor-parallel runner (no forward_keeping_hidden) makes none."""
    from gpu_worker.service.main import engine_info
    from services.config import WorkerConfig
    model_dir, _ = llama
    eng = engine(model_dir)
    cfg = WorkerConfig(model=model_dir, device="cpu")
    assert engine_info(cfg, eng)["prompt_logprobs"] is True
    monkeypatch.delattr(type(eng.runner), "forward_keeping_hidden")
    assert engine_info(cfg, eng)["prompt_logprobs"] is False
    with pytest.raises(RequestError, match=r"invalid prompt_logprobs: this worker \(tensor parallel\)"):
        eng.add_request("tp", [5, 6], params())
