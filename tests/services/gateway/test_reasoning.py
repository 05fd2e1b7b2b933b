"""The reasoning split on fixed outputs, whole and streamed one character at a time, and with
tool calls after the reasoning."""
from __future__ import annotations

import json

import pytest

from services.gateway import reasoning
from services.gateway.chat_output import AnswerStream, OutputParsing, parse_answer
from services.gateway.tool_parsers import tool_format

CASES = [
    ("qwen3", "<think>\nThe user greets.\n</think>\n\nHello!", "\nThe user greets.\n", "Hello!"),
    ("qwen3", "Hello without thinking.", None, "Hello without thinking."),
    ("qwen3", "  <think>short</think>", "short", None),
    ("qwen3", "<think>cut by max_tokens </thi", "cut by max_tokens </thi", None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "a </think> b", None, "a </think> b"),
    ("deepseek_r1", "The user greets.\n</think>\n\nHello!", "The user greets.\n", "Hello!"),
    ("deepseek_r1", "<think>R</think>C", "R", "C"),
    ("deepseek_r1", "all reasoning, never closed", "all reasoning, never closed", None),
    ("deepseek_r1", "<th", "<th", None),
    ("deepseek_r1", "", "", None),
]


def streamed(parser: str, text: str, size: int) -> tuple[str | None, str | None]:
    stream = reasoning.ReasoningStream(parser)
    steps = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
    thought = "".join(s.reasoning for s in steps)
    content = "".join(s.content for s in steps)
    if not stream.thought:
        return None, content
    return thought, content or None


@pytest.mark.parametrize("parser,text,thought,content", CASES)
def test_split(parser, text, thought, content):
    assert reasoning.split(parser, text) == (thought, content)
    for size in (1, 2, 5, max(1, len(text))):
        assert streamed(parser, text, size) == (thought, content)


def test_tool_calls_after_reasoning():
    parsing = OutputParsing("qwen3", lambda: tool_format("hermes", frozenset({"get_time"})))
    text = ('<think>I need the time. <tool_call>{"name": "get_time", "arguments": {}}</tool_call> is how.</think>\n\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    whole = parse_answer(parsing, text)
    assert whole.reasoning.startswith("I need the time. <tool_call>") and whole.content is None
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_time", {"tz": "UTC"})]
    stream = AnswerStream(parsing)
    steps = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert "".join(s.reasoning for s in steps) == whole.reasoning
    assert "".join(s.content for s in steps) == ""
    args = "".join(d.arguments for s in steps for d in s.tool_calls)
    assert json.loads(args) == {"tz": "UTC"} and stream.num_calls == 1
