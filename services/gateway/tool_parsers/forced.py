"""The answer to a forced tool_choice, whatever the model's own call syntax: the gateway asks the
worker to constrain the output to a JSON schema (services/gateway/tools.py), so the whole answer is

    required:        [{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]   (at least one)
    a named function: {"city": "Paris"}                                 (that function's arguments)

The answer is read whole at its end (it is nothing but calls). A forced answer is calls even when
max_tokens cut it (as OpenAI and vLLM return it): the client asked for a call and must never find
the call's JSON in `content`. A cut call's arguments are the text as far as it goes (not JSON):

    named:          {"city": "Par                  -> get_weather({"city": "Par)
                    (always that one call: text that is not a JSON object is its arguments as written)
    required, cut:  [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci
                                                   -> get_time({}), get_weather({"ci)
    required, cut before a call's name is complete: that call is left out (no name to give it)

A required answer that is whole JSON but not a list of valid calls (a worker bug: the schema
forbids it) stays text, as any malformed call does.
"""
from __future__ import annotations

import re

from services.gateway.tool_parsers.base import Call, JsonEnd, Scan, ToolFormat, as_call, loads

# the opening of one required item as the schema orders it: name, then the arguments object
_ITEM_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"(?:parameters|arguments)"\s*:\s*')


class RequiredFormat(ToolFormat):
    def scan(self, text: str, start: int, final: bool) -> Scan:
        if not final:
            return Scan([], start)
        body = text[start:]
        items = loads(body)
        if items is None:
            return Scan(self._cut_calls(body), len(text))
        values = [as_call(item, self.tool_names, args_keys=("parameters", "arguments"))
                  for item in items] if isinstance(items, list) and items else [None]
        if any(v is None for v in values):
            return Scan([body], len(text))
        return Scan([Call(body if n == 0 else "", v) for n, v in enumerate(values)], len(text))

    def _cut_calls(self, body: str) -> list[Call]:
        """The calls of a list cut short: each complete item, then the cut one's name and its
        arguments as far as they go."""
        calls: list[Call] = []
        i = body.find("[") + 1
        if i == 0:
            return calls
        while True:
            while i < len(body) and body[i] in " \t\r\n,":
                i += 1
            if not body.startswith("{", i):   # the list's end (it was whole JSON then), or nothing
                return calls
            end = JsonEnd()(body, i)
            if end < 0:   # the cut item
                head = _ITEM_HEAD.match(body, i)
                if head and head.group(1) in self.tool_names:
                    calls.append(Call(body[i:], (head.group(1), body[head.end():])))
                return calls
            value = as_call(loads(body[i:end]), self.tool_names, args_keys=("parameters", "arguments"))
            if value is not None:
                calls.append(Call(body[i:end], value))
            i = end


class NamedFormat(ToolFormat):
    def __init__(self, tool_names: frozenset[str], name: str) -> None:
        super().__init__(tool_names)
        self.name = name

    def scan(self, text: str, start: int, final: bool) -> Scan:
        if not final:
            return Scan([], start)
        body = text[start:]
        value = as_call({"name": self.name, "arguments": loads(body)}, self.tool_names)
        return Scan([Call(body, value if value is not None else (self.name, body))], len(text))
