"""What every tool-call format shares: the call types, the whole-text parse, the incremental parse.

A format is a scanner over the generated text (after any reasoning): `scan(text, start, final)`
reads text[start:] and returns the pieces it is sure of (plain text, or a complete call with its
raw text) and where it stopped. It stops before anything that may still become a call (a partial
`<tool_call>` tag, a call's opening not complete yet, a call read whole that is not closed yet),
which a later scan sees again with more text. The whole-text
parse is one final scan; the streaming parser scans the unsure tail after each delta, so both
produce the same pieces and a stream never shows a call the whole answer would not:

    text:    "Sure. <tool_call>{...}</tool_call>  <tool_c"
    pieces:  [text "Sure. "] [call {...}] [text "  "]        held: "<tool_c" (not final)

A call read whole at its end whose body is not a valid call (bad JSON, a function the request did
not offer, arguments that are not an object) is a text piece: the client gets it as content, never
an error.

A call need not wait to be whole: once a scanner is sure of a call's opening it gives it
(`CallOpen`, the name) and then the call's arguments as they come (`CallArgs`, each the new text
only). The stream turns them into the header delta and argument deltas; the whole-text parse joins
them, so both agree exactly. What the rest of such a call turns out to be cannot take it back: its
arguments are the text as written (not checked, not re-serialized), as far as the answer goes.

    auto formats (open_call.py): opened at `{"name": "<an offered tool>", "arguments": {`; a call
        written otherwise (arguments first, arguments as a string) is a whole `Call` at its end
    forced.py: a forced answer is nothing but calls (a named one opens at once)

Content is None when calls were parsed and nothing but whitespace was said besides them.
"""
from __future__ import annotations

import json
import secrets
from typing import Any, NamedTuple

