"""Constrained-output request fields -> one StructuredOutput, checked at the gateway so a bad
constraint is a 400 in milliseconds, before any worker sees it.

Accepted (at most one of them per request; more is a 400 naming them):
    response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name",
                      "schema", "strict"}}  (OpenAI)
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  (vLLM)
    guided_json, guided_regex, guided_choice, guided_grammar  (vLLM's older names);
    guided_decoding_backend: "xgrammar" or "auto" (the only backend), else a 400;
    guided_whitespace_pattern: a 400 when set (xgrammar takes no whitespace pattern)

Cheap checks run inline (sizes, nesting depth, node, enum-entry and optional-property counts);
then check_constraint checks JSON Schema well-formedness (Draft202012Validator.check_schema:
slow, ~0.3 ms a node) on a thread of its own and builds the xgrammar Grammar (no tokenizer needed:
syntax, unsupported keywords, `$ref` chains without content) on a worker thread under
CHECK_TIME_LIMIT_S. Recursive schemas whose `$ref`s reach
content are valid: xgrammar compiles recursion.
"""
from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import msgspec

from services.protocol.sampling import MAX_STRUCTURED_SPEC_BYTES, SamplingParamsError, StructuredOutput

MAX_SCHEMA_DEPTH = 24          # nesting of objects/arrays in a schema
MAX_SCHEMA_NODES = 5_000       # objects, arrays and values in a schema
MAX_ENUM_ENTRIES = 1_024       # entries of one enum; every enum together: MAX_SCHEMA_NODES
# properties of one object not listed in its `required`: xgrammar's compile grows with their
# square (any subset may appear, in order): 200 took 4 s with a 128k vocabulary, 64 about 0.6 s
MAX_OPTIONAL_PROPERTIES = 64
CHECK_TIME_LIMIT_S = 1.0
BACKENDS = (None, "xgrammar", "auto")
# the field holding a constraint's JSON Schema, by the field that set the constraint
SCHEMA_PARAMS = {"response_format": "response_format.json_schema.schema",
                 "structured_outputs": "structured_outputs.json"}

_checker = ThreadPoolExecutor(2, thread_name_prefix="grammar-check")
# the well-formedness checks (no time limit, up to ~1.5 s each) have their own threads: on the
# build threads, a build queued behind them spent its time limit waiting
_validator = ThreadPoolExecutor(2, thread_name_prefix="schema-check")
# xgrammar imports torch and transformers (~220 MB, seconds of CPU): a gateway loads it on its
# first constrained request, off the event loop, and that request's time limit starts after it
_xgrammar_loaded: Future | None = None


