"""JSON Schemas written for the constrained-decoding tests and the structured bench section.

Every schema has short minimal instances and bounds every repetition (maxLength, maxItems,
integer ranges, enums), so a random-weight model constrained by it closes the JSON well within
the tests' max_tokens: an unfinished output is a failure, never a truncation to excuse.
"""
from __future__ import annotations

S = {"type": "string", "maxLength": 6}
I = {"type": "integer", "minimum": 0, "maximum": 99}
B = {"type": "boolean"}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS: list[dict] = [
    # flat objects
    obj({"name": S}),
    obj({"name": S, "age": I}),
    obj({"ok": B}),
    obj({"id": I, "active": B, "label": S}),
    obj({"a": I, "b": I, "c": I}),
    obj({"x": {"type": "integer", "minimum": -5, "maximum": 5}}),
    obj({"n": {"type": "integer", "minimum": 100, "maximum": 999}}),
    obj({"v": {"type": "null"}}),
    obj({"name": S, "nick": S}, required=["name"]),                       # optional property
    obj({"a": I, "b": B, "c": S}, required=[]),                            # all optional
    # enums and constants
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"size": {"enum": ["S", "M", "L", "XL"]}, "qty": I}),
    obj({"kind": {"const": "point"}, "x": I, "y": I}),
    {"enum": ["alpha", "beta", "gamma"]},
    {"enum": [1, 2, 3, "four", None, True]},
    obj({"level": {"enum": [1, 2, 3]}}),
    # string patterns and formats
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}}),
    obj({"word": {"type": "string", "minLength": 2, "maxLength": 4}}),
    obj({"slug": {"type": "string", "pattern": "^[a-z]{1,5}-[0-9]{1,3}$"}}),
    # arrays
    {"type": "array", "items": I, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": B, "maxItems": 2},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4},
    obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    obj({"points": {"type": "array", "items": obj({"x": I, "y": I}), "minItems": 1, "maxItems": 2}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2}, "maxItems": 2}}),
    {"type": "array", "prefixItems": [I, S], "items": False},
    obj({"ids": {"type": "array", "items": I, "minItems": 3, "maxItems": 3}}),
    # nested objects
    obj({"user": obj({"name": S, "age": I})}),
    obj({"a": obj({"b": obj({"c": I})})}),
    obj({"meta": obj({"version": I, "draft": B}), "title": S}),
    obj({"owner": obj({"id": I}), "repo": obj({"name": S, "private": B})}),
    obj({"config": obj({"debug": B, "level": {"enum": ["low", "high"]}}, required=["debug"])}),
    obj({"pos": obj({"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                     "lon": {"type": "integer", "minimum": -180, "maximum": 180}})}),
    # anyOf / oneOf / nullable
    obj({"v": {"anyOf": [I, S]}}),
    obj({"v": {"anyOf": [B, {"type": "null"}]}}),
    {"anyOf": [obj({"cat": S}), obj({"dog": I})]},
    obj({"shape": {"anyOf": [obj({"r": I}), obj({"w": I, "h": I})]}}),
    obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    obj({"id": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}}),
    # numbers with bounds
    obj({"score": {"type": "integer", "minimum": 1, "maximum": 10}}),
    obj({"t": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 50}}),
    obj({"a": {"type": "integer", "minimum": 0, "maximum": 1}, "b": {"type": "integer", "minimum": 2, "maximum": 3}}),
    obj({"year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    # definitions and references
    {"$defs": {"pt": obj({"x": I, "y": I})}, **obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}})},
    {"$defs": {"name": S}, **obj({"first": {"$ref": "#/$defs/name"}, "last": {"$ref": "#/$defs/name"}})},
    # mixed
    obj({"items": {"type": "array", "items": obj({"sku": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
                                                   "n": I}), "maxItems": 2}, "paid": B}),
    obj({"status": {"enum": ["ok", "error"]}, "error": {"anyOf": [S, {"type": "null"}]}}),
    obj({"event": obj({"type": {"enum": ["click", "view"]}, "at": I}), "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}),
    obj({"k": {"type": "string", "enum": ["a", "bb", "ccc"]}, "v": {"type": "array", "items": B, "minItems": 1, "maxItems": 1}}),
]

# A schema whose instances are long (an array of objects with minItems): the bench's forced
# output length for the TPOT comparison.
LONG_SCHEMA: dict = {"type": "array", "minItems": 40, "maxItems": 40,
                     "items": obj({"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                   "name": {"type": "string", "minLength": 8, "maxLength": 8},
                                   "ok": B})}
