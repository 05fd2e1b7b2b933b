"""What the engine returns from each step: one delta per sequence (sample) that made progress.

The worker service forwards these deltas, one message per step, to the detokenizer; the
offline `LLM` accumulates them into vLLM-shaped `RequestOutput`s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class RequestError(ValueError):
    """A single request is invalid (the message names the field); the engine keeps serving others."""


class RequestBusy(RequestError):
    """A single request is refused for now (its tenant is at a limit of this engine); a retry
    later can succeed. The message says which limit."""


class FailedRequest(NamedTuple):
    """A request the engine ended with an error (Engine.take_failed): its grammar did not compile,
    or its masks left no token to draw."""
    request_id: str
    message: str     # names the field; safe to show the client
    busy: bool       # it waited past its queue deadline for a compile thread: a retry later may succeed


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) of the top-k alternatives, best first


class PromptLogprob(NamedTuple):
    """A prompt token's logprob given the tokens before it (gpu_worker/prompt_logprobs.py)."""
    token_id: int
    logprob: float | None                  # None for the prompt's first token
    rank: int | None                       # 1: the most likely token at its position
    top: tuple[tuple[int, float], ...]     # (token_id, logprob) of the top-k, best first


@dataclass
class SequenceDelta:
    request_id: str
    index: int                      # sample index in [0, n)
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0      # prompt tokens served from the prefix cache (first delta onwards)
    prompt_logprobs: list[PromptLogprob] | None = None   # sample 0's first delta of a request that asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_cached_blocks: int          # unreferenced but reusable (evictable) blocks
    num_total_blocks: int
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)
