"""A forced tool_choice's answer (tool_parsers/forced.py), whole and streamed: fed at every split
point and one character at a time, the stream assembles exactly the whole answer's calls, argument
text included, and sends each call's header and argument fragments as soon as they are certain."""
from __future__ import annotations

import time

import pytest

from services.gateway.tool_parsers import NamedFormat, RequiredFormat, StreamingParser, parse
from services.gateway.tool_parsers.base import MAX_CALLS

TOOLS = frozenset({"get_weather", "get_time"})

# (tool_choice, answer, content, calls [(name, arguments as returned)])
WHOLE = [   # what the worker's grammar writes, whole: arguments as written
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}, '
                 '{"name": "get_time", "parameters": {}}]',
     None, [("get_weather", '{"city": "Paris", "unit": "°C"}'), ("get_time", "{}")]),
    ("required", r'[{"name": "get_time", "parameters": {"s": "a}]\"{[", "n": [1, {"k": null}]}}]',
     None, [("get_time", r'{"s": "a}]\"{[", "n": [1, {"k": null}]}')]),
    ("required", r'[{"name": "get_weather", "parameters": {"city": "Z\u00fcrich", "t": 1e3}}]',
     None, [("get_weather", r'{"city": "Z\u00fcrich", "t": 1e3}')]),   # the model's spelling kept
    ("required", '[\n  {"name": "get_time",\n   "parameters": { "a" : 1 }\n  }\n]',
     None, [("get_time", '{ "a" : 1 }')]),
    ("get_weather", '{"city": "Paris", "unit": "°C"}', None, [("get_weather", '{"city": "Paris", "unit": "°C"}')]),
    ("get_weather", ' \n{"city": "Paris"}\n ', None, [("get_weather", '{"city": "Paris"}')]),
]
CUT = [   # cut by max_tokens or a stop string: calls, the last as far as it goes, never content
    ("get_weather", '{"city": "Par', None, [("get_weather", '{"city": "Par')]),
    ("get_weather", "", None, [("get_weather", "")]),
    ("get_weather", "random words", None, [("get_weather", "random words")]),   # not JSON: still the call
    ("required", '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci',
     None, [("get_time", "{}"), ("get_weather", '{"ci')]),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}} , \n{"name": "get_time", "arguments": ',
     None, [("get_weather", '{"city": "Paris"}'), ("get_time", "")]),
    ("required", '[{"name": "get_time", "parameters": {"a": 1}', None, [("get_time", '{"a": 1}')]),
    ("required", '[{"name": "get_time", "parameters": ', None, [("get_time", "")]),
    ("required", '[{"name": "get_time", "param', None, [("get_time", "")]),   # its header was sent
    ("required", '[{"name": "get_time"', None, [("get_time", "")]),
    ("required", '[{"name": "get_time", "parameters": {}}, ', None, [("get_time", "{}")]),
    ("required", '[{"name": "get_time", "parameters": {}}, {"name": "get_we', None, [("get_time", "{}")]),
    ("required", '[{"name": "get_ti', None, []),
    ("required", '[{"name": "rm_rf", "parameters": {"x', None, []),
    ("required", "", None, []),
]
FORBIDDEN = [   # what the schema forbids (a worker bug): calls the stream sent are never taken back
    ("required", "[]", "[]", []),
    ("required", '{"name": "get_time", "parameters": {}}', '{"name": "get_time", "parameters": {}}', []),
    ("required", '[{"name": "rm_rf", "parameters": {}}]', '[{"name": "rm_rf", "parameters": {}}]', []),
    ("required", '[{"parameters": {"a": 1}, "name": "get_time"}]', None, [("get_time", '{"a": 1}')]),
    ("required", '[{"name": "get_time", "arguments": "{\\"a\\": 1}"}]', None, [("get_time", '{"a": 1}')]),
    ("required", '[{"name": "get_time"}]', None, [("get_time", "{}")]),
    ("required", '[{"name": "get_time", "x": {"a": 1}}]', None, [("get_time", "{}")]),
    ("required", '[{"name": "get_time", "parameters": 5}]', None, [("get_time", "")]),   # sent: kept
    ("required", '[{"name": "get_time", "parameters": {}}, 5, {"name": "rm_rf", "parameters": {}}]',
     None, [("get_time", "{}")]),
    ("required", '[{"name": "get_time", "parameters": {"x": NaN}}, {"name": "get_time", "parameters": {"s": "}{',
     None, [("get_time", '{"x": NaN}'), ("get_time", '{"s": "}{')]),
    ("required", '[{"name": "get_time", "parameters": {}}] and more', None, [("get_time", "{}")]),
    ("get_weather", '{"city": "Paris"} and more', None, [("get_weather", '{"city": "Paris"} and more')]),
]


