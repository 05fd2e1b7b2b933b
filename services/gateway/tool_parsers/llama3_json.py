"""Llama 3.1 / 3.2 JSON calls: the answer opens with a call object, optionally after
`<|python_tag|>` (a special token: seen only when special tokens are kept), and several calls are
separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

An answer that does not open with a call object is text; so is everything from the first thing
after a call that is neither `;` nor another call.
"""
from __future__ import annotations

from services.gateway.tool_parsers.base import Call, Scan, ToolFormat, as_call, JsonEnd, held_prefix, loads

PYTHON_TAG = "<|python_tag|>"


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class Llama3JsonFormat(ToolFormat):
    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.json_end = JsonEnd()
        self.state = "opening"    # opening -> call -> after (`;` -> call) ; anything else -> text

    def scan(self, text: str, start: int, final: bool) -> Scan:
        pieces: list = []
        i = start
        while self.state != "text":
            at = _skip_space(text, i)
            if self.state == "opening":
                if text.startswith(PYTHON_TAG, at):
                    at = _skip_space(text, at + len(PYTHON_TAG))
                elif at < len(text) and held_prefix(text[at:], PYTHON_TAG) == len(text) - at and not final:
                    return Scan(pieces, i)    # may be the tag, still arriving
            if at == len(text):               # only space so far
                if not final:
                    return Scan(pieces, i)
                break
            if self.state == "after":
                if text[at] != ";":
                    break
                i, self.state = at + 1, "call"
                continue
            if text[at] != "{":
                break
            end = self.json_end(text, at)
            if end < 0 and not final:
                return Scan(pieces, i)
            value = as_call(loads(text[at:end]), self.tool_names) if end > 0 else None
            if value is None:
                break
            pieces.append(Call(text[at:end], value))
            i, self.state = end, "after"
        self.state = "text"
        pieces.append(text[i:])
        return Scan(pieces, len(text))
