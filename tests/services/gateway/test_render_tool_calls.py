"""Parsed chat answers in responses: the whole answer's message (reasoning_content, content,
tool_calls, finish_reason "tool_calls") and the SSE chunks of the same answer, which assembled by
index give the same message."""
from __future__ import annotations

import json
from functools import partial

import pytest

from services.gateway.chat_output import OutputParsing
from services.gateway.render import Accumulator, ChunkWriter
from services.gateway.tool_parsers import NamedFormat, RequiredFormat, tool_format
from services.protocol.messages import TextDelta

PARSING = OutputParsing("qwen3", partial(tool_format, "hermes", frozenset({"get_weather", "get_time"})))
ANSWER = ('<think>The user wants the weather.</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def whole(text: str, finish: str, parsing: OutputParsing = PARSING, stop_reason: str | None = None) -> dict:
    acc = Accumulator("chat", "m", 1, 1, [4], want_logprobs=False, parsing=parsing)
    acc.add(0, TextDelta("r", 0, text, 9, finish, None, 4, 0, stop_reason=stop_reason))
    return acc.response()["choices"][0]


def streamed(text: str, finish: str, size: int, parsing: OutputParsing = PARSING,
             stop_reason: str | None = None) -> tuple[dict, list[dict]]:
    acc = Accumulator("chat", "m", 1, 1, [4], want_logprobs=False, parsing=parsing)
    w = ChunkWriter(acc, include_usage=False)
    data = w.start()
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        data += w.delta(0, TextDelta("r", 0, piece, 1, finish if last else None, None, 4, 0,
                                     stop_reason=stop_reason if last else None))
    chunks = [json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: ")]
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finishes = []
    for chunk in chunks:
        choice = chunk["choices"][0]
        d = choice["delta"]
        finishes.append(choice["finish_reason"])
        message["content"] += d.get("content") or ""
        message["reasoning_content"] += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            entry = message["tool_calls"].setdefault(tc["index"], {"function": {"arguments": ""}})
            if "id" in tc:
                entry.update(id=tc["id"], type=tc["type"])
                entry["function"]["name"] = tc["function"]["name"]
            entry["function"]["arguments"] += tc["function"]["arguments"]
    assert all(f is None for f in finishes[:-1])
    return message | {"finish_reason": finishes[-1]}, chunks


def calls_of(tool_calls) -> list:
    return [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def test_whole_answer_with_reasoning_and_calls():
    c = whole(ANSWER, "stop")
    m = c["message"]
    assert c["finish_reason"] == "tool_calls"
    assert m["reasoning_content"] == "The user wants the weather." and m["content"] == "Checking.\n\n"
    assert calls_of(m["tool_calls"]) == [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    ids = [t["id"] for t in m["tool_calls"]]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


@pytest.mark.parametrize("size", [1, 3, 8, 1000])
def test_streamed_answer_assembles_to_the_whole_one(size):
    m, chunks = streamed(ANSWER, "stop", size)
    w = whole(ANSWER, "stop")["message"]
    assert m["finish_reason"] == "tool_calls"
    assert m["reasoning_content"] == w["reasoning_content"] and m["content"] == w["content"]
    assert calls_of(m["tool_calls"][i] for i in sorted(m["tool_calls"])) == calls_of(w["tool_calls"])
    assert not any("<tool" in (ch["choices"][0]["delta"].get("content") or "") for ch in chunks)
    headers = [tc for ch in chunks for tc in ch["choices"][0]["delta"].get("tool_calls") or [] if "id" in tc]
    assert [h["function"]["arguments"] for h in headers] == ["", ""]   # arguments follow the header


def test_malformed_call_is_content_and_finish_unchanged():
    """A call not written name first is read whole at its end: text when it is not a valid call."""
    text = '<tool_call>{"arguments": {"city": }, "name": "get_weather"}</tool_call>'
    c = whole(text, "stop")
    assert c["finish_reason"] == "stop" and c["message"]["content"] == text and "tool_calls" not in c["message"]
    assert c["message"]["reasoning_content"] is None
    m, _ = streamed(text, "stop", 2)
    assert m["content"] == text and m["tool_calls"] == {} and m["finish_reason"] == "stop"


def test_bad_json_after_a_streamed_header_stays_the_call():
    """Once `{"name": "<an offered tool>", "arguments": {` is read the call was streamed: it stays a
    call, its arguments as written (not JSON here), whole and streamed alike."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'
    c = whole(text, "stop")
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    assert raw_calls(c["message"]["tool_calls"]) == [("function", "get_weather", '{"city": }')]
    m, _ = streamed(text, "stop", 2)
    assert m["finish_reason"] == "tool_calls" and m["content"] == ""
    assert raw_calls(m["tool_calls"].values()) == raw_calls(c["message"]["tool_calls"])


def test_answer_cut_inside_the_reasoning():
    c = whole("<think>still thinking", "length")
    assert c["message"]["reasoning_content"] == "still thinking" and c["message"]["content"] is None
    assert c["finish_reason"] == "length"
    m, _ = streamed("<think>still thinking", "length", 4)
    assert m["reasoning_content"] == "still thinking" and m["content"] == "" and m["finish_reason"] == "length"


def test_plain_request_is_unchanged():
    c = whole("<think>x</think>hi", "stop", OutputParsing())
    assert c["message"] == {"role": "assistant", "content": "<think>x</think>hi", "refusal": None}


NAMES = frozenset({"get_weather", "get_time"})
NAMED = OutputParsing("none", partial(NamedFormat, NAMES, "get_weather"), forced=True)
REQUIRED = OutputParsing("none", partial(RequiredFormat, NAMES), forced=True)


def raw_calls(tool_calls) -> list:
    return [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]


@pytest.mark.parametrize("parsing, text, calls", [
    (NAMED, '{"city": "Par', [("function", "get_weather", '{"city": "Par')]),
    (REQUIRED, '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Pa',
     [("function", "get_time", "{}"), ("function", "get_weather", '{"city": "Pa')]),
])
def test_a_forced_call_cut_by_max_tokens_is_a_call_with_finish_length(parsing, text, calls):
    """What the openai client reads: tool_calls with the arguments as far as they go, no content,
    finish_reason "length" (OpenAI's and vLLM's shape), whole and streamed alike."""
    c = whole(text, "length", parsing)
    assert c["finish_reason"] == "length" and c["message"]["content"] is None
    assert raw_calls(c["message"]["tool_calls"]) == calls
    m, chunks = streamed(text, "length", 3, parsing)
    assert m["finish_reason"] == "length" and m["content"] == ""
    assert raw_calls(m["tool_calls"][i] for i in sorted(m["tool_calls"])) == calls
    assert all(ch["choices"][0]["delta"].get("content") in (None, "") for ch in chunks)


@pytest.mark.parametrize("stop_reason", [",", 13])
def test_a_forced_call_cut_by_a_stop_keeps_finish_stop(stop_reason):
    """A stop string (or stop token id) that ends a forced call mid-JSON is not the grammar's own
    end: finish_reason stays "stop" (with its stop_reason), not "tool_calls", so a client does
    not run a call with cut arguments."""
    cut = '{"city": "Paris"'
    c = whole(cut, "stop", NAMED, stop_reason)
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", stop_reason)
    assert raw_calls(c["message"]["tool_calls"]) == [("function", "get_weather", cut)]
    assert streamed(cut, "stop", 5, NAMED, stop_reason)[0]["finish_reason"] == "stop"
    # an unforced answer's calls are whole by construction: "tool_calls" whatever ended it
    assert whole(ANSWER + "\nDone", "stop", stop_reason=stop_reason)["finish_reason"] == "tool_calls"


def test_a_whole_forced_call_finishes_with_tool_calls():
    c = whole('{"city": "Paris"}', "stop", NAMED)
    assert c["finish_reason"] == "tool_calls" and calls_of(c["message"]["tool_calls"]) == [
        ("function", "get_weather", {"city": "Paris"})]
    m, chunks = streamed('{"city": "Paris"}', "stop", 5, NAMED)
    assert m["finish_reason"] == "tool_calls" and m["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    # the header and each delta's arguments go out with that delta, not at the answer's end
    fragments = [ch["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for ch in chunks
                 if ch["choices"][0]["delta"].get("tool_calls")]
    assert fragments == ["", '{"cit', 'y": "', "Paris", '"}']
    assert chunks[-1]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == '"}'


def test_auto_answer_cut_by_max_tokens():
    """auto: a call cut before its arguments opened is the model's own text (it may never have been
    a call), as content, with finish_reason "length"; one cut inside its arguments was streamed, so
    it is a call with its arguments as far as they go, and the answer keeps "length" (the client
    must not run it as whole); whole calls followed by cut text finish with "tool_calls"."""
    cut = 'Checking.\n<tool_call>\n{"name": "get_weather", "argu'
    c = whole(cut, "length")
    assert c["finish_reason"] == "length" and c["message"]["content"] == cut and "tool_calls" not in c["message"]
    m, _ = streamed(cut, "length", 4)
    assert m["content"] == cut and m["tool_calls"] == {} and m["finish_reason"] == "length"
    cut += 'ments": {"ci'
    c = whole(cut, "length")
    assert c["finish_reason"] == "length" and c["message"]["content"] == "Checking.\n"
    assert raw_calls(c["message"]["tool_calls"]) == [("function", "get_weather", '{"ci')]
    m, _ = streamed(cut, "length", 4)
    assert m["content"] == "Checking.\n" and m["finish_reason"] == "length"
    assert raw_calls(m["tool_calls"].values()) == raw_calls(c["message"]["tool_calls"])
    after = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Now the wea'
    c = whole(after, "length")
    assert c["finish_reason"] == "tool_calls" and calls_of(c["message"]["tool_calls"]) == [("function", "get_time", {})]
    m, _ = streamed(after, "length", 4)
    assert m["finish_reason"] == "tool_calls" and m["content"] == c["message"]["content"] == " Now the wea"
