"""A stand-in engine without a model, for measuring the control plane only (never for correctness).

Same surface as `gpu_worker.engine.Engine` (add_request / abort_request / step / stats, and a
`requests` table whose `seqs[i].num_computed_tokens` says what ran, which WorkerCore's stage
timings read). Every running sample gets one deterministic token per step (its whole prompt is
"computed" in its first step); a step sleeps `step_ms` to set the rate. KV blocks are accounted
like a paged cache (ceil(tokens / block_size) per sample).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from gpu_worker.outputs import EngineStats, RequestError, SequenceDelta, TokenLogprob
from services.protocol.sampling import SamplingParams, SamplingParamsError

_FIRST_ID = 100  # fake tokens avoid the low ids, where tokenizers keep their special tokens


@dataclass
class _Sample:
    request_id: str
    index: int
    prompt_len: int
    max_tokens: int
    want_logprobs: bool
    generated: int = 0
    blocks: int = 0
    num_computed_tokens: int = 0     # prompt + generated tokens but the last (Engine's meaning)


@dataclass
class _NullRequest:
    seqs: list[_Sample]              # the samples not finished or aborted yet


class NullEngine:
    def __init__(self, *, vocab_size: int = 32000, max_num_seqs: int = 256, num_blocks: int = 65536,
                 block_size: int = 16, max_model_len: int = 4096, step_ms: float = 0.0) -> None:
        self.vocab_size, self.max_num_seqs = vocab_size, max_num_seqs
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_model_len, self.step_ms = max_model_len, step_ms
        self.eos_token_ids: tuple[int, ...] = ()
        self.requests: dict[str, _NullRequest] = {}   # insertion order: who runs first
        self._used_blocks = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str = "", resume_output: list[list[int]] | None = None,
                    resume_ended: list[int] = ()) -> None:
        """resume_output: as Engine's, a request that ran elsewhere: each sample not in resume_ended
        goes on at the position after its tokens (a position's token does not depend on where it
        is drawn)."""
        try:
            params.validate(self.vocab_size)
        except SamplingParamsError as exc:
            raise RequestError(str(exc)) from None
        if not prompt_token_ids or len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(f"invalid prompt_token_ids: need 1 to {self.max_model_len - 1} tokens")
        if request_id in self.requests:
            raise RequestError(f"invalid request_id: {request_id!r} is already in use")
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        samples = [_Sample(request_id, i, len(prompt_token_ids), max_tokens, params.logprobs is not None)
                   for i in range(params.n)]
        if resume_output:
            if len(resume_output) != params.n:
                raise RequestError(f"invalid resume_output: one token list per sample ({params.n}) expected")
            for s in samples:
                s.generated = len(resume_output[s.index])
            samples = [s for s in samples if s.index not in resume_ended and s.generated < max_tokens]
            if not samples:
                raise RequestError("invalid resume_ended: every sample has ended; nothing to resume")
        self.requests[request_id] = _NullRequest(samples)

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for s in [s for s in req.seqs if index in (None, s.index)]:
            self._drop(s)

    def _drop(self, s: _Sample) -> None:
        self._used_blocks -= s.blocks
        req = self.requests[s.request_id]
        req.seqs.remove(s)
        if not req.seqs:
            del self.requests[s.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _samples(self) -> list[_Sample]:
        """Every unfinished sample, oldest request first."""
        return [s for req in self.requests.values() for s in req.seqs]

    def step(self) -> list[SequenceDelta]:
        if self.step_ms:
            time.sleep(self.step_ms / 1000)
        out: list[SequenceDelta] = []
        for s in self._samples()[: self.max_num_seqs]:
            token = _FIRST_ID + (s.prompt_len * 7 + s.generated * 13 + s.index) % (self.vocab_size - _FIRST_ID)
            s.generated += 1
            s.num_computed_tokens = s.prompt_len + s.generated - 1
            need = -(-(s.prompt_len + s.generated) // self.block_size)
            self._used_blocks += need - s.blocks
            s.blocks = need
            reason = "length" if s.generated >= s.max_tokens else None
            lp = [TokenLogprob(token, -0.5, ((token, -0.5),))] if s.want_logprobs else None
            out.append(SequenceDelta(s.request_id, s.index, [token], lp, reason, s.prompt_len, 0))
            if reason:
                self._drop(s)
        return out

    def stats(self) -> EngineStats:
        total = sum(len(req.seqs) for req in self.requests.values())
        running = min(total, self.max_num_seqs)
        return EngineStats(num_running=running, num_waiting=total - running,
                           num_free_blocks=self.num_blocks - self._used_blocks, num_cached_blocks=0,
                           num_total_blocks=self.num_blocks,
                           extra={"max_model_len": self.max_model_len, "block_size": self.block_size})
