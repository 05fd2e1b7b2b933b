"""Mistral calls, after the `[TOOL_CALLS]` special token (seen only when special tokens are kept,
so the gateway keeps them for a request parsed with this format):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]     (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}        (v11 and later)

Text before the first `[TOOL_CALLS]` is content. An array holding an invalid call is text whole.
The EOS token that ends the answer is not text (services/text/streams.py leaves it out); a `</s>`
written as text at the very end of the answer is dropped all the same.
"""
from __future__ import annotations

import re

from services.gateway.tool_parsers.base import Call, Scan, ToolFormat, as_call, JsonEnd, held_prefix, loads

TOOL_CALLS, ARGS, EOS = "[TOOL_CALLS]", "[ARGS]", "</s>"
_NAME = re.compile(r"\s*([A-Za-z0-9_-]{1,64})")


class MistralFormat(ToolFormat):
    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.json_end = JsonEnd()

    def scan(self, text: str, start: int, final: bool) -> Scan:
        pieces: list = []
        i = start
        while True:
            j = text.find(TOOL_CALLS, i)
            if j < 0:
                tail = text[i:]
                if final:
                    pieces.append(tail[:-len(EOS)] if tail.endswith(EOS) else tail)
                    return Scan(pieces, len(text))
                held = len(EOS) if tail.endswith(EOS) else held_prefix(tail, EOS)
                stop = len(text) - max(held_prefix(tail, TOOL_CALLS), held)
                pieces.append(text[i:stop])
                return Scan(pieces, stop)
            pieces.append(text[i:j])
            end, calls = self._calls(text, j + len(TOOL_CALLS), final)
            if end < 0:               # not complete yet
                return Scan(pieces, j)
            if calls is None:         # not a valid call: text up to the next marker
                nxt = text.find(TOOL_CALLS, j + len(TOOL_CALLS))
                end = len(text) if nxt < 0 else nxt
                if nxt < 0 and not final:
                    return Scan(pieces, j)
                pieces.append(text[j:end])
            else:
                pieces += calls
            i = end

    def _calls(self, text: str, at: int, final: bool) -> tuple[int, list[Call] | None]:
        """(index past the calls, the calls or None when invalid) after a marker; (-1, None) while
        they may still be arriving."""
        rest = text[at:].lstrip()
        at = len(text) - len(rest)
        if not rest:
            return (len(text), None) if final else (-1, None)
        if rest[0] == "[":
            end = self.json_end(text, at)
            if end < 0:
                return (len(text), None) if final else (-1, None)
            items = loads(text[at:end])
            if not isinstance(items, list) or not items:
                return end, None
            values = [as_call(item, self.tool_names) for item in items]
            if any(v is None for v in values):
                return end, None
            return end, [Call(text[at:end] if n == 0 else "", v) for n, v in enumerate(values)]
        m = _NAME.match(text, at)
        if m is None:
            return len(text), None
        after = m.end()
        if len(text) - after < len(ARGS) and ARGS.startswith(text[after:]) and not final:
            return -1, None
        if not text.startswith(ARGS, after):
            return len(text), None
        body = after + len(ARGS)
        while body < len(text) and text[body].isspace():
            body += 1
        if body == len(text) or text[body] != "{":
            return (-1, None) if body == len(text) and not final else (len(text), None)
        end = self.json_end(text, body)
        if end < 0:
            return (len(text), None) if final else (-1, None)
        value = as_call({"name": m.group(1), "arguments": loads(text[body:end])}, self.tool_names)
        return end, None if value is None else [Call(text[at:end], value)]
