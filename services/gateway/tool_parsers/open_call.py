"""A call in the model's own syntax read as it is generated (hermes, llama3_json, mistral): the
pieces each format shares to stream a call before it is whole.

A call object opens with its header: its name, an offered tool's, then its arguments' key and the
arguments object's `{`. Once the header is read the call is certain (a stream has sent it), and its
arguments are the text the model wrote from that `{` to the bracket that closes it, never
re-serialized (a stream cannot take back what it sent):

    {"name": "get_weather", "arguments": {"city": "Paris"}}
    └──────────── header ────────────────┘└─ arguments ───┘└ the object's `}` (optional)
                                                    then the format's own end (`</tool_call>`, `;`, ...)

`header` says whether text opens with a header, may still become one (the text so far is the
start of one), or cannot; `ArgsReader` finds the arguments' closing bracket as the text arrives
(brackets inside strings do not count; the JSON itself is not checked, so a model's bad JSON is
passed on as written); `literal` reads the fixed syntax after them; `OpenCallFormat` is the
state every such format keeps across scans.
"""
from __future__ import annotations

import string
from typing import NamedTuple

from services.gateway.tool_parsers.base import JsonEnd, ToolFormat

NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")   # as the tools checks allow
SPACE = " \t\r\n"
MORE = -2   # the text ended before it could be decided: a stream waits, a whole answer is done


class JsonLexer:
    """Bracket depth of JSON read one character at a time (brackets inside strings do not count).
    The value is not checked: a grammar did that (forced.py), or the model's text is passed on."""
    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def read(self, c: str) -> bool:
        """Take one character; True when it was a bracket outside strings (the depth changed)."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
            return False
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
            return True
        elif c in "}]":
            self.depth -= 1
            return True
        return False


class ArgsReader:
    """One call's arguments, fed from their `{` on, scan after scan: each character is read once."""

    def __init__(self) -> None:
        self.lex = JsonLexer()

    def read(self, text: str, start: int) -> int:
        """Index just past the arguments' closing bracket in text[start:], or -1 (not in it)."""
        lex = self.lex
        for i in range(start, len(text)):
            if lex.read(text[i]) and lex.depth == 0:
                return i + 1
        return -1


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in SPACE:
        i += 1
    return i


class Spaces:
    """skip_space over held text, each run of whitespace read once: a stream reads a held call's
    opening again at every delta, and a model may write any amount of whitespace in it. The runs
    found are kept by position (rebased between scans like base.JsonEnd); `isspace` skips what
    str.isspace takes instead of SPACE."""

    def __init__(self, isspace: bool = False) -> None:
        self.isspace = isspace
        self.runs: dict[int, int] = {}   # text[a:b] is whitespace

    def rebase(self, stop: int, start: int) -> None:
        if self.runs:
            self.runs = {a - stop + start: b - stop + start for a, b in self.runs.items() if a >= stop}

    def __call__(self, text: str, i: int) -> int:
        j = self.runs.get(i, i)
        if self.isspace:
            while j < len(text) and text[j].isspace():
                j += 1
        else:
            while j < len(text) and text[j] in SPACE:
                j += 1
        if j - i > 16:
            self.runs[i] = j
        return j


def literal(text: str, i: int, options: tuple[str, ...], skip=skip_space) -> tuple[int, str]:
    """After whitespace at text[i:], one of `options`: (index past it, the option), (MORE, "") while
    the text so far may still become one, (-1, "") when it cannot."""
    i = skip(text, i)
    for option in options:
        if text.startswith(option, i):
            return i + len(option), option
    left = len(text) - i   # no text[i:] copy: a held call's text is read again at every delta
    if any(left < len(o) and o.startswith(text[i:]) for o in options):
        return MORE, ""
    return -1, ""


class Header(NamedTuple):
    name: str
    args: int   # index of the arguments' `{`


_KEYS = ('"arguments"', '"parameters"')


def header(text: str, i: int, skip=skip_space) -> Header | int:
    """The call object's header at text[i:] (after whitespace), name first as the templates write
    it: `{"name": "<name>", "arguments": {` ("parameters" too). MORE while the text so far is the
    start of one, -1 when it is not one (a call written otherwise is read whole at its end)."""
    name = ""
    for part in ("{", '"name"', ":", None, ",", _KEYS, ":"):
        if part is None:
            at = skip(text, i)
            i = _name(text, at)
            name = text[at + 1:i - 1]
        else:
            i, _ = literal(text, i, part if isinstance(part, tuple) else (part,), skip)
        if i < 0:
            return i
    at = skip(text, i)
    if at == len(text):
        return MORE
    return Header(name, at) if text[at] == "{" else -1


def _name(text: str, i: int) -> int:
    """Index past a quoted name at text[i], MORE while it may still be one, -1 when it is not."""
    if i == len(text):
        return MORE
    if text[i] != '"':
        return -1
    for n in range(i + 1, min(len(text), i + 66)):
        c = text[n]
        if c == '"':
            return n + 1 if n > i + 1 else -1
        if c not in NAME_CHARS:
            return -1
    return MORE if len(text) < i + 66 else -1


class OpenCallFormat(ToolFormat):
    """What every format that streams calls in its own syntax keeps across scans: the calls it
    opened, the open call's arguments, and what it learned about held text (a JSON value's end,
    whitespace runs: rebased between scans, ToolFormat.scan)."""

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.calls = 0
        self.args: ArgsReader | None = None   # the open call's arguments, not closed yet
        self.json_end = JsonEnd()
        self.spaces, self.isspace = Spaces(), Spaces(isspace=True)   # a held opening's whitespace

    def ended_in_call(self) -> bool:
        return self.args is not None

    def rebase(self, stop: int, start: int) -> None:
        self.json_end.rebase(stop, start)
        self.spaces.rebase(stop, start)
        self.isspace.rebase(stop, start)
