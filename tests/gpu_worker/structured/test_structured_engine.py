"""Constrained decoding through the engine with a random-weight model: the grammar alone makes
every output valid, unconstrained neighbours in the batch are untouched, failures end only the
request that caused them."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams, StructuredOutput
from tests.gpu_worker.structured.schema_corpus import SCHEMAS

MAX_STEPS = 20_000       # a step with nothing but held draws waits up to 5 ms for a compile
MAX_TOKENS = 400          # far above any corpus schema's longest instance with these bounds
PROMPTS = [[5, 6, 7, 8, 9], [11, 300, 42], [700, 3, 3, 9, 12, 13]]


def run(engine: Engine) -> dict[tuple[str, int], tuple[list[int], str]]:
    """Step until idle (bounded): (request id, sample) -> (tokens, finish reason)."""
    tokens: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], str] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            tokens.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
            if d.finish_reason:
                reasons[(d.request_id, d.index)] = d.finish_reason
    assert not engine.has_unfinished_requests(), "the engine did not finish in MAX_STEPS steps"
    return {k: (v, reasons.get(k, "")) for k, v in tokens.items()}


def parse_json(text: str):
    """json.loads allowing raw control characters inside strings: xgrammar 0.2.9's rule for a
    string with minLength/maxLength excludes only '"', '\\', CR and LF (plain strings exclude
    every control character)."""
    return json.loads(text, strict=False)


def make_engine(model: str, **kwargs) -> Engine:
    return Engine(EngineConfig(model=model, device="cpu", max_num_seqs=128, **kwargs))


def add_plain(engine: Engine) -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"plain{i}", prompt, SamplingParams(temperature=0.0, max_tokens=24))


def assert_blocks_back(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks


@pytest.fixture(scope="module")
def plain_reference(tiny_llama) -> dict:
    engine = make_engine(tiny_llama)
    add_plain(engine)
    out = run(engine)
    engine.close()
    return out


def test_corpus_outputs_validate_at_temperature_0_and_1_batched_with_unconstrained(
        tiny_llama, tokenizer, plain_reference):
    assert len(SCHEMAS) >= 50
    engine = make_engine(tiny_llama)
    for i, schema in enumerate(SCHEMAS):
        spec = StructuredOutput(json_schema=json.dumps(schema))
        engine.add_request(f"s{i}-t0", PROMPTS[i % 3], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                     structured=spec))
        engine.add_request(f"s{i}-t1", PROMPTS[i % 3], SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
                                                                     structured=spec))
    add_plain(engine)
    out = run(engine)
    for i, schema in enumerate(SCHEMAS):
        for temp in ("t0", "t1"):
            tokens, reason = out[(f"s{i}-{temp}", 0)]
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            assert reason == "stop", f"schema {i} ({temp}) did not close within {MAX_TOKENS} tokens: {text!r}"
            jsonschema.validate(parse_json(text), schema)
    for i in range(len(PROMPTS)):
        assert out[(f"plain{i}", 0)] == plain_reference[(f"plain{i}", 0)]
    assert engine.take_failed() == []
    assert_blocks_back(engine)
    engine.close()


def test_regex_choice_and_grammar_outputs_match_with_several_samples(tiny_llama, tokenizer):
    engine = make_engine(tiny_llama)
    cases = {
        "regex": (StructuredOutput(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        "choice": (StructuredOutput(choice=["yes", "no", "a.b*(c)"]), lambda t: t in ("yes", "no", "a.b*(c)")),
        "grammar": (StructuredOutput(grammar='root ::= "x" ("y" | "z")+ "!"'), lambda t: re.fullmatch(r"x[yz]+!", t)),
        "json_object": (StructuredOutput(json_object=True), None),
    }
    for name, (spec, _) in cases.items():
        engine.add_request(name, PROMPTS[0], SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=MAX_TOKENS,
                                                            structured=spec))
    out = run(engine)
    for name, (_, matches) in cases.items():
        for index in range(3):
            tokens, reason = out[(name, index)]
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            if matches is None:       # any JSON object: a random model may write one longer than max_tokens
                assert reason in ("stop", "length")
                if reason == "stop":
                    assert isinstance(parse_json(text), dict)
                else:
                    assert text.startswith("{")
                continue
            assert reason == "stop" and matches(text), (name, index, text)
    assert_blocks_back(engine)
    engine.close()


@pytest.mark.parametrize("mode", ["async_scheduling", "speculative"])
def test_async_scheduling_and_speculation_give_the_synchronous_tokens(tiny_llama, mode):
    """Async scheduling launches a constrained batch's forward one step ahead and its draw once the
    matchers accepted the previous token; speculation verifies drafts under the mask: greedy
    tokens equal those of a plain synchronous engine."""
    extra = ({"async_scheduling": True} if mode == "async_scheduling" else
             {"speculative_config": json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 1, "prompt_lookup_max": 2})})
    outs = []
    for kwargs in ({}, extra):
        engine = make_engine(tiny_llama, **kwargs)
        for i in (0, 26, 36, 48):
            engine.add_request(f"s{i}", PROMPTS[i % 3], SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, structured=StructuredOutput(json_schema=json.dumps(SCHEMAS[i]))))
        add_plain(engine)
        outs.append(run(engine))
        if kwargs.get("async_scheduling"):     # the steps ran ahead, not after a settle
            assert engine.steps_ahead >= 20
        assert_blocks_back(engine)
        engine.close()
    assert outs[0] == outs[1]


def test_a_grammar_that_fails_to_compile_ends_only_its_request(tiny_llama, plain_reference):
    engine = make_engine(tiny_llama)
    engine.add_request("bad", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, n=2,
                                                         structured=StructuredOutput(grammar="root ::= (")))
    add_plain(engine)
    out = run(engine)
    failed = engine.take_failed()
    assert [f.request_id for f in failed] == ["bad"]
    assert failed[0][1].startswith("invalid grammar: it cannot be compiled")
    assert ".cc" not in failed[0][1]
    assert not any(rid == "bad" for rid, _ in out)
    for i in range(len(PROMPTS)):
        assert out[(f"plain{i}", 0)] == plain_reference[(f"plain{i}", 0)]
    assert_blocks_back(engine)
    engine.close()


def test_a_compile_past_the_time_limit_fails_the_request(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.grammars.time_limit_s = 0.01
    slow = {"enum": [f"v{i}" for i in range(7000)]}     # ~1 s to compile on a loaded 2-core host
    engine.add_request("slow", PROMPTS[0], SamplingParams(max_tokens=8, structured=StructuredOutput(
        json_schema=json.dumps(slow, separators=(",", ":")))))
    t = time.monotonic()
    run(engine)
    assert time.monotonic() - t < 5.0
    failed = engine.take_failed()
    assert failed == [("slow", "invalid json_schema: the constraint did not compile within the time limit; "
                               "simplify it", False)]   # not busy: a 400
    assert_blocks_back(engine)
    engine.close()


def test_speculative_drafts_are_verified_under_the_grammar(tiny_llama, tokenizer):
    """Constrained sequences speculate: each draft position is drawn under the mask after the
    drafts before it, so outputs stay valid at temperature 1 and drafts are accepted."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                       "disable_by_batch_size": 64})
    engine = make_engine(tiny_llama, speculative_config=spec)
    picked = range(0, len(SCHEMAS), 3)
    for i in picked:
        engine.add_request(f"s{i}", PROMPTS[i % 3], SamplingParams(
            temperature=1.0, seed=i, max_tokens=MAX_TOKENS, structured=StructuredOutput(json_schema=json.dumps(SCHEMAS[i]))))
    out = run(engine)
    for i in picked:
        tokens, reason = out[(f"s{i}", 0)]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert reason == "stop", (i, text)
        jsonschema.validate(parse_json(text), SCHEMAS[i])
    assert engine.speculator.stats.proposed > 0
    assert_blocks_back(engine)
    engine.close()


