"""Why a request body that msgspec refused as malformed JSON was refused, and in which field.

msgspec stops at the first bad byte with a message about the byte ("Input data was truncated",
"invalid character (byte 105)"). The two values clients actually send by mistake are a string
holding a lone UTF-16 surrogate (`"\\ud800"`, from text cut in the middle of an emoji) and a
non-finite number (`NaN`, `Infinity`: Python's json.dumps writes them). Python's json accepts
both, so parsing the body again with it finds the value and its path, e.g. `messages[0].content`
or `temperature`, in the same form msgspec's validation errors use.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, NamedTuple

# Re-parsing costs ~80 ms per MiB of integer lists on a busy core: larger bodies keep msgspec's
# message rather than let malformed bodies stall the event loop.
MAX_EXPLAINED_BYTES = 1 << 20
MAX_PATH_CHARS = 200

_SURROGATE = re.compile("[\ud800-\udfff]")
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


class BadValue(NamedTuple):
    param: str       # the field's path: `temperature`, `messages[0].content`
    message: str     # what is wrong and what to send instead


def explain(body: bytes) -> BadValue | None:
    """The first lone surrogate or non-finite number in `body`, in document order; None when the
    body is malformed some other way (or too large to parse again)."""
    if len(body) > MAX_EXPLAINED_BYTES:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return _first_bad_value(parsed)


def _first_bad_value(root: Any) -> BadValue | None:
    stack: list[tuple[str, Any]] = [("", root)]   # iterative: nesting depth is the client's
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return _bad(path, "holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape, e.g. "
                                  "text cut inside an emoji); send valid Unicode text")
        elif isinstance(value, float):
            if not math.isfinite(value):
                name = _NON_FINITE.get(value, "NaN")
                return _bad(path, f"is {name}, which JSON does not allow; send a finite number")
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                if _SURROGATE.search(key):
                    return _bad(path, "has a key holding a lone UTF-16 surrogate; send valid Unicode text")
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", value[i]) for i in reversed(range(len(value)))]
    return None


def _bad(path: str, what: str) -> BadValue:
    param = path[:MAX_PATH_CHARS] or "body"
    return BadValue(param, f"invalid {param}: the value {what}")