class ConstraintError(ValueError):
    """A bad constraint: the message says what; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class SchemaPart(NamedTuple):
    """One client field's JSON Schema inside a constraint kvmesh builds from several (a forced
    tool_choice's: services/gateway/tools.py); errors in it name that field, not the whole."""
    field: str     # tools[2].function.parameters
    schema: str    # its JSON text


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    schema: Any = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsIn(msgspec.Struct, kw_only=True):
    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ConstraintFields(msgspec.Struct, kw_only=True):
    """The request-body fields of a constraint, shared by /v1/completions and /v1/chat/completions."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # vLLM's whitespace regex for guided_json: xgrammar's JSON Schema compile takes none (only
    # any_whitespace and a whitespace count), so a value set is a 400 naming it
    guided_whitespace_pattern: str | None = None


def structured_output(req: ConstraintFields) -> tuple[StructuredOutput, str] | None:
    """The request's constraint and the field it came from; None without one. Raises
    ConstraintError naming the field."""
    if req.guided_decoding_backend not in BACKENDS:
        raise ConstraintError("guided_decoding_backend must be 'xgrammar' or 'auto' (the only backend)",
                              "guided_decoding_backend")
    if req.guided_whitespace_pattern is not None:
        raise ConstraintError("guided_whitespace_pattern is not supported: xgrammar (the only backend) compiles "
                              "JSON schemas with its own whitespace rules; leave it out", "guided_whitespace_pattern")
    given = _given(req)
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise ConstraintError(f"give at most one output constraint, got {names}", given[1][0])
    if not given:
        return None
    param, make = given[0]
    spec = make()
    try:
        spec.validate()
    except SamplingParamsError as exc:
        raise ConstraintError(f"invalid {param}: {str(exc).split(': ', 1)[-1]}", param) from None
    return spec, param


def constraint_field(req: ConstraintFields) -> str:
    """The request field that set its constraint (tool_choice when none of ours did: a forced
    tool call constrains the output to the tool's parameters)."""
    given = _given(req)
    return given[0][0] if given else "tool_choice"


def _given(req: ConstraintFields) -> list[tuple[str, Any]]:
    """(field name, maker of its StructuredOutput) of each constraint field the request sets."""
    given: list[tuple[str, Any]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        given.append(("response_format", lambda: _response_format(rf)))
    so = req.structured_outputs
    if so is not None:
        given.append(("structured_outputs", lambda: _structured_outputs(so)))
    if req.guided_json is not None:
        given.append(("guided_json", lambda: StructuredOutput(json_schema=_schema_text(req.guided_json, "guided_json"))))
    if req.guided_regex is not None:
        given.append(("guided_regex", lambda: StructuredOutput(regex=req.guided_regex)))
    if req.guided_choice is not None:
        given.append(("guided_choice", lambda: StructuredOutput(choice=list(req.guided_choice))))
    if req.guided_grammar is not None:
        given.append(("guided_grammar", lambda: StructuredOutput(grammar=req.guided_grammar)))
    return given


def _response_format(rf: ResponseFormat) -> StructuredOutput:
    if rf.type == "json_object":
        return StructuredOutput(json_object=True)
    if rf.type != "json_schema":
        raise ConstraintError("response_format type must be 'text', 'json_object' or 'json_schema'",
                              "response_format.type")
    if rf.json_schema is None or rf.json_schema.schema is None:
        raise ConstraintError("response_format type 'json_schema' needs json_schema.schema", "response_format.json_schema")
    return StructuredOutput(json_schema=_schema_text(rf.json_schema.schema, "response_format.json_schema.schema"))


def _structured_outputs(so: StructuredOutputsIn) -> StructuredOutput:
    fields = {"json": so.json, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
              "json_object": so.json_object or None}
    set_ = [k for k, v in fields.items() if v is not None]
    if len(set_) != 1:
        raise ConstraintError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object",
                              "structured_outputs")
    key = set_[0]
    if key == "json":
        return StructuredOutput(json_schema=_schema_text(so.json, "structured_outputs.json"))
    if key == "json_object":
        return StructuredOutput(json_object=True)
    return StructuredOutput(**{key: fields[key]})


def _schema_text(schema: Any, param: str) -> str:
    """A JSON Schema (object, or its JSON text) checked and serialized compactly."""
    if isinstance(schema, str):
        if len(schema) > MAX_STRUCTURED_SPEC_BYTES:
            raise ConstraintError(f"the schema must have at most {MAX_STRUCTURED_SPEC_BYTES} bytes", param)
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            raise ConstraintError("the schema is not valid JSON", param) from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError("the schema must be a JSON object", param)
    check_bounds(schema, param)   # well-formedness: check_constraint, off the event loop
    text = json.dumps(schema, separators=(",", ":"))
    if len(text.encode()) > MAX_STRUCTURED_SPEC_BYTES:
        raise ConstraintError(f"the schema must have at most {MAX_STRUCTURED_SPEC_BYTES} bytes", param)
    return text


def _check_valid(parts: Sequence[SchemaPart]) -> None:
    """Draft 2020-12 well-formedness of each part; the error names its field and the path within
    it. jsonschema spends ~0.3 ms a node on it (1.5 s at MAX_SCHEMA_NODES), so it runs on its own
    threads, never on the event loop."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError
    for param, schema_text in parts:
        try:
            Draft202012Validator.check_schema(json.loads(schema_text))
        except SchemaError as exc:
            where = "/".join(str(p) for p in exc.path) or "the root"
            raise ConstraintError(f"the schema is not a valid JSON Schema at {where}: {exc.message[:200]}",
                                  param) from None
        except (RecursionError, OverflowError, ValueError):   # Python's re on a `pattern`: too deep, a repeat too large
            raise ConstraintError("the schema is not a valid JSON Schema: it holds a pattern that cannot be read "
                                  "(nested too deeply, or a repeat count too large)", param) from None


def check_bounds(schema: Any, param: str) -> int:
    """Depth, node count and enum sizes, walked iteratively (no recursion to exhaust); the node
    count. Also what a forced tool_choice runs on the tools' parameters (tools.py)."""
    stack = [(schema, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ConstraintError(f"the schema is too large: at most {MAX_SCHEMA_NODES} values", param)
        if depth > MAX_SCHEMA_DEPTH:
            raise ConstraintError(f"the schema is nested too deeply: at most {MAX_SCHEMA_DEPTH} levels", param)
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > MAX_ENUM_ENTRIES:
                raise ConstraintError(f"an enum may list at most {MAX_ENUM_ENTRIES} values, got {len(enum)}", param)
            if _optional_properties(node) > MAX_OPTIONAL_PROPERTIES:
                raise ConstraintError(f"an object may have at most {MAX_OPTIONAL_PROPERTIES} optional properties; "
                                      "list the others in its `required`", param)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return nodes


def _optional_properties(node: dict) -> int:
    """How many of an object schema's `properties` its `required` leaves out."""
    props = node.get("properties")
    if not isinstance(props, dict):
        return 0
    required = node.get("required")
    named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    return sum(1 for name in props if name not in named)


def _build_grammar(spec: StructuredOutput) -> None:
    import xgrammar
    if spec.json_schema is not None:
        xgrammar.Grammar.from_json_schema(spec.json_schema, any_whitespace=False)
    elif spec.regex is not None:
        xgrammar.Grammar.from_regex(spec.regex)
    elif spec.grammar is not None:
        xgrammar.Grammar.from_ebnf(spec.grammar)


async def check_constraint(spec: StructuredOutput, param: str, parts: Sequence[SchemaPart] = ()) -> None:
    """Build spec's grammar (no tokenizer) off the event loop; ConstraintError when it does not
    build, or not within CHECK_TIME_LIMIT_S (the thread finishes on its own: xgrammar cannot be
    interrupted; the inline bounds keep such builds short). `parts`: the client's schemas a
    JSON Schema constraint was built from (a forced tool_choice's), each checked and named on its
    own; without them the schema is the client's, in the field `param` set."""
    if spec.json_object or spec.choice is not None:
        return
    loop = asyncio.get_running_loop()
    if spec.json_schema is not None:   # bounded by check_bounds: no time limit needed
        whole = [SchemaPart(SCHEMA_PARAMS.get(param, param), spec.json_schema)]
        await loop.run_in_executor(_validator, _check_valid, parts or whole)
    global _xgrammar_loaded
    if _xgrammar_loaded is None:
        _xgrammar_loaded = _checker.submit(importlib.import_module, "xgrammar")
    await asyncio.wrap_future(_xgrammar_loaded)
    future = loop.run_in_executor(_checker, _build_grammar, spec)
    try:
        await asyncio.wait_for(future, CHECK_TIME_LIMIT_S)
    except asyncio.TimeoutError:
        raise ConstraintError("the constraint is too complex to compile in time; simplify it", param) from None
    except Exception as exc:
        field = SCHEMA_PARAMS.get(param, param) if spec.json_schema is not None else param
        field, reason = await _failed_part(parts) or (field, _reason(exc))
        raise ConstraintError(f"invalid {field}: {reason}", field) from None


async def _failed_part(parts: Sequence[SchemaPart]) -> tuple[str, str] | None:
    """The first part whose own grammar does not build, and why: a whole that did not build is
    blamed on it (None when every part builds, or the search runs past CHECK_TIME_LIMIT_S)."""
    if not parts:
        return None
    future = asyncio.get_running_loop().run_in_executor(_checker, _first_failed, parts)
    try:
        return await asyncio.wait_for(future, CHECK_TIME_LIMIT_S)
    except asyncio.TimeoutError:
        return None


def _first_failed(parts: Sequence[SchemaPart]) -> tuple[str, str] | None:
    for field, schema in parts:
        try:
            _build_grammar(StructuredOutput(json_schema=schema))
        except Exception as exc:
            return field, _reason(exc)
    return None


def _reason(exc: Exception) -> str:
    """xgrammar's error, without its C++ source location."""
    reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    head, sep, tail = reason.partition(".cc:")
    return (tail.split(": ", 1)[-1] if sep else reason)[:300]
