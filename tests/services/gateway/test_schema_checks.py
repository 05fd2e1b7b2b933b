"""A constraint's JSON Schema: bounds checked inline, well-formedness (slow in jsonschema) checked
off the event loop, each a 400 naming the field that holds the schema."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import msgspec
import pytest

from services.gateway.schemas import ChatRequest
from services.gateway.structured import (
    MAX_OPTIONAL_PROPERTIES, MAX_SCHEMA_NODES, ConstraintError, check_constraint, structured_output)


def _request(**fields) -> ChatRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "x"}], **fields}, ChatRequest)


def _object(n: int, required: bool) -> dict:
    props = {f"p{i}": {} for i in range(n)}
    return {"type": "object", "properties": props, **({"required": list(props)} if required else {})}


def test_a_large_schema_does_not_hold_the_event_loop():
    # MAX_SCHEMA_NODES values: jsonschema's Draft 2020-12 check takes ~1.5 s of one core on it,
    # which inline stalled every other request of the gateway; the inline bounds walk takes ms
    schema = _object(MAX_SCHEMA_NODES // 2 - 100, required=True)   # a value per property, one per required
    req = _request(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    t = time.perf_counter()
    assert structured_output(req) is not None
    assert time.perf_counter() - t < 0.3


@pytest.mark.parametrize("fields, field, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, "response_format",
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": {"minLength": "x"}}}, "structured_outputs", "structured_outputs.json"),
    ({"guided_json": {"required": 3}}, "guided_json", "guided_json"),
])
def test_a_malformed_schema_is_refused_off_the_event_loop_naming_its_field(fields, field, param):
    spec, given = structured_output(_request(**fields))   # inline: the bounds only
    assert given == field
    with pytest.raises(ConstraintError) as e:
        asyncio.run(check_constraint(spec, field))       # the well-formedness check, on a thread
    assert "not a valid JSON Schema" in str(e.value) and e.value.param == param


@pytest.mark.parametrize("schema", [False, {"$ref": "#/$defs/missing"}])
def test_a_schema_xgrammar_cannot_build_is_refused_naming_the_schema_field(schema):
    """Well-formed JSON Schema that no grammar comes of: the error names the field holding the
    schema, as the well-formedness errors do (not the response_format object around it)."""
    spec, field = structured_output(_request(response_format={"type": "json_schema", "json_schema": {"schema": schema}}))
    with pytest.raises(ConstraintError) as e:
        asyncio.run(check_constraint(spec, field))
    assert e.value.param == "response_format.json_schema.schema"
    assert str(e.value).startswith("invalid response_format.json_schema.schema: ")


def test_optional_properties_are_bounded_per_object():
    # xgrammar's compile grows with the square of an object's optional properties (any subset, in
    # order): 200 cost 4 s with a 128k vocabulary, and such requests filled the workers' compile
    # pools until other tenants' small schemas missed their deadline
    def given(schema):
        return structured_output(_request(response_format={"type": "json_schema", "json_schema": {"schema": schema}}))
    assert given(_object(MAX_OPTIONAL_PROPERTIES, required=False)) is not None
    assert given(_object(10 * MAX_OPTIONAL_PROPERTIES, required=True)) is not None
    nested = {"type": "object", "properties": {"a": _object(MAX_OPTIONAL_PROPERTIES + 1, required=False)}}
    with pytest.raises(ConstraintError) as e:
        given(nested)
    assert "optional properties" in str(e.value) and e.value.param == "response_format.json_schema.schema"


@pytest.mark.parametrize("pattern", ["(" * 1500 + ")" * 1500, "a{99999999999999999999}"])
def test_a_pattern_the_regex_check_cannot_read_is_a_400_not_a_500(pattern):
    # jsonschema checks `pattern` with Python's re, which raises RecursionError on deep nesting and
    # OverflowError on a huge repeat count rather than re.error (a SchemaError): neither may escape
    spec, field = structured_output(_request(response_format={
        "type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": pattern}}}))
    with pytest.raises(ConstraintError) as e:
        asyncio.run(check_constraint(spec, field))
    assert "not a valid JSON Schema" in str(e.value) and e.value.param == "response_format.json_schema.schema"


def test_a_small_schemas_build_does_not_wait_behind_other_requests_schema_checks(monkeypatch):
    # the well-formedness checks take up to ~1.5 s each and have no time limit; queued on the
    # build threads, a tiny schema's build waited behind them and failed its build time limit
    from services.gateway import structured
    slow_s = 0.5
    monkeypatch.setattr(structured, "CHECK_TIME_LIMIT_S", 0.3)
    check_now = structured._check_valid
    monkeypatch.setattr(structured, "_check_valid", lambda parts: (
        time.sleep(slow_s) if "slow" in parts[0].schema else None, check_now(parts))[1])
    monkeypatch.setattr(structured, "_build_grammar", lambda spec: None)   # xgrammar's build: instant here
    loaded: Future = Future()
    loaded.set_result(None)
    monkeypatch.setattr(structured, "_xgrammar_loaded", loaded)

    def spec(title: str):
        return structured_output(_request(response_format={
            "type": "json_schema", "json_schema": {"schema": {"type": "string", "title": title}}}))[0]

    async def five_requests():
        # two slow checks hold the threads; the small schema's check runs next and its build is
        # queued after the two slow checks that follow it
        specs = [spec("slow1"), spec("slow2"), spec("small"), spec("slow3"), spec("slow4")]
        return await asyncio.gather(*(check_constraint(s, "response_format") for s in specs),
                                    return_exceptions=True)
    assert asyncio.run(five_requests()) == [None] * 5