MAX_CALLS = 128   # calls parsed from one answer; past it, the rest stays text


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str   # a JSON object, serialized

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallDelta(NamedTuple):
    """One `delta.tool_calls` entry: the header (id, name, empty arguments) first, then arguments."""
    index: int
    id: str | None
    name: str | None
    arguments: str

    def as_dict(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class Parsed(NamedTuple):
    content: str | None
    tool_calls: list[ToolCall]
    cut: bool = False    # the answer ended inside a call's arguments (ToolFormat.ended_in_call)


class StreamStep(NamedTuple):
    content: str
    calls: list[ToolCallDelta]


class Call(NamedTuple):
    """A call read whole: its raw text, and (name, arguments) when it is a valid call (the arguments
    an object, serialized by arguments_text)."""
    raw: str
    value: tuple[str, dict] | None


class CallOpen(NamedTuple):
    """A call whose arguments follow as CallArgs pieces, streamed as written. A scanner opens at
    most MAX_CALLS calls in all (whole `Call`s counted)."""
    name: str


class CallArgs(NamedTuple):
    """More of the last opened call's arguments."""
    text: str


Piece = str | Call | CallOpen | CallArgs   # plain text, a whole call, or a call in parts


class Scan(NamedTuple):
    pieces: list[Piece]
    stop: int          # text[:stop] is covered by the pieces; the rest is not decided yet


def new_call_id() -> str:
    """Server-assigned, random: a client cannot predict or choose another request's call ids."""
    return "call_" + secrets.token_hex(12)


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker` (may become it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class JsonEnd:
    """Index just past the JSON object or array opening at text[start], or -1 when it is not closed
    yet. Brackets are counted outside strings only; the value is not checked here.

    A stream asks again about the same held value each time more text arrived: the count resumes
    where it stopped (the lexer's state is kept, keyed by the value's position), and a closed
    value's end is remembered, so a long value costs its length once instead of once per delta.
    The scanner calls `rebase` between scans (ToolFormat.scan), as its text is cut at each stop."""

    def __init__(self) -> None:
        self.at = -1       # where the value counted so far opens (-1: none)
        self.pos = 0       # text[at:pos] is counted
        self.end = -1      # past its closing bracket, once found
        self.depth, self.in_string, self.escaped = 0, False, False

    def rebase(self, stop: int, start: int) -> None:
        """The previous scan stopped at `stop`; the next one's text starts there, at `start`."""
        if self.at < stop:
            self.at = -1
            return
        shift = start - stop
        self.at, self.pos = self.at + shift, self.pos + shift
        if self.end >= 0:
            self.end += shift

    def __call__(self, text: str, start: int) -> int:
        if start != self.at:
            self.at, self.pos, self.end = start, start, -1
            self.depth, self.in_string, self.escaped = 0, False, False
        if self.end >= 0:
            return self.end
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        for i in range(self.pos, len(text)):
            c = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self.end = i + 1
                    return self.end
        self.pos, self.depth, self.in_string, self.escaped = len(text), depth, in_string, escaped
        return -1


def loads(raw: str) -> Any:
    """JSON, or None when it is not JSON (NaN and Infinity are not JSON either)."""
    def no_constant(name: str) -> Any:
        raise ValueError(name)
    try:
        return json.loads(raw, parse_constant=no_constant)
    except (ValueError, RecursionError):
        return None


def as_call(value: Any, tool_names: frozenset[str], name_key: str = "name",
            args_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, dict] | None:
    """(name, arguments) of a decoded call object, or None when it is not a valid call: the name
    must be one of the request's tools and the arguments an object (a string holding a JSON object
    is taken too, as some models write it)."""
    if not isinstance(value, dict) or not isinstance(value.get(name_key), str):
        return None
    name = value[name_key]
    if name not in tool_names:
        return None
    args = next((value[k] for k in args_keys if k in value), {})
    if isinstance(args, str):
        args = loads(args)
    return (name, args) if isinstance(args, dict) else None


def arguments_text(args: dict | str) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class ToolFormat:
    """A scanner of one model family's call syntax (one instance per answer: it may keep state)."""

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.tool_names = tool_names
        self.stopped = 0   # where the previous scan stopped: the next scan's `start` is there

    def scan(self, text: str, start: int, final: bool) -> Scan:
        self.rebase(self.stopped, start)
        result = self.read(text, start, final)
        self.stopped = result.stop
        return result

    def read(self, text: str, start: int, final: bool) -> Scan:
        """One scan (`scan` keeps what the format learned about held text across scans)."""
        raise NotImplementedError

    def rebase(self, stop: int, start: int) -> None:
        """Positions the format keeps in held text move: the previous scan's text from `stop` is
        this scan's text from `start` (with more after it); what was before `stop` is gone."""

    def ended_in_call(self) -> bool:
        """After the final scan: the answer ended inside an opened call's arguments (cut by
        max_tokens, a stop string or EOS), so its arguments are not whole."""
        return False


def parse(fmt: ToolFormat, text: str) -> Parsed:
    """The whole answer's content and calls; calls past MAX_CALLS stay text."""
    pieces = fmt.scan(text, 0, True).pieces
    calls: list[list[str]] = []   # [name, arguments]
    content: list[str] = []
    for p in pieces:
        if isinstance(p, CallOpen):   # a scanner opens at most MAX_CALLS calls
            calls.append([p.name, ""])
        elif isinstance(p, CallArgs):
            calls[-1][1] += p.text
        elif isinstance(p, Call) and p.value is not None and len(calls) < MAX_CALLS:
            calls.append([p.value[0], arguments_text(p.value[1])])
        else:
            content.append(p.raw if isinstance(p, Call) else p)
    tool_calls = [ToolCall(new_call_id(), name, args) for name, args in calls]
    body = "".join(content)
    cut = bool(calls) and fmt.ended_in_call()
    if (calls or not pieces) and not body.strip():   # no pieces: a forced answer cut before its first call
        return Parsed(None, tool_calls, cut)
    return Parsed(body, tool_calls, cut)


class StreamingParser:
    """The same parse, fed the answer delta by delta: content deltas and call deltas as soon as
    they are certain. Whitespace is held while nothing else has been said, so that an answer of
    calls alone streams no content (as its whole-text parse has none)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""            # the part of the answer not scanned into pieces yet
        self.stop = 0             # where the next scan starts (text before it was dropped)
        self.num_calls = 0
        self.said = False         # content other than whitespace was sent
        self.held_space: list[str] = []   # whitespace content not sent yet (nothing else said so far)

    def feed(self, delta: str) -> StreamStep:
        # appended while no other reference holds the text, so CPython grows it in place: a text
        # held across deltas (a call not decided yet) is not copied whole at every delta
        text, self.text = self.text, ""
        text += delta
        self.text = text
        return self._scan(final=False)

    @property
    def cut(self) -> bool:
        """After finish(): the answer ended inside a call's arguments."""
        return self.num_calls > 0 and self.fmt.ended_in_call()

    def finish(self) -> StreamStep:
        step = self._scan(final=True)
        content = step.content
        if self.held_space and not self.num_calls:
            content, self.held_space = content + "".join(self.held_space), []
        return StreamStep(content, step.calls)

    def _scan(self, final: bool) -> StreamStep:
        scan = self.fmt.scan(self.text, self.stop, final)
        self.text, self.stop = self.text[scan.stop:], 0   # scanned text is never read again
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for piece in scan.pieces:
            if isinstance(piece, CallOpen):
                calls.append(ToolCallDelta(self.num_calls, new_call_id(), piece.name, ""))
                self.num_calls += 1
            elif isinstance(piece, CallArgs):
                if piece.text:
                    calls.append(ToolCallDelta(self.num_calls - 1, None, None, piece.text))
            elif isinstance(piece, Call) and piece.value is not None and self.num_calls < MAX_CALLS:
                name, args = piece.value
                calls.append(ToolCallDelta(self.num_calls, new_call_id(), name, ""))
                calls.append(ToolCallDelta(self.num_calls, None, None, arguments_text(args)))
                self.num_calls += 1
            else:
                content.append(self._content(piece.raw if isinstance(piece, Call) else piece))
        return StreamStep("".join(content), calls)

    def _content(self, text: str) -> str:
        if self.said:
            return text
        if not text.strip():
            self.held_space.append(text)   # a list: `+=` on an attribute copies the whole string
            return ""
        self.said = True
        self.held_space.append(text)
        text, self.held_space = "".join(self.held_space), []
        return text