def make(choice: str):
    return RequiredFormat(TOOLS) if choice == "required" else NamedFormat(TOOLS, choice)


def assemble(steps) -> tuple[str | None, list[tuple[str, str]]]:
    """What the openai client builds from the steps: content (None when only space: a forced
    answer's content is all or nothing) and calls [(name, arguments)]; each call's first delta has
    its id and empty arguments."""
    content, calls = "", {}
    for step in steps:
        content += step.content
        for d in step.calls:
            if d.id is not None:
                assert d.index not in calls and d.index == len(calls) and d.id.startswith("call_")
                assert d.arguments == ""
                calls[d.index] = [d.name, ""]
            else:
                assert d.arguments, "an argument fragment is never empty"
                calls[d.index][1] += d.arguments
    return (content if content.strip() else None), [tuple(c) for c in calls.values()]


def stream(choice: str, pieces: list[str]):
    parser = StreamingParser(make(choice))
    return assemble([parser.feed(p) for p in pieces] + [parser.finish()])


@pytest.mark.parametrize("choice,text,content,calls", WHOLE + CUT + FORBIDDEN)
def test_the_stream_assembles_the_whole_answer_at_every_split(choice, text, content, calls):
    parsed = parse(make(choice), text)
    assert (parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]) == (content, calls)
    assert stream(choice, list(text)) == (content, calls)
    for cut in range(len(text) + 1):
        assert stream(choice, [text[:cut], text[cut:]]) == (content, calls), cut


def test_a_required_call_streams_as_its_text_arrives():
    """Fed one character at a time: a call's header once its name's closing quote is read (never
    for a name still being written), then every character of its arguments as it comes."""
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    parser = StreamingParser(RequiredFormat(TOOLS))
    opened_at, args = [], {}
    start = text.index('{"city"')
    for i, c in enumerate(text):
        for d in parser.feed(c).calls:
            if d.id is not None:
                opened_at.append(i)
            args[d.index] = args.get(d.index, "") + d.arguments
        if opened_at and i < text.index("}}"):   # nothing held back
            assert args[0] == text[start:i + 1]
    assert opened_at == [text.index(f'{name}"') + len(name) for name in ("get_weather", "get_time")]
    assert args == {0: '{"city": "Paris"}', 1: "{}"}
    assert parser.finish() == ("", [])


def test_a_named_call_opens_at_once():
    parser = StreamingParser(NamedFormat(TOOLS, "get_weather"))
    [head] = parser.feed("").calls
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "") and head.id
    got = "".join(d.arguments for c in '{"city": "Pa' for d in parser.feed(c).calls)
    assert got == '{"city": "Pa'


def test_calls_are_bounded():
    text = "[" + ", ".join(['{"name": "get_time", "parameters": {}}'] * (MAX_CALLS + 5)) + "]"
    assert len(parse(RequiredFormat(TOOLS), text).tool_calls) == MAX_CALLS
    _, calls = stream("required", [text[i:i + 7] for i in range(0, len(text), 7)])
    assert len(calls) == MAX_CALLS


@pytest.mark.parametrize("choice, opening", [("required", '[{"name": "get_time", "parameters": {"s": "'),
                                             ("get_weather", '{"city": "')])
def test_long_arguments_stream_in_linear_time(choice, opening):
    """Long arguments (code, a document): each delta costs its own length, and goes out at once."""
    parser = StreamingParser(make(choice))
    start = time.perf_counter()
    parser.feed(opening)
    for _ in range(20_000):
        [d] = parser.feed("x, y, [{}] ").calls
        assert d.arguments == "x, y, [{}] "
    assert parser.finish() == ("", [])
    assert time.perf_counter() - start < 10
