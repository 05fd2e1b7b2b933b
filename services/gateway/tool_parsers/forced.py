"""The answer to a forced tool_choice, whatever the model's own call syntax: the gateway asks the
worker to constrain the output to a JSON schema (services/gateway/tools.py), so the whole answer is

    required:        [{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]   (at least one)
    a named function: {"city": "Paris"}                                 (that function's arguments)

A forced answer is nothing but calls, so it is read as it comes: a call's header (its name) goes
out as soon as it is known and its arguments follow in fragments as the text arrives, each one
the new text only (vLLM streams forced calls the same way). A call's `arguments` are the text the
model wrote, from the object's `{` to its `}`, never re-serialized: a stream cannot re-serialize
what it has already sent, and the whole answer must read the same as its stream. With the
worker's grammar (xgrammar, no free whitespace) that text is one line of JSON with json.dumps's
separators, except that strings and numbers keep the model's spelling (`"\\u00e9"`, `1e3`).

    named:     the call's header at once; its arguments are the answer from its first
               non-whitespace character (whitespace after a closed object is dropped)
    required:  an item's header once its `{"name": "<an offered tool>"` is read (the name is
               the first key, as the schema writes it); its arguments from the `{` after
               `"parameters": ` to the matching `}`

Both are one scanner, fed the whole answer at once or delta by delta, so a stream and the whole
answer return the same calls with the same arguments. A forced answer is calls even when
max_tokens or a stop string cut it (as OpenAI and vLLM return it): the client asked for a call and
must never find the call's JSON in `content`. A cut call's arguments are the text as far as it
goes (not JSON):

    named:          {"city": "Par                  -> get_weather({"city": "Par)
                    (always that one call: text that is not a JSON object is its arguments as written)
    required, cut:  [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci
                                                   -> get_time({}), get_weather({"ci)
    required, cut after a call's name, before its arguments' `{`: the call, with the text after
                    "parameters": as its arguments ("" when there is none)
    required, cut before a call's name is complete: that call is left out (no name to give it)

What the schema forbids (a worker bug) cannot undo what a stream has sent, so it never makes
calls vanish. An item that does not open with an offered name is read whole at its end: a call
(arguments re-serialized) if it is a valid one in another form (keys in another order), else left
out. An item whose header was sent stays a call: arguments not written as an object after the
name are read at the item's end (re-serialized, or "" when they are not an object). Text after the
list is ignored; an answer that made no call is text when it is whole JSON (`[]`).
"""
from __future__ import annotations

import re

from services.gateway.tool_parsers.base import (
    MAX_CALLS, CallArgs, CallOpen, Piece, Scan, ToolFormat, arguments_text, as_call, loads)
from services.gateway.tool_parsers.open_call import JsonLexer

