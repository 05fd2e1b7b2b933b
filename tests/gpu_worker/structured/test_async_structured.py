"""Async scheduling with constrained and penalised draws (engine.py, _launch_split): step N+1's
forward is launched before step N is read back, its draw after the matchers accepted N and the
penalties read it. Tokens equal the synchronous engine's, greedy and seeded-sampled, for a batch
mixing json_schema, regex and choice constraints, penalties and plain requests, with chunked
prefill, a grammar that compiles slowly and one that fails; and that batch runs one step ahead."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine, _needs_output
from services.protocol.sampling import SamplingParams, StructuredOutput
from tests.gpu_worker.structured.schema_corpus import SCHEMAS
from tests.gpu_worker.structured.test_grammar_wait import LONG_PROMPT, gate_compiles
from tests.gpu_worker.structured.test_structured_engine import (MAX_TOKENS, PROMPTS, assert_blocks_back,
                                                                make_engine, parse_json, run)

HELD_STEPS = 6
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                   "disable_by_batch_size": 8})
SCHEMA_IDS = (0, 26, 36, 48)
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "a.b*(c)"]
PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3)


def add_mixed(engine: Engine) -> None:
    """Constrained (greedy and sampled), penalised, plain, and a failing grammar; the slow one
    (`held`, on a prompt that chunks) is added by the caller."""
    for k, i in enumerate(SCHEMA_IDS):
        spec = StructuredOutput(json_schema=json.dumps(SCHEMAS[i]))
        engine.add_request(f"json{i}-t0", PROMPTS[k % 3], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                        structured=spec))
        engine.add_request(f"json{i}-t1", PROMPTS[k % 3], SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
                                                                        structured=spec))
    engine.add_request("regex", PROMPTS[1], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=MAX_TOKENS,
                                                           structured=StructuredOutput(regex=REGEX)))
    engine.add_request("choice", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                            structured=StructuredOutput(choice=CHOICES)))
    engine.add_request("bad", PROMPTS[0], SamplingParams(max_tokens=8,
                                                         structured=StructuredOutput(grammar="root ::= (")))
    engine.add_request("pen-t0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, **PENALTIES))
    engine.add_request("pen-t1", PROMPTS[1], SamplingParams(temperature=1.0, seed=5, max_tokens=30, **PENALTIES))
    engine.add_request("pen-json", PROMPTS[2], SamplingParams(
        temperature=1.0, seed=6, max_tokens=MAX_TOKENS, presence_penalty=0.5,
        structured=StructuredOutput(json_schema=json.dumps(SCHEMAS[33]))))
    for k, prompt in enumerate(PROMPTS):
        engine.add_request(f"plain{k}", prompt, SamplingParams(temperature=0.0, max_tokens=24))
        engine.add_request(f"plain{k}-t1", prompt, SamplingParams(temperature=1.0, seed=k, max_tokens=24))


def run_counting(engine: Engine, gate) -> tuple[dict, int, int]:
    """Step until idle, the slow compile released after HELD_STEPS steps: (outputs, steps that had
    a constrained or penalised draw in flight and launched the next, how many of them ran ahead)."""
    tokens: dict = {}
    reasons: dict = {}
    eligible = ahead = 0
    for step in range(20_000):
        if not engine.has_unfinished_requests():
            break
        if step == HELD_STEPS:
            gate.set()
        inflight = engine._inflight
        host_bound = inflight is not None and any(
            seq.request.grammar is not None or _needs_output(seq.request.params)
            for _, seq in inflight.targets)
        before = engine.steps_ahead
        for d in engine.step():
            tokens.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
            if d.finish_reason:
                reasons[(d.request_id, d.index)] = d.finish_reason
        if host_bound and engine._inflight is not None:
            eligible += 1
            ahead += engine.steps_ahead - before
    assert not engine.has_unfinished_requests()
    return {k: (v, reasons.get(k, "")) for k, v in tokens.items()}, eligible, ahead


@pytest.mark.parametrize("speculative", [False, True], ids=["chunked", "chunked+speculative"])
def test_async_constrained_and_penalised_draws_give_the_synchronous_tokens(tiny_llama, tokenizer, speculative):
    """With n-gram speculation (off above 8 running sequences), steps that may draft settle first and
    verify synchronously, the others launch ahead, split or not, as the batch shrinks."""
    outs = []
    for async_scheduling in (False, True):
        extra = {"speculative_config": SPEC} if speculative and async_scheduling else {}
        engine = make_engine(tiny_llama, max_num_batched_tokens=16, async_scheduling=async_scheduling, **extra)
        gate = gate_compiles(engine)
        try:
            engine.add_request("held", LONG_PROMPT, SamplingParams(
                temperature=1.0, seed=9, max_tokens=MAX_TOKENS,
                structured=StructuredOutput(json_schema=json.dumps(SCHEMAS[12]))))
            add_mixed(engine)
            out, eligible, ahead = run_counting(engine, gate)
        finally:
            gate.set()
        assert [f.request_id for f in engine.take_failed()] == ["bad"]
        if speculative and async_scheduling:
            assert ahead >= 20 and engine.stats().extra["spec_decode"]["verify_steps"] > 0
        elif async_scheduling:    # every such step launched its forward before reading the last
            assert eligible >= 20 and ahead == eligible, (eligible, ahead)
        else:
            assert engine.steps_ahead == 0
        assert_blocks_back(engine)
        engine.close()
        outs.append(out)
    assert outs[0] == outs[1]
    out = outs[1]
    for key, schema in [((f"json{i}-{t}", 0), SCHEMAS[i]) for i in SCHEMA_IDS for t in ("t0", "t1")] + [
            (("pen-json", 0), SCHEMAS[33]), (("held", 0), SCHEMAS[12])]:
        tokens, reason = out[key]
        assert reason == "stop", key
        jsonschema.validate(parse_json(tokenizer.decode(tokens, skip_special_tokens=True)), schema)
    for index in (0, 1):
        tokens, reason = out[("regex", index)]
        assert reason == "stop" and re.fullmatch(REGEX, tokenizer.decode(tokens, skip_special_tokens=True))
    assert out[("choice", 0)][1] == "stop" and tokenizer.decode(out[("choice", 0)][0],
                                                                skip_special_tokens=True) in CHOICES
    assert ("bad", 0) not in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_constrained_batch_on_cuda_gives_the_synchronous_tokens(tiny_llama, tokenizer):
    """As served on a GPU (Triton kernels, CUDA graphs, chunked prefill): the split launch's mask
    goes to the device from the reused pinned buffer behind the forward, the draw reads the
    graph's logits; the tokens are the synchronous engine's and every output validates."""
    outs = []
    for async_scheduling in (False, True):
        engine = Engine(EngineConfig(model=tiny_llama, device="cuda", dtype="float32", attention_backend="triton",
                                     max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=48,
                                     cuda_graph_max_bs=32, async_scheduling=async_scheduling))
        add_mixed(engine)
        out = run(engine)
        assert [f.request_id for f in engine.take_failed()] == ["bad"]
        assert (engine.steps_ahead >= 20) == async_scheduling
        assert engine.block_manager.num_used_blocks == 0
        engine.block_manager.check_integrity()
        engine.close()
        outs.append(out)
    assert outs[0] == outs[1]
    for i in SCHEMA_IDS:
        tokens, reason = outs[1][(f"json{i}-t1", 0)]
        assert reason == "stop"
        jsonschema.validate(parse_json(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMAS[i])
