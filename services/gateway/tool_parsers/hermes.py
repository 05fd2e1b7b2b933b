"""Hermes-style calls (Qwen2.5, Qwen3, Hermes, many others):

    text <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call> text <tool_call>...</tool_call>

Several calls may follow each other; text may surround them.
"""
from __future__ import annotations

from services.gateway.tool_parsers.base import Call, Scan, ToolFormat, as_call, held_prefix, loads

START, END = "<tool_call>", "</tool_call>"


class HermesFormat(ToolFormat):
    def scan(self, text: str, start: int, final: bool) -> Scan:
        pieces: list = []
        i = start
        while True:
            j = text.find(START, i)
            if j < 0:
                stop = len(text) if final else len(text) - held_prefix(text[i:], START)
                pieces.append(text[i:stop])
                return Scan(pieces, stop)
            pieces.append(text[i:j])
            k = text.find(END, j + len(START))
            if k < 0:   # unclosed: a call still coming, or (at the end) text
                if final:
                    pieces.append(text[j:])
                    return Scan(pieces, len(text))
                return Scan(pieces, j)
            i = k + len(END)
            pieces.append(Call(text[j:i], as_call(loads(text[j + len(START):k]), self.tool_names)))
