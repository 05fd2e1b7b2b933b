"""The answer to a forced tool_choice, whatever the model's own call syntax: the gateway asks the
worker to constrain the output to a JSON schema (services/gateway/tools.py), so the whole answer is

    required:        [{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]   (at least one)
    a named function: {"city": "Paris"}                                 (that function's arguments)

The answer is read whole at its end (it is nothing but calls); an answer that is not such JSON
(cut by max_tokens, or a worker without constrained decoding) is text.
"""
from __future__ import annotations

from services.gateway.tool_parsers.base import Call, Scan, ToolFormat, as_call, loads


class RequiredFormat(ToolFormat):
    def scan(self, text: str, start: int, final: bool) -> Scan:
        if not final:
            return Scan([], start)
        items = loads(text[start:])
        values = [as_call(item, self.tool_names, args_keys=("parameters", "arguments"))
                  for item in items] if isinstance(items, list) and items else [None]
        if any(v is None for v in values):
            return Scan([text[start:]], len(text))
        return Scan([Call(text[start:] if n == 0 else "", v) for n, v in enumerate(values)], len(text))


class NamedFormat(ToolFormat):
    def __init__(self, tool_names: frozenset[str], name: str) -> None:
        super().__init__(tool_names)
        self.name = name

    def scan(self, text: str, start: int, final: bool) -> Scan:
        if not final:
            return Scan([], start)
        value = as_call({"name": self.name, "arguments": loads(text[start:])}, self.tool_names)
        return Scan([text[start:] if value is None else Call(text[start:], value)], len(text))
