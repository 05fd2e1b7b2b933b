"""Mistral calls, after the `[TOOL_CALLS]` special token (seen only when special tokens are kept,
so the gateway keeps them for a request parsed with this format):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]     (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}        (v11 and later)

Text before the first `[TOOL_CALLS]` is content. After a marker and after `[ARGS]`, any whitespace
str.isspace takes (a no-break or ideographic space too) reads as a space; inside the JSON, JSON's
own. The EOS token that ends the answer is not text (services/text/streams.py leaves it out); a
`</s>` written as text at the very end of the answer is dropped all the same.

A call streams as it is generated (open_call.py): once its header is read (`name[ARGS]{`, or an
array item's `{"name": "<an offered tool>", "arguments": {`) the call is certain, and its
arguments are the text up to their closing bracket, or to the end of the answer when it is cut
first. In an array, the item's `}` after them is optional, then `,` and the next item or `]`: from
the first thing that is none of these (an item that is not a call, text) the answer is text again,
and the calls already read stay calls. An array whose first item is not written name first (or a
`name[ARGS]` whose name is not offered) is read whole as before: calls when all its items are
valid calls, else text whole.
"""
from __future__ import annotations

import re

from services.gateway.tool_parsers.base import (
    MAX_CALLS, Call, CallArgs, CallOpen, Piece, Scan, as_call, held_prefix, loads)
from services.gateway.tool_parsers.open_call import MORE, ArgsReader, Header, JsonLexer, OpenCallFormat, header, literal

TOOL_CALLS, ARGS, EOS = "[TOOL_CALLS]", "[ARGS]", "</s>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # matched after the whitespace is skipped (Spaces keeps its runs)


