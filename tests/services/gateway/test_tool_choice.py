"""tools and tool_choice checked (400s naming the field), and what each choice makes of a request:
the answer's parser, the forced choice's JSON schema, special tokens kept for Mistral."""
from __future__ import annotations

import json

import jsonschema
import pytest

from services.gateway.schemas import ApiError
from services.gateway.tool_parsers import parse
from services.gateway.tools import MAX_TOOLS, served_formats, tool_plan, with_plan
from services.protocol.sampling import SamplingParams, StructuredOutput
from services.text.chat_formats import ChatFormats

QWEN = ChatFormats("hermes", "qwen3")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def refused(tools, choice="auto") -> ApiError:
    with pytest.raises(ApiError) as e:
        tool_plan(tools, choice, QWEN, True)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("tools, param", [
    ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "tools[0].function.parameters"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)], "tools"),
    ([{"type": "function", "function": {"name": "f", "description": "x" * 300_000}}], "tools"),
])
def test_bad_tools_are_refused_naming_the_entry(tools, param):
    assert refused(tools).param == param


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_choice_needs_tools(choice):
    assert refused(None, choice).param == "tool_choice"


@pytest.mark.parametrize("choice", ["sometimes", {"type": "function", "function": {"name": "get_date"}},
                                    {"type": "function"}, {"function": {"name": "get_time"}}, 7])
def test_a_choice_naming_no_tool_is_refused(choice):
    assert refused(TOOLS, choice).param == "tool_choice"


def test_auto_and_none():
    auto = tool_plan(TOOLS, "auto", QWEN, True)
    assert auto.structured is None and auto.parsing.reasoning == "qwen3" and not auto.keep_special_tokens
    assert not auto.parsing.forced
    assert parse(auto.parsing.tool_format(), '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>').tool_calls
    none = tool_plan(TOOLS, "none", QWEN, True)
    assert none.parsing.tool_format is None and none.parsing.reasoning == "qwen3"
    assert tool_plan(None, None, QWEN, True).parsing.tool_format is None
    assert tool_plan(TOOLS, None, ChatFormats("mistral", "none"), True).keep_special_tokens
    assert tool_plan(TOOLS, "auto", ChatFormats("none", "none"), True).parsing.active is False
    assert tool_plan(TOOLS, "auto", ChatFormats("hermes", "deepseek_r1"), False).parsing.reasoning == "qwen3"


def test_required_is_a_schema_of_calls():
    plan = tool_plan(TOOLS, "required", QWEN, True)
    schema = json.loads(plan.structured.json_schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for wrong in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "rm", "parameters": {}}], {"a": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    calls = parse(plan.parsing.tool_format(), json.dumps(good)).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert plan.parsing.reasoning == "none" and plan.parsing.forced


def test_required_without_parallel_calls_is_a_schema_of_one_call():
    schema = json.loads(tool_plan(TOOLS, "required", QWEN, True, max_calls=1).structured.json_schema)
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)


def test_a_named_function_is_its_parameters_schema():
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, QWEN, True)
    assert json.loads(plan.structured.json_schema) == WEATHER
    calls = parse(plan.parsing.tool_format(), '{"city": "Oslo"}').tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert plan.parsing.forced


def test_with_plan():
    params = SamplingParams(max_tokens=8)
    forced = tool_plan(TOOLS, "required", QWEN, True)
    assert with_plan(params, forced).structured == forced.structured
    with pytest.raises(ApiError) as e:
        with_plan(SamplingParams(structured=StructuredOutput(json_object=True)), forced)
    assert e.value.param == "tool_choice"
    assert with_plan(params, tool_plan(TOOLS, "auto", ChatFormats("mistral", "none"), True)).skip_special_tokens is False
    assert with_plan(params, tool_plan(TOOLS, "auto", QWEN, True)) is params


def test_served_formats():
    model = ChatFormats("hermes", "qwen3")
    assert served_formats("auto", "auto", model) == model
    assert served_formats("llama3_json", "none", model) == ChatFormats("llama3_json", "none")


def _nested(depth: int) -> dict:
    inner: dict = {}
    for _ in range(depth):
        inner = {"type": "array", "items": inner}
    return {"type": "object", "properties": {"a": inner}}


# the bounds a response_format schema has (structured.py): a forced choice compiles the tools'
# parameters into the same kind of grammar, so they must not be a way around them
WIDE = {"type": "object", "properties": {f"p{i}": {"enum": list(range(50))} for i in range(300)},
        "required": [f"p{i}" for i in range(300)]}


OPTIONAL = {"type": "object", "properties": {f"p{i}": {} for i in range(100)}}


@pytest.mark.parametrize("params, why", [(_nested(22), "nested too deeply"), (WIDE, "too large"),
                                         (OPTIONAL, "optional properties")])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_forced_choice_bounds_the_tools_schemas(params, why, choice):
    tools = [{"type": "function", "function": {"name": "g"}},
             {"type": "function", "function": {"name": "f", "parameters": params}}]
    err = refused(tools, choice)
    assert why in err.message and err.param == "tools[1].function.parameters"


def test_required_bounds_the_schema_of_all_tools_together():
    # each tool's schema is within the bounds, their union (what `required` compiles) is not
    names = [f"p{i}" for i in range(350)]   # 8 x (350 properties + 350 required names): > 5,000 values
    part = {"type": "object", "properties": {name: {} for name in names}, "required": names}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": part}} for i in range(8)]
    assert tool_plan(tools, {"type": "function", "function": {"name": "f0"}}, QWEN, True).structured is not None
    err = refused(tools, "required")
    assert "too large" in err.message and err.param == "tools"


def test_tools_nested_past_what_a_template_renders_name_the_tool():
    # the template sandbox refuses data nested past its depth; that must name the tool, not messages
    err = refused([{"type": "function", "function": {"name": "f", "parameters": _nested(40)}}], "auto")
    assert "nested too deeply" in err.message and err.param == "tools[0]"