# an item's opening as the schema orders it: its name, then its arguments' key (up to their value)
_NAME = re.compile(r'\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"')
_HEAD = re.compile(_NAME.pattern + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*')
_ARGS_KEYS = ("parameters", "arguments")


# where a required answer's reader is:
#   [ {"name": "f", "parameters": {"a": 1}} , {...} ]
#  ^ ^ ^--HEAD----^---NAMED-------^-ARGS---^^ ^        ^
#  | GAP          header sent      (depth 3) TAIL GAP  DONE
#  OPEN    OTHER: an item that does not open with an offered name (no header; read whole at its end)
#          SENT: a named item whose arguments are not where the schema puts them (read whole at its end)
OPEN, GAP, HEAD, NAMED, ARGS, TAIL, OTHER, SENT, DONE = range(9)


class RequiredFormat(ToolFormat):
    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.state = OPEN
        self.lex = JsonLexer()
        self.strings = 0             # strings closed in the current item while in HEAD
        self.item: list[str] = []    # the current item's text, but for its arguments (ARGS, TAIL)
        self.body: list[str] = []    # the answer, kept while it has made no call (then it may be text)
        self.calls = 0

    def scan(self, text: str, start: int, final: bool) -> Scan:
        chunk = text[start:]
        if not self.calls:
            self.body.append(chunk)
        pieces = self._read(chunk) if self.state != DONE else []
        if final:
            pieces += self._end()
        return Scan(pieces, len(text))   # all of it is read: the state carries over

    def _read(self, chunk: str) -> list[Piece]:
        pieces: list[Piece] = []
        state, lex = self.state, self.lex
        mark = 0   # where the current item or arguments (ARGS) begin in this chunk
        for i, c in enumerate(chunk):
            if state == OPEN or state == GAP:
                if c in " \t\r\n" or (c == "," and state == GAP):
                    continue
                if c == "[" and state == OPEN:
                    lex.depth, state = 1, GAP
                elif c == "{" and state == GAP:
                    lex.depth, state, mark, self.strings = 2, HEAD, i, 0
                else:   # "]" ends the list; anything else is not a list of items
                    state = DONE
                    break
                continue
            bracket = lex.read(c)
            if state == HEAD and c == '"' and not lex.in_string:   # a string closed: the name is the 2nd
                self.strings += 1
                if self.strings == 2:
                    state = self._name("".join(self.item) + chunk[mark:i + 1], pieces)
            elif not bracket:
                continue
            elif lex.depth == 3 and c == "{" and state == NAMED:
                if _HEAD.fullmatch("".join(self.item) + chunk[mark:i]):
                    state, self.item, mark = ARGS, [], i
                else:
                    state = SENT
            elif lex.depth == 3 and state == HEAD:   # an object or array before the name
                state = OTHER
            elif lex.depth == 2 and state == ARGS:
                pieces.append(CallArgs(chunk[mark:i + 1]))
                state = TAIL
            elif lex.depth == 1:   # the item closed
                if state != TAIL:
                    self._whole(state, "".join(self.item) + chunk[mark:i + 1], pieces)
                    self.item = []
                state = GAP
        if state == ARGS and mark < len(chunk):
            pieces.append(CallArgs(chunk[mark:]))
        elif state in (HEAD, NAMED, OTHER, SENT):
            self.item.append(chunk[mark:])
        self.state = state
        return pieces

    def _name(self, head: str, pieces: list[Piece]) -> int:
        """At an item's second string: a call's header if it is the value of "name", first."""
        m = _NAME.fullmatch(head)
        if m and m.group(1) in self.tool_names and self.calls < MAX_CALLS:
            self.calls += 1
            pieces.append(CallOpen(m.group(1)))
            return NAMED
        return OTHER

    def _whole(self, state: int, item: str, pieces: list[Piece]) -> None:
        """An item read to its end, its arguments not streamed: a call if it is a valid one. One
        whose header was sent stays a call, its arguments empty if they are not an object."""
        value = as_call(loads(item), self.tool_names, args_keys=_ARGS_KEYS)
        if value is None:
            return
        if state in (HEAD, OTHER):   # no header sent yet
            if self.calls == MAX_CALLS:
                return
            self.calls += 1
            pieces.append(CallOpen(value[0]))
        pieces.append(CallArgs(arguments_text(value[1])))

    def _end(self) -> list[Piece]:
        pieces: list[Piece] = []
        if self.state in (NAMED, SENT):   # cut inside a named item before its arguments' object
            item = "".join(self.item)
            m = _HEAD.match(item)
            if m:
                pieces.append(CallArgs(item[m.end():]))
        self.state = DONE
        if not self.calls:
            body = "".join(self.body)
            return [body] if loads(body) is not None else []
        return pieces


class NamedFormat(ToolFormat):
    def __init__(self, tool_names: frozenset[str], name: str) -> None:
        super().__init__(tool_names)
        self.name = name
        self.opened = False
        self.started = False      # the arguments' first non-whitespace character was read
        self.closable = False     # they open an object (or array), which ends at its bracket
        self.lex = JsonLexer()
        self.after: list[str] | None = None   # the text after the closed object

    def scan(self, text: str, start: int, final: bool) -> Scan:
        pieces: list[Piece] = [] if self.opened else [CallOpen(self.name)]
        self.opened = True
        chunk = text[start:]
        if not self.started:
            chunk = chunk.lstrip()
            self.started = bool(chunk)
            self.closable = chunk[:1] in ("{", "[")
        if self.after is None:
            end = self._close(chunk)
            if end >= 0:
                chunk, self.after = chunk[:end], [chunk[end:]]
            if chunk:
                pieces.append(CallArgs(chunk))
        else:
            self.after.append(chunk)
        if final and self.after is not None:
            after = "".join(self.after)
            if after.strip():   # more than whitespace after the object (the schema forbids it): kept
                pieces.append(CallArgs(after))
            self.after = []
        return Scan(pieces, len(text))

    def _close(self, chunk: str) -> int:
        """Index in chunk just past the arguments' closing bracket, or -1."""
        if not self.closable:
            return -1
        for i, c in enumerate(chunk):
            if self.lex.read(c) and self.lex.depth == 0:
                return i + 1
        return -1
