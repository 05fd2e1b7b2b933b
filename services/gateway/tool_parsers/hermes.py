"""Hermes-style calls (Qwen2.5, Qwen3, Hermes, many others):

    text <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call> text <tool_call>...</tool_call>

Several calls may follow each other; text may surround them.

A call streams as it is generated (open_call.py): once `<tool_call>{"name": "<an offered tool>",
"arguments": {` is read the call is certain, and its arguments are the text up to their closing
bracket, or to the end of the answer when it is cut first. After them come the object's `}`
(optional) and `</tool_call>`; from the first character that is neither (text after the object
inside the tag), the answer is read as text again. A call written otherwise (arguments first, or
as a string) is read whole at its `</tool_call>` as before: a call if valid, else text.
"""
from __future__ import annotations

from services.gateway.tool_parsers.base import (
    MAX_CALLS, Call, CallArgs, CallOpen, Piece, Scan, as_call, held_prefix, loads)
from services.gateway.tool_parsers.open_call import MORE, ArgsReader, Header, OpenCallFormat, header, literal

START, END = "<tool_call>", "</tool_call>"


class HermesFormat(OpenCallFormat):
    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.closing = False                  # after them: the object's `}`, then END
        self.searched = 0   # a held call's text (from its tag) known to hold no END: not searched again

    def read(self, text: str, start: int, final: bool) -> Scan:
        pieces: list[Piece] = []
        i = start
        while True:
            if self.args is not None:
                end = self.args.read(text, i)
                pieces.append(CallArgs(text[i:end if end >= 0 else len(text)]))
                if end < 0:
                    return Scan(pieces, len(text))
                i, self.args, self.closing = end, None, True
            if self.closing:
                end = self._close(text, i, final)
                if end == MORE:
                    return Scan(pieces, i)
                i, self.closing = end, False
            j = text.find(START, i)
            if j < 0:
                stop = len(text) if final else len(text) - held_prefix(text[i:], START)
                pieces.append(text[i:stop])
                return Scan(pieces, stop)
            pieces.append(text[i:j])
            head = header(text, j + len(START), self.spaces)
            if head == MORE and not final:
                return Scan(pieces, j)
            if isinstance(head, Header) and head.name in self.tool_names and self.calls < MAX_CALLS:
                self.calls += 1
                pieces.append(CallOpen(head.name))
                i, self.args = head.args, ArgsReader()
                continue
            # a stream's next scan starts at the tag it held, the same text with more after it
            k = text.find(END, j + max(len(START), self.searched if j == start else 0))
            if k < 0:   # unclosed: a call still coming, or (at the end) text
                if final:
                    pieces.append(text[j:])
                    return Scan(pieces, len(text))
                self.searched = max(0, len(text) - j - len(END) + 1)
                return Scan(pieces, j)
            i, self.searched = k + len(END), 0
            value = as_call(loads(text[j + len(START):k]), self.tool_names) if self.calls < MAX_CALLS else None
            self.calls += value is not None
            pieces.append(Call(text[j:i], value))

    def _close(self, text: str, i: int, final: bool) -> int:
        """Where text resumes after a call's arguments: past the object's `}` and END, or at the
        first character that is neither; MORE to wait for more (the rest, at the end: dropped)."""
        end, found = literal(text, i, ("}", END), self.spaces)
        if found == "}":
            after, _ = literal(text, end, (END,), self.spaces)
            end = end if after == -1 else after
        if end == MORE:
            return len(text) if final else MORE
        return i if end == -1 else end
