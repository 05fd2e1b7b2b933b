"""A grammar still compiling holds only its own request's first draw: the other sequences keep
stepping, its prompt is prefilled meanwhile, and its tokens are those it draws without the delay.
The compile is slowed through the pool's seam (GrammarCompilerPool.compile) with an event, so the
steps are counted, not timed."""
from __future__ import annotations

import json
import threading
import time

import pytest

from gpu_worker.engine import Engine
from gpu_worker.sequence import SequenceStatus
from services.protocol.sampling import SamplingParams, StructuredOutput
from tests.gpu_worker.structured.schema_corpus import SCHEMAS
from tests.gpu_worker.structured.test_structured_engine import (  # noqa: F401 (plain_reference: a fixture)
    MAX_TOKENS, PROMPTS, add_plain, assert_blocks_back, make_engine, plain_reference, run)

HELD_STEPS = 6
LONG_PROMPT = [(7 * i) % 500 + 3 for i in range(40)]     # chunked under a 16-token step budget
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 2, "disable_by_batch_size": 64})


def constrained(schema_index: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                          structured=StructuredOutput(json_schema=json.dumps(SCHEMAS[schema_index])))


def gate_compiles(engine: Engine) -> threading.Event:
    """Compiles wait for the returned event (set it to let them finish)."""
    gate, compile_now = threading.Event(), engine.grammars.compile

    def slow_compile(spec):
        gate.wait(timeout=60)
        return compile_now(spec)
    engine.grammars.compile = slow_compile
    return gate


def step_counting(engine: Engine, steps: int, out: dict) -> list[set[str]]:
    """`steps` steps; the request ids that got a token in each."""
    drew = []
    for _ in range(steps):
        deltas = engine.step()
        for d in deltas:
            out.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
        drew.append({d.request_id for d in deltas if d.new_token_ids})
    return drew


@pytest.mark.parametrize("extra", [{}, {"async_scheduling": True},
                                   {"max_num_batched_tokens": 16, "speculative_config": SPEC}],
                         ids=["sync", "async_scheduling", "chunked+speculative"])
def test_a_slow_compile_holds_only_its_own_draw(tiny_llama, extra):
    outs = []
    for slow in (False, True):
        engine = make_engine(tiny_llama, **extra)
        gate = gate_compiles(engine) if slow else None
        engine.add_request("json", LONG_PROMPT, constrained(26))
        add_plain(engine)
        early: dict = {}
        try:
            if not slow:         # the reference: compiled before the first step, so nothing is held
                engine.requests["json"].grammar.future.result(timeout=60)
            else:
                drew = step_counting(engine, HELD_STEPS, early)
                # every plain request drew in every step once its prompt was in; the held one never
                assert all("json" not in ids for ids in drew)
                assert all({"plain0", "plain1", "plain2"} <= ids for ids in drew[-3:])
                seq = engine.requests["json"].seqs[0]
                assert seq.status is SequenceStatus.RUNNING
                assert seq.num_computed_tokens == len(LONG_PROMPT) - 1     # prefilled but its last token
        finally:
            if gate is not None:
                gate.set()
        out = run(engine)
        for key, tokens in early.items():
            out[key] = (tokens + out.get(key, ([], ""))[0], out.get(key, ([], "finished early"))[1])
        outs.append(out)
        assert engine.take_failed() == []
        assert_blocks_back(engine)
        engine.close()
    assert outs[0] == outs[1]          # greedy: the held request and its neighbours draw the same tokens


def test_a_held_compile_past_its_time_limit_ends_only_its_request(tiny_llama, plain_reference):
    engine = make_engine(tiny_llama)
    gate = gate_compiles(engine)
    try:
        engine.add_request("json", PROMPTS[0], constrained(3))
        add_plain(engine)
        out: dict = {}
        step_counting(engine, 3, out)
        engine.requests["json"].grammar.deadline = time.monotonic()    # its time limit passes now
        step_counting(engine, 1, out)
        assert engine.take_failed() == [("json", "invalid json_schema: the constraint did not compile within "
                                                 "the time limit; simplify it", False)]
        assert "json" not in engine.requests
        rest = run(engine)
    finally:
        gate.set()
    for i in range(len(PROMPTS)):
        key = (f"plain{i}", 0)
        assert (out[key] + rest[key][0], rest[key][1]) == plain_reference[key]
    assert_blocks_back(engine)
    engine.close()


def test_abort_while_the_grammar_compiles_frees_everything(tiny_llama):
    """Three held requests on a two-thread pool: the third compile is still queued, and aborting
    cancels it; every block comes back."""
    engine = make_engine(tiny_llama)
    gate = gate_compiles(engine)
    try:
        for i in range(3):
            engine.add_request(f"json{i}", LONG_PROMPT, constrained(i))
        queued = engine.requests["json2"].grammar.future
        step_counting(engine, 2, {})
        for i in range(3):
            engine.abort_request(f"json{i}")
        assert queued.cancelled()
        assert not engine.has_unfinished_requests() and not engine._compiling
    finally:
        gate.set()
    assert engine.step() == []
    assert_blocks_back(engine)
    engine.close()


def test_a_prefill_for_another_engine_draws_its_first_token_once_compiled(tiny_llama):
    """P/D: the prefill engine draws the first token under the grammar, held until it compiles."""
    engine = make_engine(tiny_llama)
    gate = gate_compiles(engine)
    try:
        engine.add_request("json", LONG_PROMPT, constrained(33), export_kv=True)
        add_plain(engine)
        assert all("json" not in ids for ids in step_counting(engine, HELD_STEPS, {}))
        assert engine.prefilled_blocks("json")          # its computed blocks stream out meanwhile
    finally:
        gate.set()
    first = run(engine)[("json", 0)]
    assert len(first[0]) == 1 and first[1] == "kv_handoff"
    assert engine.release_export("json")
    assert_blocks_back(engine)
    engine.close()


def test_a_constraint_compiled_before_draws_in_its_prefill_step(tiny_llama):
    """A schema compiled here before is a cache lookup: its request is not held, so its first token
    comes in the step that prefills its prompt, as an unconstrained request's does (a new schema's
    comes one step later, after its compile)."""
    engine = make_engine(tiny_llama)
    engine.add_request("first", PROMPTS[0], constrained(5))
    assert not engine.requests["first"].grammar.expect_cached and engine.requests["first"].draw_waits
    run(engine)
    engine.add_request("again", PROMPTS[1], constrained(5))
    assert engine.requests["again"].grammar.expect_cached and not engine.requests["again"].draw_waits
    assert "again" in step_counting(engine, 1, {})[0]
    run(engine)
    assert engine.take_failed() == []
    assert_blocks_back(engine)
    engine.close()
