"""OpenAI response shapes: whole responses (Accumulator) and SSE chunks (ChunkWriter).

Choice index = prompt_index * n + sample_index (completions with several prompts, as OpenAI).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.protocol.messages import TextDelta, TokenLogprobText

_json = msgspec.json.Encoder()


@dataclass
class _Choice:
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    tokens: int = 0
    logprobs: list[TokenLogprobText] = field(default_factory=list)
    text_offset: int = 0


class Accumulator:
    def __init__(self, kind: str, model: str, n: int, num_prompts: int, prompt_lens: list[int],
                 want_logprobs: bool) -> None:
        self.kind, self.model, self.n = kind, model, n
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
        if d.text:
            c.parts.append(d.text)
        c.tokens += d.num_new_tokens
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
        return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": t.token_bytes,
                             "top_logprobs": [{"token": a, "logprob": lp, "bytes": b} for a, lp, b in t.top]}
                            for t in items], "refusal": None}

    def completion_logprobs(self, c: _Choice, items: list[TokenLogprobText]) -> dict[str, Any]:
        offsets = []
        for t in items:
            offsets.append(c.text_offset)
            c.text_offset += len(t.token)
        return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
                "top_logprobs": [{a: lp for a, lp, _ in t.top} for t in items], "text_offset": offsets}

    # ---- whole response ------------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.parts)
            if self.kind == "chat":
                lp = self.chat_logprobs(c.logprobs) if self.want_logprobs else None
                # no tool_calls key: OpenAI leaves it out when the model called no tool
                choices.append({"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                                "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            else:
                c.text_offset = 0
                lp = self.completion_logprobs(c, c.logprobs) if self.want_logprobs else None
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage(),
                "system_fingerprint": None}


class ChunkWriter:
    """SSE bytes for a streamed answer; feeds the same Accumulator (for usage).

    stream_options (vLLM's semantics): include_usage adds a last chunk with the usage and no
    choices (the others carry `"usage": null`); continuous_usage_stats puts the usage so far in
    every chunk (benchmark tools read it to count tokens per chunk)."""

    def __init__(self, acc: Accumulator, include_usage: bool, continuous_usage: bool = False) -> None:
        self.acc, self.include_usage, self.continuous_usage = acc, include_usage, continuous_usage
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
        return b"".join(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None, "stop_reason": None}])
                        for i in range(len(self.acc.choices)))

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
            delta = {"content": d.text} if d.text else {}
            return self._chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish,
                                 "stop_reason": stop_reason}])
        lp = self.acc.completion_logprobs(choice, d.logprobs) if want_lp else None  # type: ignore[arg-type]
        return self._chunk([{"index": i, "text": d.text, "logprobs": lp, "finish_reason": finish,
                             "stop_reason": stop_reason}])

    def finish(self) -> bytes:
        if not self.include_usage:
            return b""
        return self._chunk([], self.acc.usage())
