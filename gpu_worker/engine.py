"""Engine: one model, one KV cache, one iteration-level loop.

    eng = Engine(EngineConfig(model=DIR))
    eng.add_request("r1", prompt_ids, SamplingParams(max_tokens=32))
    while eng.has_unfinished_requests():
        for delta in eng.step(): ...          # one SequenceDelta per sample that got a token

Each step: schedule (scheduler.py) -> copy-on-write copies -> build the ForwardBatch
(batch_builder.py) -> runner.forward -> sample (sampler.py) -> append tokens, publish full
blocks to the prefix cache, finish what is done. Invalid requests raise RequestError naming
the field and leave the engine serving the others.
"""
from __future__ import annotations

import logging
import numbers
import random
from typing import Any

from gpu_worker.batch_builder import build_forward_batch
from gpu_worker.block_manager import BlockManager
from gpu_worker.engine_setup import EngineSetup, resolve_setup
from gpu_worker.config import EngineConfig
from gpu_worker.outputs import EngineStats, RequestError, SequenceDelta
from gpu_worker.sampler import Sampler, SampleRequest, SampleResult
from gpu_worker.scheduler import ScheduledSeq, Scheduler
from gpu_worker.sequence import Request, Sequence
from services.protocol.sampling import SamplingParams, SamplingParamsError

log = logging.getLogger(__name__)

MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 256


class Engine:
    def __init__(self, config: EngineConfig, *, runner: Any = None, model_config: Any = None) -> None:
        """Loads the model from config.model, or uses a given `runner` + `model_config` (tests)."""
        self.config = config
        setup: EngineSetup = resolve_setup(config, runner=runner, model_config=model_config)
        self.setup = setup
        self.model_config = setup.model_config
        self.runner = setup.runner
        self.device = setup.device
        self.max_model_len = setup.max_model_len
        self.vocab_size: int = int(self.runner.vocab_size)
        self.eos_token_ids: tuple[int, ...] = tuple(self.model_config.eos_token_ids)
        self.block_manager = BlockManager(setup.num_blocks, config.block_size, setup.model_id,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self._seed_rng = random.Random(config.seed)  # seeds of requests that give none

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str = "") -> None:
        """Queue a request; raises RequestError naming the bad field (nothing is queued then)."""
        self._validate(request_id, prompt_token_ids, params, priority, cache_salt)
        prompt = [int(t) for t in prompt_token_ids]
        room = self.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        request = Request(request_id, prompt, params, int(priority), cache_salt, self._arrivals,
                          seed, max_tokens)
        self._arrivals += 1
        seq = Sequence(request, 0, list(prompt), len(prompt))
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def _validate(self, request_id: Any, prompt: Any, params: Any, priority: Any, cache_salt: Any) -> None:
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
            raise RequestError(f"invalid request_id: must be a string of 1 to {MAX_REQUEST_ID_LEN} characters")
        if request_id in self.requests:
            raise RequestError(f"invalid request_id: {request_id!r} is already in use by a running request")
        if not isinstance(params, SamplingParams):
            raise RequestError("invalid sampling_params: must be a SamplingParams")
        try:
            params.validate(self.vocab_size)
        except SamplingParamsError as e:
            raise RequestError(str(e)) from None
        if params.n > min(self.config.max_n, self.config.max_num_seqs):
            raise RequestError(f"invalid n: this engine allows at most "
                               f"{min(self.config.max_n, self.config.max_num_seqs)} samples, got {params.n}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestError("invalid priority: must be an integer")
        if not isinstance(cache_salt, str) or len(cache_salt) > MAX_CACHE_SALT_LEN:
            raise RequestError(f"invalid cache_salt: must be a string of at most {MAX_CACHE_SALT_LEN} characters")
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            raise RequestError("invalid prompt_token_ids: the prompt is empty")
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < self.vocab_size
               for t in prompt):
            raise RequestError(f"invalid prompt_token_ids: every id must be an integer in [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise RequestError(
                f"invalid prompt_token_ids: the prompt has {len(prompt)} tokens but max_model_len is "
                f"{self.max_model_len}, which must leave room for at least one generated token")

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or only its sample `index`) and free every block it holds. Unknown ids
        are ignored. Aborted samples produce no more deltas."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if index is None:
            self.scheduler.abort(request)
            del self.requests[request_id]
            return
        request.dropped.add(index)
        seq = next((s for s in request.seqs if s.index == index), None)
        if seq is not None and not (index == 0 and request.needs_fork):  # sample 0 carries the
            self.scheduler.abort_sequence(seq)                          # prompt until the fork
        self._forget_if_done(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[SequenceDelta]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("engine stuck: a waiting request cannot be scheduled on an idle engine")
            return []
        if out.copies:
            self.runner.copy_blocks([c.src for c in out.copies], [c.dst for c in out.copies])
        batch = build_forward_batch(out.scheduled, self.config.block_size, self.device)
        sampling = [item for item in out.scheduled if item.samples]
        logits = self.runner.forward(batch)                          # (S, vocab) float32
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.register_computed_blocks(item.seq)
        targets = self._fork_targets(sampling)                       # (row, seq) per draw
        results = self.sampler(logits, [self._sample_request(row, seq) for row, seq in targets])
        return [d for (_, seq), res in zip(targets, results) if (d := self._append(seq, res))]

    def _fork_targets(self, sampling: list[ScheduledSeq]) -> list[tuple[int, Sequence]]:
        """The sequences that draw a token, with their logits row. A request whose prompt just
        finished forks here: its n samples draw from the same row."""
        targets: list[tuple[int, Sequence]] = []
        for row, item in enumerate(sampling):
            seq = item.seq
            targets.append((row, seq))
            if seq.request.needs_fork:
                targets += [(row, self.scheduler.fork(seq, i)) for i in range(1, seq.request.n)]
        return targets

    def _sample_request(self, row: int, seq: Sequence) -> SampleRequest:
        params = seq.params
        stop_ids = tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)
        return SampleRequest(row, params, seq.request.seed, seq.index, seq.request.prompt_token_ids,
                             seq.output_token_ids, stop_ids)

    def _append(self, seq: Sequence, result: SampleResult) -> SequenceDelta | None:
        request = seq.request
        if seq.index in request.dropped:                 # aborted before it existed (n > 1)
            self.scheduler.abort_sequence(seq)
            self._forget_if_done(request)
            return None
        seq.token_ids.append(result.token_id)
        if result.logprob is not None:
            seq.cumulative_logprob += result.logprob.logprob
        reason = self._finish_reason(seq, result.token_id)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._forget_if_done(request)
        return SequenceDelta(
            request_id=request.request_id, index=seq.index, new_token_ids=[result.token_id],
            new_logprobs=None if result.logprob is None else [result.logprob],
            finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens)

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _forget_if_done(self, request: Request) -> None:
        if request.finished:
            self.requests.pop(request.request_id, None)

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks - bm.num_cached_blocks,
            num_cached_blocks=bm.num_cached_blocks, num_total_blocks=bm.num_blocks,
            prefix_query_tokens=bm.prefix_query_tokens, prefix_hit_tokens=bm.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            extra={"num_requests": len(self.requests), "max_model_len": self.max_model_len,
                   "block_size": bm.block_size})

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()