def test_offline_llm_generates_constrained_output_and_refuses_a_bad_grammar(tiny_llama):
    from gpu_worker.llm import LLM
    llm = LLM(model=tiny_llama, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured=StructuredOutput(json_schema=json.dumps(SCHEMAS[30])))
    [out] = llm.generate(["give me JSON"], params, use_tqdm=False)
    jsonschema.validate(parse_json(out.outputs[0].text), SCHEMAS[30])
    with pytest.raises(ValueError, match="invalid grammar: "):
        llm.generate(["x", "y"], SamplingParams(max_tokens=4, structured=StructuredOutput(grammar="root ::= (")),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_blocks_back(llm.llm_engine)


def test_a_constrained_prefill_kept_after_a_failed_hand_off_goes_on_under_its_grammar(tiny_llama):
    """export_kv draws the first token under the grammar; keep_export decodes the rest here,
    still masked: the tokens equal an engine's that never prepared a hand-off."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured=StructuredOutput(json_schema=json.dumps(SCHEMAS[33])))
    plain = make_engine(tiny_llama)
    plain.add_request("r", PROMPTS[0], params)
    expected = run(plain)[("r", 0)]
    plain.close()
    engine = make_engine(tiny_llama)
    engine.add_request("r", PROMPTS[0], params, export_kv=True)
    first = run(engine)[("r", 0)]
    assert engine.keep_export("r")
    rest = run(engine)[("r", 0)]
    assert (first[0] + rest[0], rest[1]) == expected
    assert_blocks_back(engine)
    engine.close()


def test_a_draft_model_speculates_for_constrained_requests(tiny_llama, tokenizer, tmp_path):
    """Under a draft model, a constrained sampled request is verified by the point-mass rule under
    the grammar (the draft's q knows no mask): greedy tokens equal a plain engine's with drafts
    accepted, and sampled outputs stay valid."""
    from tests.gpu_worker.spec_decode.draft_models import near_copy
    draft = near_copy(tiny_llama, tmp_path / "near", noise=0.05)
    spec = json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                       "disable_by_batch_size": 64})
    picked = range(1, len(SCHEMAS), 7)

    def add(engine: Engine, temperature: float) -> None:
        for i in picked:
            engine.add_request(f"s{i}", PROMPTS[i % 3], SamplingParams(
                temperature=temperature, seed=i, max_tokens=MAX_TOKENS,
                structured=StructuredOutput(json_schema=json.dumps(SCHEMAS[i]))))

    outs = []
    for kwargs in ({}, {"speculative_config": spec}):
        engine = make_engine(tiny_llama, **kwargs)
        add(engine, 0.0)
        outs.append(run(engine))
        assert_blocks_back(engine)
        if engine.speculator is not None:
            stats = engine.speculator.stats
            assert stats.proposed > 0 and stats.accepted > 0, stats
        engine.close()
    assert outs[0] == outs[1]
    engine = make_engine(tiny_llama, speculative_config=spec)
    add(engine, 1.0)
    out = run(engine)
    for i in picked:
        tokens, reason = out[(f"s{i}", 0)]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert reason == "stop", (i, text)
        jsonschema.validate(parse_json(text), SCHEMAS[i])
    assert engine.speculator.stats.proposed > 0
    assert_blocks_back(engine)
    engine.close()