class MistralFormat(OpenCallFormat):
    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.in_list = False                  # the open call is an array's item
        self.closing = False                  # after an item's arguments: `}`, then `,` or `]`
        # a marker held as text (read whole, not a valid call): no other marker in
        # text[held + 12:searched]; the next scans take both as they are
        self.held, self.searched = -1, 0

    def rebase(self, stop: int, start: int) -> None:
        super().rebase(stop, start)
        shift = start - stop
        if self.held >= stop:
            self.held, self.searched = self.held + shift, self.searched + shift
        else:
            self.held = -1

    def read(self, text: str, start: int, final: bool) -> Scan:
        pieces: list[Piece] = []
        i = start
        while True:
            if self.args is not None:
                end = self.args.read(text, i)
                pieces.append(CallArgs(text[i:end if end >= 0 else len(text)]))
                if end < 0:
                    return Scan(pieces, len(text))
                i, self.args, self.closing = end, None, self.in_list
            if self.closing:
                end = self._next_item(text, i, final, pieces)
                if end == MORE:
                    return Scan(pieces, i)
                i, self.closing = end, False
                continue
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
            at = self._open(text, j + len(TOOL_CALLS), final, pieces)
            if at == MORE:
                return Scan(pieces, j)
            if at >= 0:
                i = at
                continue
            if self.held == j:        # decided by the scans before: not a call, text from j
                end, calls = j, None
            else:
                end, calls = self._calls(text, j + len(TOOL_CALLS), final)
            if end < 0:               # not complete yet
                return Scan(pieces, j)
            if calls is None:         # not a valid call: text up to the next marker
                # a held one's text was searched up to `searched` by the scans before
                from_ = self.searched if self.held == j else j + len(TOOL_CALLS)
                nxt = text.find(TOOL_CALLS, from_)
                end = len(text) if nxt < 0 else nxt
                if nxt < 0 and not final:
                    self.held = j
                    self.searched = max(from_, len(text) - len(TOOL_CALLS) + 1)
                    return Scan(pieces, j)
                pieces.append(text[j:end])
            else:
                for call in calls:
                    valid = self.calls < MAX_CALLS
                    self.calls += valid
                    pieces.append(call if valid else Call(call.raw, None))
            i = end

    def _open(self, text: str, at: int, final: bool, pieces: list[Piece]) -> int:
        """After a marker: the index of a streamed call's arguments (its CallOpen added), MORE to
        wait, -1 when it is not one (read whole as before)."""
        at = self.isspace(text, at)   # the whitespace _calls takes after a marker, each run read once
        if at < len(text) and text[at] == "[":
            head = header(text, at + 1, self.spaces)
            self.in_list = True
        else:
            m = _NAME.match(text, at)
            after = m.end() if m else -1
            head = -1
            if m and text.startswith(ARGS, after):
                body = self.isspace(text, after + len(ARGS))
                head = MORE if body == len(text) else Header(m.group(), body) if text[body] == "{" else -1
            elif m and (len(text) - after < len(ARGS) and ARGS.startswith(text[after:])):
                head = MORE
            elif at == len(text):
                head = MORE
            self.in_list = False
        if head == MORE:
            return -1 if final else MORE
        if isinstance(head, Header) and head.name in self.tool_names and self.calls < MAX_CALLS:
            self.calls += 1
            pieces.append(CallOpen(head.name))
            self.args = ArgsReader()
            return head.args
        return -1

    def _next_item(self, text: str, i: int, final: bool, pieces: list[Piece]) -> int:
        """After an array item's arguments: where text resumes past the item's `}` and `,` or `]`
        (a next item's arguments when it opens a streamed call), or at the first character that is
        none of these; MORE to wait (the rest, at the end: dropped)."""
        end, found = literal(text, i, ("}", ",", "]"), self.spaces)
        if found == "}":
            i = end
            end, found = literal(text, i, (",", "]"), self.spaces)
        if found == ",":
            head = header(text, end, self.spaces)
            if isinstance(head, Header) and head.name in self.tool_names and self.calls < MAX_CALLS:
                self.calls += 1
                pieces.append(CallOpen(head.name))
                self.args = ArgsReader()
                return head.args
            if head == MORE and not final:
                return MORE
            return end   # an item that is not a call: text from it
        if end == MORE:
            return len(text) if final else MORE
        return i if end == -1 else end

    def _calls(self, text: str, at: int, final: bool) -> tuple[int, list[Call] | None]:
        """(index past the calls, the calls or None when invalid) after a marker; (-1, None) while
        they may still be arriving."""
        at = self.isspace(text, at)   # as str.lstrip, without copying the held rest
        if at == len(text):
            return (len(text), None) if final else (-1, None)
        if text[at] == "[":
            end = self.json_end(text, at)
            if end < 0:
                return (len(text), None) if final else (-1, None)
            items = loads(text[at:end])
            if not isinstance(items, list) or not items:
                return end, None
            values = [as_call(item, self.tool_names) for item in items]
            if any(v is None for v in values):
                return end, None
            raws = [text[at:end]] + [""] * (len(values) - 1)   # the first call's raw text is the array's
            budget = MAX_CALLS - self.calls
            if 0 < budget < len(values):   # calls past MAX_CALLS stay text: the array from the first of them
                raws[budget] = text[_item(text, at, budget):end]
            return end, [Call(raw, v) for raw, v in zip(raws, values)]
        m = _NAME.match(text, at)
        if m is None:
            return len(text), None
        after = m.end()
        if len(text) - after < len(ARGS) and ARGS.startswith(text[after:]) and not final:
            return -1, None
        if not text.startswith(ARGS, after):
            return len(text), None
        body = after + len(ARGS)
        body = self.isspace(text, body)
        if body == len(text) or text[body] != "{":
            return (-1, None) if body == len(text) and not final else (len(text), None)
        end = self.json_end(text, body)
        if end < 0:
            return (len(text), None) if final else (-1, None)
        value = as_call({"name": m.group(), "arguments": loads(text[body:end])}, self.tool_names)
        return end, None if value is None else [Call(text[at:end], value)]


def _item(text: str, at: int, n: int) -> int:
    """Index just past the comma before item n (from 1) of the whole JSON array opening at text[at]."""
    lex = JsonLexer()
    for i in range(at, len(text)):
        lex.read(text[i])
        if text[i] == "," and lex.depth == 1 and not lex.in_string:
            n -= 1
            if n == 0:
                return i + 1
    raise ValueError("the array has fewer items")   # _calls decoded it: it has them
