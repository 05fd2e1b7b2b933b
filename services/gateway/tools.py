"""A chat request's tools and tool_choice, checked, and what they make of the answer:

    tool_choice   prompt (tools)   answer parsed with                 output constrained to
    none          rendered         nothing (plain text)               -
    auto          rendered         the model's call syntax            -
    required      rendered         forced.RequiredFormat             [{"name", "parameters"}, ...] (1+)
    {function}    rendered         forced.NamedFormat(name)          that function's parameters

(vLLM's choices: tools are rendered even for `none`, and a forced choice is a JSON schema the
worker's constrained decoding holds the answer to, whatever syntax the model would use.)
The reasoning split applies to every unforced answer; a forced one is JSON from its first token.
"""
from __future__ import annotations

import json
import re
from functools import partial
from typing import Any, NamedTuple

import msgspec

from services.gateway.chat_output import OutputParsing
from services.gateway.schemas import bad
from services.gateway.structured import MAX_SCHEMA_NODES, ConstraintError, SchemaPart, check_bounds
from services.gateway.tool_parsers import NamedFormat, RequiredFormat, tool_format
from services.protocol.sampling import MAX_STRUCTURED_SPEC_BYTES, SamplingParams, StructuredOutput
from services.text.chat_formats import ChatFormats
from services.text.chat_template import MAX_DATA_DEPTH

MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 * 1024      # all tools' JSON together
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolPlan(NamedTuple):
    parsing: OutputParsing
    structured: StructuredOutput | None     # the forced choice's schema
    keep_special_tokens: bool               # the call syntax is made of special tokens (Mistral's)
    # the tools' parameters `structured` was built from, each with its field: check_constraint
    # names a bad one (tools[i].function.parameters), not the schema built around them
    schema_parts: tuple[SchemaPart, ...] = ()


def check_tools(tools: list[dict] | None) -> dict[str, dict]:
    """{name: parameters schema} of OpenAI's `tools`; ApiError 400 naming the bad entry."""
    if tools is None:
        return {}
    if len(tools) > MAX_TOOLS:
        raise bad(f"at most {MAX_TOOLS} tools per request", "tools")
    if _json_bytes(tools) > MAX_TOOLS_BYTES:
        raise bad(f"tools must have at most {MAX_TOOLS_BYTES} bytes of JSON in all", "tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad("each tool must be {\"type\": \"function\", \"function\": {...}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad("function names must be 1 to 64 characters of a-z A-Z 0-9 _ -", f"tools[{i}].function.name")
        if name in out:
            raise bad(f"two tools are named {name!r}", f"tools[{i}].function.name")
        if _depth(tool) > MAX_DATA_DEPTH:   # the template sandbox would refuse it, naming no tool
            raise bad(f"a tool is nested too deeply: at most {MAX_DATA_DEPTH} levels", f"tools[{i}]")
        if not isinstance(fn.get("description", ""), str):
            raise bad("a function's description must be a string", f"tools[{i}].function.description")
        params = fn.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise bad("a function's parameters must be a JSON Schema object ({\"type\": \"object\", ...})",
                      f"tools[{i}].function.parameters")
        out[name] = params
    return out


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value (a scalar: 1), walked iteratively."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def _checked_schemas(tools: list[dict], schemas: dict[str, dict], names: list[str]) -> tuple[SchemaPart, ...]:
    """The named tools' parameters within the bounds a response_format schema has (structured.py),
    each and together: a forced choice compiles them into one grammar. Each with its field, for
    check_constraint's well-formedness and build checks off the event loop."""
    index = {tool["function"]["name"]: i for i, tool in enumerate(tools)}
    nodes, parts = 0, []
    for name in names:
        field = f"tools[{index[name]}].function.parameters"
        try:
            nodes += check_bounds(schemas[name], field)
        except ConstraintError as exc:
            raise bad(str(exc), exc.param) from None
        parts.append(SchemaPart(field, json.dumps(schemas[name])))
    if nodes > MAX_SCHEMA_NODES:
        raise bad(f"the tools' parameters are too large to force a call: at most {MAX_SCHEMA_NODES} values "
                  "in all; offer fewer or smaller tools", "tools")
    return tuple(parts)


def _forced_name(tool_choice: Any) -> str | None:
    """The function a `{"type": "function", "function": {"name": ...}}` choice names."""
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(fn, dict) or tool_choice.get("type") != "function"
            or not isinstance(fn.get("name"), str)):
        raise bad("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                  "{\"name\": ...}}", "tool_choice")
    return fn["name"]


def _json_bytes(value: Any) -> int:
    """Size of `value` as JSON (ASCII); nesting too deep to serialize counts as too large."""
    try:
        return len(json.dumps(value))
    except (ValueError, RecursionError):
        return MAX_TOOLS_BYTES + 1


def _schema(value: dict) -> StructuredOutput:
    if _json_bytes(value) > MAX_STRUCTURED_SPEC_BYTES:
        raise bad(f"the tools' parameters make a schema over {MAX_STRUCTURED_SPEC_BYTES} bytes; offer fewer or "
                  "smaller tools to force a call", "tools")
    return StructuredOutput(json_schema=json.dumps(value))


def required_schema(tools: dict[str, dict], max_calls: int | None = None) -> dict:
    """An array of one or more calls (at most max_calls), each one tool's name with that tool's parameters."""
    return {"type": "array", "minItems": 1, **({"maxItems": max_calls} if max_calls else {}), "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
         "required": ["name", "parameters"]} for name, params in tools.items()]}}


