"""One chat answer's text, split into what the client reads: reasoning, content and tool calls.

    answer text ──reasoning.py──► reasoning_content
                        └──────► content ──tool_parsers──► content, tool_calls

`OutputParsing` is what a request asked for (made once per request, services/gateway/tools.py);
`parse_answer` reads a whole answer, `AnswerStream` the same answer delta by delta (one per choice).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from services.gateway import reasoning
from services.gateway.tool_parsers import StreamingParser, ToolCall, ToolCallDelta, ToolFormat, parse


@dataclass(frozen=True)
class OutputParsing:
    reasoning: str = "none"                                  # qwen3, deepseek_r1 (reasoning.py) or none
    tool_format: Callable[[], ToolFormat] | None = None      # a fresh call scanner per answer; None: no calls
    # a forced tool_choice: the answer is nothing but calls, so an answer cut short is a call cut
    # short and keeps its finish_reason ("length"); an unforced answer with calls finishes with
    # "tool_calls" unless it was cut inside a call's arguments (streamed: tool_parsers/open_call.py)
    forced: bool = False
    # parallel_tool_calls false: 1, and calls past the first are dropped (vLLM's); None: all
    max_calls: int | None = None
    # include_reasoning false (vLLM's): the reasoning is split off as usual, then left out
    include_reasoning: bool = True

    @property
    def active(self) -> bool:
        return self.reasoning != "none" or self.tool_format is not None

    def finish_with_calls(self, finish_reason: str | None, stop_reason: str | int | None,
                          cut: bool = False) -> str | None:
        """The finish_reason of an answer that returned calls: "tool_calls", except that an answer
        whose last call is not whole keeps its reason, so a client sees that the call's arguments
        may be cut short ("length"; "stop" when a stop string or stop token id cut it: stop_reason
        names it): a forced answer that did not end on its own, or an unforced one that ended
        inside a call's arguments (`cut`)."""
        ended_by_grammar = finish_reason == "stop" and stop_reason is None
        if finish_reason is None or cut or (self.forced and not ended_by_grammar):
            return finish_reason
        return "tool_calls"

    def cut_in_kept_call(self, cut: bool, num_calls: int) -> bool:
        """Whether the answer ended inside a call the client gets: with max_calls, a cut call past
        it was dropped, and the calls returned are whole."""
        return cut and (self.max_calls is None or num_calls <= self.max_calls)


PLAIN = OutputParsing()


class Answer(NamedTuple):
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    cut: bool = False        # it ended inside a call's arguments


class AnswerDelta(NamedTuple):
    reasoning: str
    content: str
    tool_calls: list[ToolCallDelta]


def parse_answer(parsing: OutputParsing, text: str) -> Answer:
    thought, content = (None, text) if parsing.reasoning == "none" else reasoning.split(parsing.reasoning, text)
    if parsing.tool_format is None or content is None:
        return Answer(thought, content, [])
    parsed = parse(parsing.tool_format(), content)
    body = parsed.content
    if thought is not None and not body:
        body = None
    return Answer(thought, body, parsed.tool_calls, parsed.cut)


class AnswerStream:
    def __init__(self, parsing: OutputParsing) -> None:
        self.thinking = None if parsing.reasoning == "none" else reasoning.ReasoningStream(parsing.reasoning)
        self.calls = None if parsing.tool_format is None else StreamingParser(parsing.tool_format())

    @property
    def num_calls(self) -> int:
        return self.calls.num_calls if self.calls is not None else 0

    @property
    def cut(self) -> bool:
        """After finish(): the answer ended inside a call's arguments."""
        return self.calls is not None and self.calls.cut

    def feed(self, text: str) -> AnswerDelta:
        step = self.thinking.feed(text) if self.thinking is not None else reasoning.Step("", text)
        return self._content(step, self.calls.feed(step.content) if self.calls is not None else None)

    def finish(self) -> AnswerDelta:
        step = self.thinking.finish() if self.thinking is not None else reasoning.Step("", "")
        if self.calls is None:
            return self._content(step, None)
        a = self.calls.feed(step.content)
        b = self.calls.finish()
        return AnswerDelta(step.reasoning, a.content + b.content, a.calls + b.calls)

    @staticmethod
    def _content(step: reasoning.Step, calls) -> AnswerDelta:
        if calls is None:
            return AnswerDelta(step.reasoning, step.content, [])
        return AnswerDelta(step.reasoning, calls.content, calls.calls)
