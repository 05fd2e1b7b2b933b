"""Requests and their sequences (samples).

A `Request` holds n `Sequence`s. Only sample 0 exists until the prompt is computed; then the
request forks: samples 1..n-1 share the prompt's KV blocks (copy-on-write, see BlockManager)
and each samples its own first token from the same logits.

A sequence owns its progress and its block table:

    token_ids:  | prompt ...................... | output ........ |
                |<--- num_computed_tokens --->|<- num_new_tokens ->|   (KV written / still to write)
    block_table: one physical block per block_size tokens of token_ids[:num_computed + scheduled]
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from services.protocol.sampling import SamplingParams


# finish_reason of a sample whose prefill is done on this engine (export_kv) and whose KV blocks
# are held for a decode engine (gpu_worker/kv_transfer) until released: not a client-facing reason.
HANDOFF = "kv_handoff"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued for (re)computation, holds no blocks
    RUNNING = "running"      # holds blocks, scheduled every step until finished or preempted
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int             # lower value is served first (vLLM semantics)
    cache_salt: str
    arrival: int              # engine-wide admission counter: earlier requests win ties
    seed: int                 # params.seed, or one drawn from the engine seed
    max_tokens: int           # params.max_tokens capped by max_model_len - prompt length
    seqs: list["Sequence"] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first scheduling
    dropped: set[int] = field(default_factory=set)  # sample indices aborted on their own
    stop_ids: tuple[int, ...] = ()  # stop_token_ids + EOS (unless ignore_eos): masked under
                                    # min_tokens, end the sequence when sampled
    export_kv: bool = False   # prefill here, draw the first token, then hold the blocks for a
                              # decode engine: the samples finish with HANDOFF
    grammar: Any = None       # gpu_worker.structured.GrammarJob of a constrained request
    draw_waits: bool = False  # its grammar is still compiling: the scheduler computes its sequences'
                              # tokens but the last, so they draw nothing (structured/compiling.py)
    prompt_lp: Any = None     # gpu_worker.prompt_logprobs.PromptLogprobState of a request that
                              # asks for prompt logprobs and has not streamed yet
    handoff_hidden: Any = None  # export_kv with method mtp: the target's pre-norm state (H,) at the
                                # last prompt position, which the hand-off carries (spec_decode/mtp.py)

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def needs_fork(self) -> bool:
        return len(self.seqs) < self.params.n

    @property
    def finished(self) -> bool:
        return not self.needs_fork and all(s.status is SequenceStatus.FINISHED for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int                       # sample index in [0, n)
    token_ids: list[int]             # prompt + generated tokens
    num_prompt_tokens: int
    num_computed_tokens: int = 0     # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # digests of the leading full blocks of
                                     # token_ids; content-derived, so they survive preemption
    num_registered_blocks: int = 0   # leading blocks already offered to the prefix-cache map
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    cumulative_logprob: float = 0.0  # sum of the sampled tokens' logprobs (when logprobs are asked)
    matcher: Any = None              # xgrammar GrammarMatcher of a constrained sample, made at its
                                     # first draw; a fork makes its own

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_new_tokens(self) -> int:
        """Tokens still to compute; the scheduler's one invariant drives this to 0 every step."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority, then arrival, then sample index (smallest first)."""
        return (self.request.priority, self.request.arrival, self.index)

    def fork(self, index: int) -> "Sequence":
        """A new sample sharing this one's tokens and block table (the caller adds block refs)."""
        return Sequence(self.request, index, list(self.token_ids), self.num_prompt_tokens,
                        self.num_computed_tokens, list(self.block_table), list(self.block_hashes),
                        self.num_registered_blocks, self.status, cumulative_logprob=self.cumulative_logprob)