def tool_plan(tools: list[dict] | None, tool_choice: Any, formats: ChatFormats, thinking: bool,
              max_calls: int | None = None) -> ToolPlan:
    """What to parse and constrain for this request. `formats`: the parsers the gateway uses (its
    flags, or the model's where they say auto); `thinking`: the answer may start inside a reasoning
    block (the template was not told not to think, and no constraint holds the answer from its first token);
    `max_calls`: 1 for parallel_tool_calls false (a required answer's schema allows one call; an auto
    answer's calls past it are dropped), None for any number."""
    schemas = check_tools(tools)
    names = frozenset(schemas)
    reasoning = formats.reasoning_parser if thinking else _no_opened_block(formats.reasoning_parser)
    if tool_choice in (None, "auto", "none"):
        parse_calls = bool(schemas) and tool_choice != "none" and formats.tool_call_parser != "none"
        fmt = partial(tool_format, formats.tool_call_parser, names) if parse_calls else None
        return ToolPlan(OutputParsing(reasoning, fmt, max_calls=max_calls), None,
                        parse_calls and formats.tool_call_parser == "mistral")
    if not schemas:
        raise bad("tool_choice 'required' or a named function needs tools", "tool_choice")
    if tool_choice == "required":
        parts = _checked_schemas(tools or [], schemas, list(schemas))
        return ToolPlan(OutputParsing("none", partial(RequiredFormat, names), forced=True),
                        _schema(required_schema(schemas, max_calls)), False, parts)
    if isinstance(tool_choice, str):
        raise bad(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice[:40]!r}",
                  "tool_choice")
    name = _forced_name(tool_choice)
    if name not in schemas:
        raise bad(f"tool_choice names the function {name[:64]!r}, which is not among the tools", "tool_choice")
    parts = _checked_schemas(tools or [], schemas, [name])
    return ToolPlan(OutputParsing("none", partial(NamedFormat, names, name), forced=True), _schema(schemas[name]),
                    False, parts)


def served_formats(tool_call_parser: str, reasoning_parser: str, model: ChatFormats) -> ChatFormats:
    """The gateway's --tool-call-parser / --reasoning-parser, the model's own where they say auto."""
    return ChatFormats(model.tool_call_parser if tool_call_parser == "auto" else tool_call_parser,
                       model.reasoning_parser if reasoning_parser == "auto" else reasoning_parser)


def with_plan(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """The sampling parameters the plan needs: the forced choice's schema, special tokens kept."""
    changes: dict[str, Any] = {}
    if plan.structured is not None:
        if params.structured is not None:
            raise bad("a forced tool_choice constrains the answer itself; it cannot be combined with a "
                      "response_format or guided decoding", "tool_choice")
        changes["structured"] = plan.structured
    if plan.keep_special_tokens:
        changes["skip_special_tokens"] = False
    return msgspec.structs.replace(params, **changes) if changes else params


def _no_opened_block(parser: str) -> str:
    """enable_thinking false: a template that honours it opens no block in the prompt, so an answer
    thinks only if it opens one itself (qwen3's rule)."""
    return "none" if parser == "none" else "qwen3"

