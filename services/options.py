"""`opt(...)`: a config field with its default, its `--help` text and the values it takes.

Shared by the service config tree (services/config.py) and the engine's fields
(services/engine_args.py), so that one field declaration drives every parser, the docs'
flag tables and the checks of values set in code.
"""
from __future__ import annotations

import math
import re
from dataclasses import field
from typing import Any, Mapping


def opt(default: Any, help: str, **meta: Any) -> Any:
    """A config field: its default and its --help text, plus what values it takes: choices=(...),
    min= / max= (inclusive), above= (exclusive lower bound), pattern= (a full-match regex, with
    expected= saying it in words), unset= (the value meaning "not set, choose for me", exempt from
    the bounds: 0 for a count that defaults to the model's or the device's). A list field takes
    unique=True (no item twice) and nonempty= (why each item must be non-empty text, and why a
    flag or variable that is given must hold one: `--api-key ''`, or an unset shell variable
    expanded into it, is refused instead of read as the empty default)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def is_unset(value: Any, meta: Mapping[str, Any]) -> bool:
    """Whether `value` is the field's "not set" value (opt's unset=)."""
    return "unset" in meta and not isinstance(value, bool) and value == meta["unset"]


def out_of_bounds(value: Any, meta: Mapping[str, Any]) -> str | None:
    """Why `value` breaks its field's choices / min / max / above / pattern (or is not a finite
    float), or None when it keeps them (None, booleans and the unset value always do)."""
    if isinstance(value, bool) or value is None or is_unset(value, meta):
        return None
    if isinstance(value, list):
        return _list_out_of_bounds(value, meta)
    # float() reads "nan" and "inf", and nan passes every comparison below: no field takes either
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if meta.get("choices") and value not in meta["choices"]:
        return "must be one of: " + choices_text(meta["choices"])
    if "min" in meta and value < meta["min"]:
        return f"must be at least {meta['min']}"
    if "max" in meta and value > meta["max"]:
        return f"must be at most {meta['max']}"
    if "above" in meta and not value > meta["above"]:
        return f"must be greater than {meta['above']}"
    if "pattern" in meta and not re.fullmatch(meta["pattern"], str(value)):
        return f"must be {meta.get('expected') or 'a match of ' + meta['pattern']}"
    return None


def choices_text(choices: tuple) -> str:
    """`choices` for a message or a docs table: "a, b, ''" (ints as numbers)."""
    return ", ".join(str(c) if c != "" else "''" for c in choices)


def _list_out_of_bounds(value: list, meta: Mapping[str, Any]) -> str | None:
    if meta.get("nonempty") and any(not str(item).strip() for item in value):
        return f"must not hold an empty item: {meta['nonempty']}"
    if meta.get("unique"):
        seen: set = set()
        for item in value:
            if item in seen:
                return f"names {item!r} twice: give each once"
            seen.add(item)
    return None
