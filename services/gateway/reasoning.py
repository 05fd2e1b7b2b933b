"""Reasoning output: the `<think>...</think>` block of a thinking model split from its answer,
returned as `reasoning_content` (vLLM's field) beside `content`.

    qwen3        the answer thinks only when it opens with `<think>` (Qwen3: the model writes it;
                 with enable_thinking false its template closes the block in the prompt)
    deepseek_r1  the answer starts inside the block (the template opened it in the prompt, as
                 DeepSeek-R1 and Qwen3's thinking-only models do); a `<think>` it writes anyway is
                 dropped. An answer that never closes the block is reasoning whole.

The content after `</think>` starts at its first non-space character. `split` reads a whole
answer; `ReasoningStream` the same answer delta by delta, with the same result.
"""
from __future__ import annotations

from typing import NamedTuple

from services.gateway.tool_parsers.base import held_prefix

START, END = "<think>", "</think>"


class Split(NamedTuple):
    reasoning: str | None
    content: str | None


def split(parser: str, text: str) -> Split:
    stream = ReasoningStream(parser)
    a, b = stream.feed(text), stream.finish()
    reasoning = a.reasoning + b.reasoning
    content = a.content + b.content
    if not stream.thought:
        return Split(None, content)
    return Split(reasoning, content or None)


class Step(NamedTuple):
    reasoning: str
    content: str


class ReasoningStream:
    def __init__(self, parser: str) -> None:
        self.state = "opening" if parser == "qwen3" else "opening_r1"
        self.pending = ""          # text that may still be (part of) a tag
        self.thought = False       # the answer has a reasoning part

    def feed(self, delta: str) -> Step:
        self.pending += delta
        reasoning, content = [], []
        while self.pending:
            if self.state in ("opening", "opening_r1"):
                lead = self.pending.lstrip()
                if START.startswith(lead) and len(lead) < len(START):
                    break                                  # may still become <think>
                if lead.startswith(START):
                    self.pending, self.state, self.thought = lead[len(START):], "thinking", True
                elif self.state == "opening_r1":
                    self.state, self.thought = "thinking", True
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                end = self.pending.find(END)
                if end < 0:
                    keep = held_prefix(self.pending, END)
                    reasoning.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                reasoning.append(self.pending[:end])
                self.pending, self.state = self.pending[end + len(END):], "after"
            elif self.state == "after":
                self.pending = self.pending.lstrip()
                if self.pending:
                    self.state = "answer"
            else:
                content.append(self.pending)
                self.pending = ""
        return Step("".join(reasoning), "".join(content))

    def finish(self) -> Step:
        """The end of the answer: what was held as a possible tag is what it looked like."""
        rest, self.pending = self.pending, ""
        if self.state == "thinking":
            return Step(rest, "")
        if self.state == "after":
            return Step("", "")
        if self.state == "opening_r1":
            self.thought = True
            return Step(rest, "")
        return Step("", rest)
