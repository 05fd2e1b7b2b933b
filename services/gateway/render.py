"""OpenAI response shapes: whole responses (Accumulator) and SSE chunks (ChunkWriter).

Choice index = prompt_index * n + sample_index (completions with several prompts, as OpenAI).
A chat answer parsed for reasoning or tool calls (chat_output.py) carries `reasoning_content`
and `tool_calls` beside `content`, whole or streamed (`delta.reasoning_content`, and per call a
`delta.tool_calls` entry with its id, type and name, then its arguments: in one entry for a call
the model wrote in its own syntax, in fragments as generated for a forced one), and ends with
finish_reason "tool_calls" when it called a tool (a forced call cut by max_tokens keeps "length",
one cut by a stop string or stop token id keeps "stop").

prompt_logprobs (vLLM's, whole answers only): per prompt token `null` for the first, then
{"<token id>": {"logprob", "rank", "decoded_token"}} for the token and its top alternatives; on each
completion choice (its prompt's), at the top of a chat answer. A completion's echo (vLLM's, OpenAI's
legacy) begins each choice's text with its prompt and, with logprobs, its logprobs with the
prompt's tokens' (the first with a null logprob and top_logprobs); streamed, on each choice's
first chunk. With echo_only (max_tokens 0) the drawn token is left out.

Every logprob answered, generated or prompt, whole or streamed, is at least MIN_LOGPROB: -inf as
-9999.0, as vLLM (JSON has no -inf; msgspec would write null).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway.chat_output import PLAIN, AnswerDelta, AnswerStream, OutputParsing, parse_answer
from services.protocol.messages import PromptLogprobText, TextDelta, TokenLogprobText

_json = msgspec.json.Encoder()
MIN_LOGPROB = -9999.0      # vLLM's stand-in for -inf (JSON has none), in every logprob answered


def _lp(logprob: float) -> float:
    """A logprob as vLLM answers it: -inf (a token the logits rule out, or an underflow) as MIN_LOGPROB."""
    return max(logprob, MIN_LOGPROB)


@dataclass
class _Choice:
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    tokens: int = 0
    logprobs: list[TokenLogprobText] = field(default_factory=list)
    text_offset: int = 0
    answer: AnswerStream | None = None   # a streamed chat answer being parsed
    echoed: bool = False                 # a streamed echo went out on the choice's first chunk


@dataclass(frozen=True)
class PromptEcho:
    """What a completion answers of its prompts (schemas.completion_prompts)."""
    texts: list[str] | None = None    # echo: each prompt's text, which its choices' text begins with
    echo_only: bool = False           # echo with max_tokens 0: the drawn token is left out
    prompt_logprobs: bool = False     # the request set prompt_logprobs: the choices carry them


class Accumulator:
    def __init__(self, kind: str, model: str, n: int, num_prompts: int, prompt_lens: list[int],
                 want_logprobs: bool, parsing: OutputParsing = PLAIN, echo: str = "",
                 prompt: PromptEcho = PromptEcho()) -> None:
        self.kind, self.model, self.n = kind, model, n
        self.echo = echo      # a chat's echo (schemas.chat_echo): each answer's content begins with it
        self.prompt = prompt
        self.prompt_lp: list[list[PromptLogprobText] | None] = [None] * num_prompts   # as they came
        self.parsing = parsing
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_lens = prompt_lens
        self.want_logprobs = want_logprobs
        self.choices = [_Choice() for _ in range(n * num_prompts)]
        self.cached = [0] * num_prompts

    def index_of(self, prompt_index: int, d: TextDelta) -> int:
        return prompt_index * self.n + d.index

    def add(self, prompt_index: int, d: TextDelta) -> int:
        i = self.index_of(prompt_index, d)
        c = self.choices[i]
        if d.prompt_logprobs is not None and self.prompt_lp[prompt_index] is None:   # a re-run's are the same
            self.prompt_lp[prompt_index] = d.prompt_logprobs
        c.tokens += d.num_new_tokens
        if self.prompt.echo_only:
            d = msgspec.structs.replace(d, text="", logprobs=[] if d.logprobs is not None else None)
        if d.text:
            c.parts.append(d.text)
        if d.logprobs:
            c.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            c.finish_reason = "stop" if d.finish_reason == "abort" else d.finish_reason
            c.stop_reason = d.stop_reason
        self.cached[prompt_index] = max(self.cached[prompt_index], d.num_cached_tokens)
        return i

    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_lens)
        completion = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached)}}

    # ---- logprobs shapes -----------------------------------------------------------------
    def chat_logprobs(self, items: list[TokenLogprobText]) -> dict[str, Any]:
        return {"content": [{"token": t.token, "logprob": _lp(t.logprob), "bytes": t.token_bytes,
                             "top_logprobs": [{"token": a, "logprob": _lp(lp), "bytes": b} for a, lp, b in t.top]}
                            for t in items], "refusal": None}

    def completion_logprobs(self, c: _Choice, items: list[TokenLogprobText],
                            prompt: list[PromptLogprobText] = ()) -> dict[str, Any]:
        """`prompt`: an echo's prompt tokens, before the generated ones."""
        tokens: list[str] = []
        logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets = []
        for e in prompt:
            offsets.append(c.text_offset)
            c.text_offset += len(e.token)
            tokens.append(e.token)
            logprobs.append(None if e.logprob is None else _lp(e.logprob))
            tops.append(None if e.logprob is None else {e.token: _lp(e.logprob), **{a: _lp(lp) for _, a, lp in e.top}})
        for t in items:
            offsets.append(c.text_offset)
            c.text_offset += len(t.token)
        # the sampled token first, then the most likely ones: up to logprobs + 1 entries, as OpenAI's
        # legacy completions and vLLM give them (logprobs=0: the sampled token alone)
        return {"tokens": tokens + [t.token for t in items],
                "token_logprobs": logprobs + [_lp(t.logprob) for t in items],
                "top_logprobs": tops + [{t.token: _lp(t.logprob), **{a: _lp(lp) for a, lp, _ in t.top}} for t in items],
                "text_offset": offsets}

    def prompt_logprobs(self, prompt_index: int) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs of one prompt (None where the engine sent none)."""
        entries = self.prompt_lp[prompt_index]
        if entries is None:
            return None
        out: list[dict[str, Any] | None] = []
        for e in entries:
            if e.logprob is None:
                out.append(None)
                continue
            d = {str(e.token_id): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": e.token}}
            for rank, (tid, text, lp) in enumerate(e.top, 1):
                d.setdefault(str(tid), {"logprob": _lp(lp), "rank": rank, "decoded_token": text})
            out.append(d)
        return out

    def echo_of(self, i: int) -> tuple[str, list[PromptLogprobText]]:
        """Choice i's echo: its prompt's text and, with logprobs, its prompt's logprobs."""
        if self.prompt.texts is None:
            return "", []
        p = i // self.n
        return self.prompt.texts[p], (self.prompt_lp[p] or []) if self.want_logprobs else []

    # ---- whole response ------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None,
                stop_reason: str | int | None = None) -> tuple[dict[str, Any], str | None]:
        """A chat choice's message and finish_reason. No tool_calls key when the model called no
        tool (as OpenAI); reasoning_content only where a reasoning parser runs and the request did
        not send include_reasoning: false (as vLLM)."""
        if not self.parsing.active:
            return {"role": "assistant", "content": text, "refusal": None}, finish_reason
        answer = parse_answer(self.parsing, text)
        message: dict[str, Any] = {"role": "assistant", "content": answer.content, "refusal": None}
        if self.parsing.reasoning != "none" and self.parsing.include_reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.tool_calls:
            message["tool_calls"] = [call.as_dict() for call in answer.tool_calls[:self.parsing.max_calls]]
            cut = self.parsing.cut_in_kept_call(answer.cut, len(answer.tool_calls))
            finish_reason = self.parsing.finish_with_calls(finish_reason, stop_reason, cut)
        return message, finish_reason
    def response(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.parts)
            if self.kind == "chat":
                lp = self.chat_logprobs(c.logprobs) if self.want_logprobs else None
                message, finish = self.message(text, c.finish_reason, c.stop_reason)
                if self.echo:
                    message["content"] = self.echo + (message["content"] or "")
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish,
                                "stop_reason": c.stop_reason})
            else:
                c.text_offset = 0
                echo_text, echo_lp = self.echo_of(i)
                lp = self.completion_logprobs(c, c.logprobs, echo_lp) if self.want_logprobs else None
                choice = {"index": i, "text": echo_text + text, "logprobs": lp, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}
                if self.prompt.prompt_logprobs:
                    choice["prompt_logprobs"] = self.prompt_logprobs(i // self.n)
                choices.append(choice)
        body = {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage(),
                "system_fingerprint": None}
        if self.kind == "chat" and self.prompt.prompt_logprobs:
            body["prompt_logprobs"] = self.prompt_logprobs(0)
        return body


class ChunkWriter:
    """SSE bytes for a streamed answer; feeds the same Accumulator (for usage).

    stream_options (vLLM's semantics): include_usage adds a last chunk with the usage and no
    choices (the others carry `"usage": null`); continuous_usage_stats with include_usage puts the
    usage so far in every chunk (benchmark tools read it to count tokens per chunk); without
    include_usage it adds nothing (vLLM's should_include_usage)."""

    def __init__(self, acc: Accumulator, include_usage: bool, continuous_usage: bool = False) -> None:
        self.acc, self.include_usage = acc, include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.object = "chat.completion.chunk" if acc.kind == "chat" else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        body: dict[str, Any] = {"id": self.acc.id, "object": self.object, "created": self.acc.created,
                                "model": self.acc.model, "system_fingerprint": None, "choices": choices}
        if self.continuous_usage:
            body["usage"] = self.acc.usage()
        elif self.include_usage:
            body["usage"] = usage
        return b"data: " + _json.encode(body) + b"\n\n"

    def start(self) -> bytes:
        if self.acc.kind != "chat":
            return b""
        deltas = [{"role": "assistant", "content": ""}] + ([{"content": self.acc.echo}] if self.acc.echo else [])
        return b"".join(self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None,
                                      "stop_reason": None}])
                        for i in range(len(self.acc.choices)) for delta in deltas)

    def delta(self, prompt_index: int, d: TextDelta) -> bytes:
        i = self.acc.add(prompt_index, d)
        choice = self.acc.choices[i]
        ended = d.finish_reason is not None
        finish, stop_reason = (choice.finish_reason, choice.stop_reason) if ended else (None, None)
        if not d.text and finish is None and not d.logprobs:
            return b""
        want_lp = self.acc.want_logprobs and d.logprobs is not None
        if self.acc.kind == "chat":
            lp = self.acc.chat_logprobs(d.logprobs) if want_lp else None  # type: ignore[arg-type]
            if self.acc.parsing.active:
                return self._parsed(i, choice, d, lp, finish, stop_reason)
            delta = {"content": d.text} if d.text else {}
            return self._chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish,
                                 "stop_reason": stop_reason}])
        text, items = d.text, d.logprobs
        if self.acc.prompt.echo_only:
            text, items = "", [] if items is not None else None
        echo_text, echo_lp = "", []
        if not choice.echoed:
            choice.echoed = True
            echo_text, echo_lp = self.acc.echo_of(i)
        want_lp = self.acc.want_logprobs and (items is not None or bool(echo_lp))
        lp = self.acc.completion_logprobs(choice, items or [], echo_lp) if want_lp else None
        return self._chunk([{"index": i, "text": echo_text + text, "logprobs": lp, "finish_reason": finish,
                             "stop_reason": stop_reason}])

    def _parsed(self, i: int, choice: _Choice, d: TextDelta, lp: Any, finish: str | None,
                stop_reason: Any) -> bytes:
        """The chunks of one delta of a parsed chat answer: its reasoning and content, then each
        call's entries; logprobs on the first chunk, finish_reason on the last."""
        if choice.answer is None:
            choice.answer = AnswerStream(self.acc.parsing)
        step = choice.answer.feed(d.text) if d.text else AnswerDelta("", "", [])
        if finish is not None:
            end = choice.answer.finish()
            step = AnswerDelta(step.reasoning + end.reasoning, step.content + end.content,
                               step.tool_calls + end.tool_calls)
            if choice.answer.num_calls:
                cut = self.acc.parsing.cut_in_kept_call(choice.answer.cut, choice.answer.num_calls)
                finish = self.acc.parsing.finish_with_calls(finish, stop_reason, cut)
        head: dict[str, Any] = {}
        if step.reasoning and self.acc.parsing.include_reasoning:
            head["reasoning_content"] = step.reasoning
        if step.content:
            head["content"] = step.content
        deltas = [head] if head or lp is not None else []
        limit = self.acc.parsing.max_calls
        deltas += [{"tool_calls": [call.as_dict()]} for call in step.tool_calls if limit is None or call.index < limit]
        if not deltas and finish is not None:
            deltas = [{}]
        last = len(deltas) - 1
        return b"".join(self._chunk([{"index": i, "delta": delta, "logprobs": lp if k == 0 else None,
                                      "finish_reason": finish if k == last else None,
                                      "stop_reason": stop_reason if k == last else None}])
                        for k, delta in enumerate(deltas))

    def finish(self) -> bytes:
        if not self.include_usage:
            return b""
        return self._chunk([], self.acc.usage())
