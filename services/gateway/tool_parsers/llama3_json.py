"""Llama 3.1 / 3.2 JSON calls: the answer opens with a call object, optionally after
`<|python_tag|>` (a special token: seen only when special tokens are kept), and several calls are
separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

An answer that does not open with a call object is text; so is everything from the first thing
after a call that is neither `;` nor another call.

A call streams as it is generated (open_call.py): once `{"name": "<an offered tool>",
"parameters": {` is read the call is certain, and its arguments are the text up to their closing
bracket, or to the end of the answer when it is cut first; the object's `}` after them is
optional, and anything else there is the first thing after the call. A call written otherwise
(arguments first, or as a string) is read whole at its closing bracket as before.
"""
from __future__ import annotations

from services.gateway.tool_parsers.base import (
    MAX_CALLS, Call, CallArgs, CallOpen, Piece, Scan, as_call, loads)
from services.gateway.tool_parsers.open_call import MORE, ArgsReader, Header, OpenCallFormat, header, literal

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonFormat(OpenCallFormat):
    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        # opening -> call (args -> closing) -> after (`;` -> call) ; anything else -> text
        self.state = "opening"

    def read(self, text: str, start: int, final: bool) -> Scan:
        pieces: list[Piece] = []
        i = start
        while self.state != "text":
            if self.state == "args":
                end = self.args.read(text, i)
                pieces.append(CallArgs(text[i:end if end >= 0 else len(text)]))
                if end < 0:
                    return Scan(pieces, len(text))
                i, self.args, self.state = end, None, "closing"
            if self.state == "closing":   # the object's `}`, if it is there
                end, found = literal(text, i, ("}",), self.spaces)
                if end == MORE and not final:
                    return Scan(pieces, i)
                i, self.state = (end if found else i), "after"
            at = self.isspace(text, i)
            if self.state == "opening":
                if text.startswith(PYTHON_TAG, at):
                    at = self.isspace(text, at + len(PYTHON_TAG))
                elif len(text) - at < len(PYTHON_TAG) and PYTHON_TAG.startswith(text[at:]) and at < len(text) and not final:
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
            head = header(text, at, self.spaces)
            if head == MORE and not final:
                return Scan(pieces, i)
            if isinstance(head, Header) and head.name in self.tool_names and self.calls < MAX_CALLS:
                self.calls += 1
                pieces.append(CallOpen(head.name))
                i, self.args, self.state = head.args, ArgsReader(), "args"
                continue
            end = self.json_end(text, at)
            if end < 0 and not final:
                return Scan(pieces, i)
            value = as_call(loads(text[at:end]), self.tool_names) if end > 0 and self.calls < MAX_CALLS else None
            if value is None:
                break
            self.calls += 1
            pieces.append(Call(text[at:end], value))
            i, self.state = end, "after"
        self.state = "text"
        pieces.append(text[i:])
        return Scan(pieces, len(text))
