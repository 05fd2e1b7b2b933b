"""Engine: one model, one KV cache, one iteration-level loop.

    eng = Engine(EngineConfig(model=DIR))
    eng.add_request("r1", prompt_ids, SamplingParams(max_tokens=32))
    while eng.has_unfinished_requests():
        for delta in eng.step(): ...          # one SequenceDelta per sample that got a token

Each step: schedule (scheduler.py) -> copy-on-write copies -> build the ForwardBatch
(batch_builder.py) -> runner.forward -> sample (sampler.py) -> append tokens, publish full
blocks to the prefix cache, finish what is done. Invalid requests raise RequestError naming
the field and leave the engine serving the others. With speculative_config, a synchronous step
first appends drafts (n-gram, or drawn by a draft model or MTP layer) that the same forward
verifies (_speculative_step; gpu_worker/spec_decode/); under async scheduling a step that may
propose settles the step in flight first, and one without drafts still launches ahead (a
sequence whose drafts keep failing backs off, so its steps launch ahead: spec_decode/backoff.py). Constrained requests (SamplingParams.structured)
compile their grammar off this thread while they prefill, their first draw left out of the steps
until it has compiled while the others step on; their draws are masked by it
(gpu_worker/structured/). Under async scheduling a batch with constrained or penalised draws
launches its forward ahead too and its draw once the previous step's tokens are read
(_launch_split): the matchers and penalties need them on the host.
"""
from __future__ import annotations

import gc
import logging
import numbers
import os
import random
import time
from typing import Any, NamedTuple

import torch

from gpu_worker.batch_builder import BatchBuilder, fits_decode_rows
from gpu_worker.block_manager import BlockManager
from gpu_worker.engine_setup import EngineSetup, measuring_memory, resolve_setup
from gpu_worker.kv_tiers import TieredScheduler, build_kv_tiers
from gpu_worker.kv_transfer import group
from gpu_worker.config import EngineConfig
from gpu_worker.outputs import EngineStats, FailedRequest, RequestBusy, RequestError, SequenceDelta
from gpu_worker.prompt_logprobs import PromptLogprobState, fill, plan_rows
from gpu_worker.sampler import (
    PendingSample, Sampler, SampleRequest, SampleResult, needs_output_for_bad_words, to_device)
from gpu_worker.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from gpu_worker.sequence import HANDOFF, Request, Sequence, SequenceStatus
from gpu_worker.spec_decode import Speculator
from gpu_worker.spec_decode.rejection import verify as rejection_verify
from gpu_worker.spec_decode.speculator import build_proposer
from gpu_worker.structured import (CompileBusy, CompilingRequests, GrammarCompilerPool, GrammarError, GrammarMask,
                                   GrammarMaskBuilder)
from gpu_worker.structured.matchers import new_matcher
from services.protocol.kv_events import split_salt
from services.protocol.sampling import MAX_PROMPT_LOGPROBS_TOKENS, MAX_SEED, SamplingParams, SamplingParamsError

log = logging.getLogger(__name__)

MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 256
PENDING = -1     # async_scheduling: a token sampled on the device, not yet read back


class _Forwarded(NamedTuple):
    """A step's forward, before its draw: the logits and who draws from which row, with what."""
    logits: torch.Tensor                  # (S, vocab): one row per sampling sequence
    targets: list[tuple[int, Sequence]]   # (logits row, sequence); forks share their parent's row
    requests: list[SampleRequest]         # one per target
    grammar: GrammarMask | None           # the constrained targets' token bitmask


class _KeepHidden:
    """The runner as a step's forward sees it while prompt logprobs are computed (a proposer's
    forward hook included): forward() runs eagerly and keeps every row's final hidden state."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.hidden = runner, None

    def forward(self, batch: Any) -> torch.Tensor:
        out = self.runner.forward_keeping_hidden(batch)
        self.hidden = out.hidden                                    # (T, H)
        return out.logits                                           # (S, V)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


class _InFlight(NamedTuple):
    """A launched step (async_scheduling): who draws, where each placeholder sits, the draw."""
    targets: list[tuple[int, Sequence]]   # (logits row, sequence)
    slots: list[int]                      # index of each target's PENDING token in token_ids
    pending: PendingSample
    step_no: int                          # SchedulerOutput.step_no: its read times it (prefill_rate.py)


def _as_token_ids(ids: list | tuple, vocab_size: int) -> list[int] | None:
    """ids as a new list of plain ints when every one is an integer (not a bool) in [0, vocab_size),
    else None. Plain ints (what the wire decodes to) are checked with C loops (type set, min/max:
    ~15 us for 512 ids); the generic per-id isinstance(numbers.Integral) test, kept for others
    (numpy ints...), cost ~1 us an id, 0.3-0.6 ms of a 512-token request's time to first token."""
    if set(map(type, ids)) == {int}:
        return list(ids) if 0 <= min(ids) and max(ids) < vocab_size else None
    if all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        return [int(t) for t in ids]
    return None


def _needs_output(params: SamplingParams) -> bool:
    """Penalties and bad words of several tokens read the generated tokens on the host (async
    scheduling: _launch_split)."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or needs_output_for_bad_words(params))


class Engine:
    def __init__(self, config: EngineConfig, *, runner: Any = None, model_config: Any = None) -> None:
        """Loads the model from config.model, or uses a given `runner` + `model_config` (tests)."""
        self.config = config
        # other kvmesh engines on this GPU wait until this one has measured and allocated its memory
        with measuring_memory(config, runner):
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
            scheduling = (self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                          config.enable_chunked_prefill)
            self.kv_tiers = build_kv_tiers(self) if config.kv_offload_enabled else None
            self.scheduler = (Scheduler(*scheduling) if self.kv_tiers is None
                              else TieredScheduler(self.kv_tiers, *scheduling))
            self.sampler = Sampler()
            self.batch_builder = BatchBuilder(config.block_size, self.device)
            spec = config.speculative
            self.speculator = (Speculator(spec, self.max_model_len,
                                          build_proposer(spec, setup.draft_runner, config.block_size, self.device))
                               if spec is not None else None)
            self._prepare_gpu()
        self.grammars = GrammarCompilerPool(config.model, self.vocab_size, self.eos_token_ids)
        self.grammar_masks = GrammarMaskBuilder(self.vocab_size, self.device, max_threads=min(8, os.cpu_count() or 1))
        self._constrained: set[str] = set()       # running requests with a grammar
        self._compiling = CompilingRequests()     # ... of which those whose grammar is not ready
        self._failed: list[FailedRequest] = []    # failed compiles and blocked draws, to take
        self.requests: dict[str, Request] = {}
        self._prompt_lp: set[Request] = set()     # requests whose prompt logprobs are not all made
        self.exported: dict[str, Request] = {}    # prefilled here, blocks held for a decode engine
        self._importing: dict[str, tuple[Sequence, list[tuple[int, int, float]] | None]] = {}  # KV arriving
        self._moved_groups: dict[str, list[Sequence]] = {}   # ... for every sample of an n > 1 peer move
        self._group_hits: dict[str, int] = {}    # ... and its leading blocks this pool's cache held
        self._arrivals = 0
        self._seed_rng = random.Random(config.seed)  # seeds of requests that give none
        self._inflight: _InFlight | None = None       # async_scheduling: the launched step
        self.async_scheduling = config.async_scheduling  # may be switched between steps
        # speculation: verification steps without a prefill chunk run as decode rows (_verify_batch);
        # False keeps every one on the extend path (an A/B switch for bench/spec_decode_bench.py)
        self.verify_as_decode_rows = True
        self.steps_ahead = 0   # async_scheduling: launched steps whose forward preceded the previous step's settle
        self._froze_gc = False
        # seconds the last step() spent reading sampled tokens back: the host sync (async scheduling:
        # waiting for the launched step's draw; sync scheduling: the draw and its read-back)
        self.last_sync_s = 0.0

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str = "", export_kv: bool = False,
                    resume_output: list[list[int]] | None = None, resume_ended: list[int] = ()) -> None:
        """Queue a request; raises RequestError naming the bad field (nothing is queued then).
        export_kv: prefill it and draw its first token(s) only; each sample that goes on finishes
        with HANDOFF and its blocks stay held (`exported`) until release_export.
        resume_output: a request that ran elsewhere up to these tokens (one list per sample; the
        samples in resume_ended are over): each sample starts as prompt + its tokens, computed like
        a preempted sequence, so its next draw, budget and penalties are those of that position."""
        prompt = self._validate(request_id, prompt_token_ids, params, priority, cache_salt)
        if request_id in self.exported:
            raise RequestError(f"invalid request_id: {request_id!r} still holds exported KV blocks")
        if params.structured is not None and not resume_output:   # a resumed request has streamed: never refused
            try:
                self.grammars.admit(params.structured, split_salt(cache_salt)[0])
            except CompileBusy as exc:
                raise RequestBusy(str(exc)) from None
        room = self.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        stop_ids = tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)
        _check_allowed_left(params, stop_ids)
        if params.prompt_logprobs is not None and not resume_output:   # a resumed request streamed them
            self._check_prompt_logprobs(prompt)
        request = Request(request_id, prompt, params, int(priority), cache_salt, self._arrivals,
                          seed, max_tokens, stop_ids=stop_ids, export_kv=export_kv)
        self._arrivals += 1
        if params.prompt_logprobs is not None and not resume_output:
            request.prompt_lp = PromptLogprobState(params.prompt_logprobs, prompt)
            self._prompt_lp.add(request)
        if resume_output:
            seqs = self._resumed_samples(request, resume_output, resume_ended)
        else:
            seqs = [Sequence(request, 0, list(prompt), len(prompt))]
        self._submit_grammar(request)     # once nothing can refuse it: a refused request queues no compile
        if request.grammar is not None and not resume_output:   # a fresh request: fails busy if no thread starts it soon
            self.grammars.limit_queue_wait(request.grammar, split_salt(cache_salt)[0])
        request.seqs += seqs
        self.requests[request_id] = request
        for seq in seqs:
            if seq.status is SequenceStatus.WAITING:
                self.scheduler.add(seq)

    def _check_prompt_logprobs(self, prompt: list[int]) -> None:
        """Where this engine cannot make a request's prompt logprobs, a RequestError naming them."""
        if len(prompt) > MAX_PROMPT_LOGPROBS_TOKENS:
            raise RequestError(f"invalid prompt_logprobs: prompts of at most {MAX_PROMPT_LOGPROBS_TOKENS} tokens "
                               f"may ask for them, this one has {len(prompt)}")
        if (why := self._no_prompt_logprobs()) is not None:
            raise RequestError(f"invalid prompt_logprobs: this worker ({why}) does not compute them")

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Whether this engine makes prompt logprobs at all; the worker publishes it in its registry
        record, and the scheduler sends the requests that ask for them only to workers that do."""
        return self._no_prompt_logprobs() is None

    def _no_prompt_logprobs(self) -> str | None:
        """What keeps this engine from making prompt logprobs, or None."""
        if not hasattr(self.runner, "forward_keeping_hidden"):
            return "tensor parallel"
        spec = self.config.speculative
        return "mtp speculation" if spec is not None and spec.method == "mtp" else None

    def _resumed_samples(self, request: Request, outputs: list[list[int]], ended: list[int]) -> list[Sequence]:
        """Every sample of a resumed request, at its tokens so far: ended ones finished (they draw
        nothing), the others waiting to compute prompt + tokens and draw on (no fork: each has its own)."""
        prompt = request.prompt_token_ids
        if len(outputs) != request.n or not all(0 <= i < request.n for i in ended):
            raise RequestError(f"invalid resume_output: one token list per sample ({request.n}) expected")
        seqs = []
        for index, out in enumerate(outputs):
            if index in ended:          # over: it holds no tokens or blocks here
                seq = Sequence(request, index, list(prompt), len(prompt))
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                seqs.append(seq)
                continue
            ids = _as_token_ids(out, self.vocab_size) if out else []
            if ids is None or len(prompt) + len(ids) >= self.max_model_len or len(ids) >= request.max_tokens:
                raise RequestError(f"invalid resume_output: sample {index} has tokens outside [0, {self.vocab_size}) "
                                   "or no room left to generate")
            seqs.append(Sequence(request, index, prompt + ids, len(prompt)))
        if all(seq.status is SequenceStatus.FINISHED for seq in seqs):
            raise RequestError("invalid resume_ended: every sample has ended; nothing to resume")
        return seqs

    def _submit_grammar(self, request: Request) -> None:
        """Start compiling a constrained request's grammar: it compiles while the prompt prefills,
        fairly against other tenants' compiles (the tenant is the API key the gateway salted the
        request with; a move or hand-off arriving here is never refused, its stream has begun)."""
        if request.params.structured is not None:
            request.grammar = self.grammars.submit(request.params.structured, split_salt(request.cache_salt)[0])
            self._constrained.add(request.request_id)
            self._compiling.add(request)

    def take_failed(self) -> list[FailedRequest]:
        """The requests ended since the last call because their grammar failed to compile (or
        waited past its queue deadline: busy), or a draw of theirs had no token left (_blocked);
        they hold no blocks and produce no more deltas."""
        failed, self._failed = self._failed, []
        return failed

    def _validate(self, request_id: Any, prompt: Any, params: Any, priority: Any, cache_salt: Any) -> list[int]:
        """Raises RequestError naming the first bad field; returns the prompt as a list of plain ints."""
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
        ids = _as_token_ids(prompt, self.vocab_size)
        if ids is None:
            raise RequestError(f"invalid prompt_token_ids: every id must be an integer in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"invalid prompt_token_ids: the prompt has {len(ids)} tokens but max_model_len is "
                f"{self.max_model_len}, which must leave room for at least one generated token")
        return ids

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or only its sample `index`) and free every block it holds. Unknown ids
        are ignored. Aborted samples produce no more deltas."""
        if request_id in self.exported or request_id in self._importing:
            self._abort_handoff(request_id, index)
            return
        request = self.requests.get(request_id)
        if request is None:
            return
        if index is None:
            self.scheduler.abort(request)
            del self.requests[request_id]
            self._forget_constrained(request_id)
            return
        request.dropped.add(index)
        seq = next((s for s in request.seqs if s.index == index), None)
        if seq is not None and not (index == 0 and request.needs_fork):  # sample 0 carries the
            self.scheduler.abort_sequence(seq)                          # prompt until the fork
        self._forget_if_done(request)

    def close(self) -> None:
        """Releases what outlives the engine object: tensor-parallel rank processes, the device
        memory of the weights and KV cache (so a later engine in this process gets it) and the
        KV disk tier's writer thread."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        if self.speculator is not None:    # the draft model's / MTP layer's weights and KV cache
            self.speculator.close()
        self.grammars.close()
        if self.kv_tiers is not None:      # the disk tier's writer thread
            self.kv_tiers.close()
        if self._froze_gc:                 # the engine holds reference cycles: let them go
            self._froze_gc = False
            gc.unfreeze()

    def freeze_gc(self) -> None:
        """For a process that serves with this engine from now on: move every object alive now
        (modules, weights' wrappers, imported libraries: ~350k tracked objects) out of the
        cyclic garbage collector's reach (gc.freeze, as vLLM's and SGLang's engine processes do).
        Every full collection otherwise walks them all: 140-190 ms on a 2-core Xeon, about once
        per 100 steps at 800 sequences, where the GPU waits for it (on the H200, vLLM's 1,000
        ShareGPT-like requests: 24.3k -> 25.2k total tok/s). close() undoes it (gc.unfreeze:
        the whole permanent generation); an engine dropped without close() stays in memory while
        frozen (it holds reference cycles)."""
        gc.collect()
        gc.freeze()
        self._froze_gc = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def idle(self) -> None:
        """Between steps while nothing runs (the worker's loop, every ~50 ms): the KV tiers'
        background work settles (finished writes, the disk tier's check for files deleted
        outside kvmesh), so their blocks and events stay true while no request comes; the
        prefill meter forgets steps never read (prefill_rate.py: they would time this wait)."""
        self.scheduler.prefill_rate.idled()
        if self.kv_tiers is not None:
            self.kv_tiers.flush()

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[SequenceDelta]:
        self.last_sync_s = 0.0
        if self._compiling:
            self._settle_grammars()
        if self.speculator is not None:      # imported sequences draft from their first step here
            self.scheduler.admit_prefilled()
        if self.async_scheduling:
            return self._step_async()
        if self._inflight is not None:        # async_scheduling was switched off: finish its step
            prev, self._inflight = self._inflight, None
            return self._settle(prev)
        drafts = self.speculator.propose(self.scheduler.running) if self.speculator is not None else None
        out = self.scheduler.schedule()
        if drafts:
            drafts = self.speculator.fit(out, drafts)
        if not out.scheduled:
            self._idle()
            return []
        if drafts:
            return self._speculative_step(out, drafts)
        fwd = self._forward(out, None)
        t = time.perf_counter()
        results = self.sampler(fwd.logits, fwd.requests, fwd.grammar)   # the draw and its host sync
        self.last_sync_s += time.perf_counter() - t
        if fwd.requests:                      # read back: the step is done on the device
            self.scheduler.prefill_rate.read(out.step_no)
        deltas = [d for (_, seq), res in zip(fwd.targets, results) if (d := self._append(seq, res))]
        if self.speculator is not None:           # mtp: its KV catches up on the step's final tokens
            self.speculator.settle()
        return deltas

    def _forward(self, out: SchedulerOutput, prev: _InFlight | None) -> _Forwarded:
        """The part of a step both schedulings share: the forward (_run_forward) and what each
        sampling sequence draws with (_draws). The caller draws: at once (step) or queued (_launch)."""
        return self._draws(*self._run_forward(out, prev))

    def _run_forward(self, out: SchedulerOutput, prev: _InFlight | None
                     ) -> tuple[torch.Tensor, list[tuple[int, Sequence]]]:
        """Copy-on-write copies, the batch (its PENDING inputs taken on the device from `prev`'s
        draw), the forward, progress and forks: the logits (S, vocab) and the (row, sequence) of
        each draw."""
        self._copy_blocks(out)
        batch = self.batch_builder.build(out.scheduled)
        batch.layer_loads = out.layer_loads
        if prev is not None:
            self._take_pending_inputs(batch, out.scheduled, prev)
        sampling = [item for item in out.scheduled if item.samples]
        logits = self._target_forward(batch, out.scheduled)          # (S, vocab)
        if prev is None:              # every token is known: publish the blocks that filled up now
            bm, bs = self.block_manager, self.config.block_size
            for seq, num_new in out.scheduled:
                seq.num_computed_tokens += num_new
                if seq.num_computed_tokens // bs > seq.num_registered_blocks:
                    bm.register_computed_blocks(seq)
        else:                         # a block may end in a PENDING token: _step_async publishes it
            for seq, num_new in out.scheduled:                       # once prev is settled
                seq.num_computed_tokens += num_new
        return logits, self._fork_targets(sampling)                  # (row, seq) per draw

    def _draws(self, logits: torch.Tensor, targets: list[tuple[int, Sequence]]) -> _Forwarded:
        """What each target draws with, from its tokens and matcher as they are now: its
        SampleRequest, and the constrained targets' grammar mask."""
        grammar = self._grammar_mask([(seq, []) for _, seq in targets]) if self._constrained else None
        return _Forwarded(logits, targets, [self._sample_request(row, seq) for row, seq in targets], grammar)

    # ---- speculative decoding (gpu_worker/spec_decode/speculator.py: the layout, why exact) ----
    def _speculative_step(self, out: SchedulerOutput, drafts: dict[Sequence, list[int]]) -> list[SequenceDelta]:
        """A synchronous step in which the sequences of `drafts` verify their drafts: their
        draft positions get logits rows and draws of their own; the others step as usual."""
        self._copy_blocks(out)
        proposal = self.speculator.fill(drafts, self._sample_request_at)   # draft_model / mtp: draw the drafts
        batch = self._verify_batch(out.scheduled, [len(drafts.get(seq, ())) for seq, _ in out.scheduled])
        batch.layer_loads = out.layer_loads
        sampling = [item.seq for item in out.scheduled if item.samples]
        logits = self._target_forward(batch, out.scheduled)          # (S + drafts, vocab)
        bm, bs = self.block_manager, self.config.block_size
        for seq, num_new in out.scheduled:                           # drafts: after verification
            if seq not in drafts:
                seq.num_computed_tokens += num_new
                if seq.num_computed_tokens // bs > seq.num_registered_blocks:
                    bm.register_computed_blocks(seq)
        plain: list[tuple[int, Sequence]] = []                       # (first row, seq)
        verifying: list[tuple[Sequence, list[int]]] = []
        requests: list[SampleRequest] = []
        rejecting: dict[Sequence, list[SampleRequest]] = {}          # verified against the draft's q
        row = 0
        for seq in sampling:
            draft = drafts.get(seq)
            if draft is None:
                plain.append((row, seq))
                if seq.request.needs_fork:
                    plain += [(row, self.scheduler.fork(seq, i)) for i in range(1, seq.request.n)]
                row += 1
                continue
            verifying.append((seq, draft))
            base = seq.num_tokens - len(draft)
            rows = [self._sample_request_at(row + j, seq, base + j) for j in range(len(draft) + 1)]
            # a constrained draw keeps the point-mass rule: exact whatever the draft, and the
            # draft's q knows no grammar mask
            if proposal is not None and seq in proposal.q and seq.request.grammar is None:
                rejecting[seq] = rows
            else:
                requests += rows
            row += len(draft) + 1
        order = [self._sample_request(r, seq) for r, seq in plain]
        grammar = (self._grammar_mask([(seq, []) for _, seq in plain]                # draw rows' order
                                      + [(seq, d) for seq, d in verifying if seq not in rejecting])
                   if self._constrained else None)
        t = time.perf_counter()
        results = self.sampler(logits, order + requests, grammar)    # the draws and their host sync
        if order or requests:
            self.scheduler.prefill_rate.read(out.step_no)
        sampled = dict(zip(rejecting, rejection_verify(
            logits, [(drafts[seq], rows, proposal.q[seq]) for seq, rows in rejecting.items()]))) if rejecting else {}
        self.last_sync_s += time.perf_counter() - t
        deltas = [d for (_, seq), res in zip(plain, results) if (d := self._append(seq, res))]
        at = len(plain)
        for seq, draft in verifying:
            if seq in sampled:
                drawn = sampled[seq].results
            else:
                drawn = results[at:at + len(draft) + 1]
                at += len(draft) + 1
            if (d := self._accept(seq, draft, drawn)) is not None:
                deltas.append(d)
        self.speculator.settle()
        return deltas

    def _verify_batch(self, scheduled: list[ScheduledSeq], num_drafts: list[int]):
        """A verification step's batch: decode rows where no sequence prefills (they replay the
        decode CUDA graphs: batch_builder.build_decode_rows), else the extend form, whose logits
        rows are each sequence's last 1 + d. Both order the logits rows alike."""
        stats = self.speculator.stats
        if self.verify_as_decode_rows and fits_decode_rows(scheduled, num_drafts):
            stats.decode_row_steps += 1
            return self.batch_builder.build_decode_rows(scheduled)
        stats.extend_steps += 1
        return self.batch_builder.build(scheduled, num_drafts)

    def _target_forward(self, batch, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """The model's forward of a step; with a proposer, through its hook (a draft model writes
        its KV for the same tokens, mtp keeps the pre-norm states: speculator.py)."""
        plans = self._prompt_rows(scheduled) if self._prompt_lp else None
        runner = _KeepHidden(self.runner) if plans else self.runner
        if self.speculator is None:
            logits = runner.forward(batch)
        else:
            logits = self.speculator.forward(runner, batch, scheduled)
        if plans:
            fill(plans, runner.hidden, self.runner.full_logits)
        return logits

    def _prompt_rows(self, scheduled: list[ScheduledSeq]):
        """This step's rows whose prompt logprobs are wanted (gpu_worker/prompt_logprobs.py); the
        requests that have them all, or ended, leave the set."""
        self._prompt_lp = {r for r in self._prompt_lp if not r.prompt_lp.done and self.requests.get(r.request_id) is r}
        return plan_rows(scheduled) if self._prompt_lp else None

    def _copy_blocks(self, out: SchedulerOutput) -> None:
        """Copy-on-write copies of the step, in the draft model's (MTP layer's) KV cache too."""
        if out.copies:
            src, dst = [c.src for c in out.copies], [c.dst for c in out.copies]
            self.runner.copy_blocks(src, dst)
            if self.speculator is not None:
                self.speculator.copy_blocks(src, dst)

    def _sample_request_at(self, row: int, seq: Sequence, num_tokens: int) -> SampleRequest:
        """The draw after seq.token_ids[:num_tokens] (drafts before it included), as a plain
        step at that point would make it."""
        request, params = seq.request, seq.request.params
        position = num_tokens - seq.num_prompt_tokens
        needs_output = _needs_output(params) or position < params.min_tokens
        outputs = seq.token_ids[seq.num_prompt_tokens:num_tokens] if needs_output else ()
        return SampleRequest(row, params, request.seed, seq.index, request.prompt_token_ids, outputs,
                             request.stop_ids, position)

    def _accept(self, seq: Sequence, draft: list[int], drawn: list[SampleResult]) -> SequenceDelta | None:
        """Keep the drafts the model drew itself, then its next token; roll the rest back."""
        accepted = 0
        while accepted < len(draft) and not drawn[accepted].blocked and drawn[accepted].token_id == draft[accepted]:
            accepted += 1
        self.speculator.verified(seq, len(draft), accepted)     # stats; a back-off where drafts keep failing
        base = seq.num_tokens - len(draft)
        del seq.token_ids[base:]
        request = seq.request
        if seq.index in request.dropped:
            self.scheduler.abort_sequence(seq)
            self._forget_if_done(request)
            return None
        if request.grammar is not None and request.grammar.error is not None:
            self._fail_constrained(request)
            return None
        tokens, logprobs, reason = [], [], None
        for result in drawn[:accepted + 1]:
            if result.blocked:
                reason = self._blocked(seq)
                if reason is None:          # the request failed
                    return None
                break
            seq.token_ids.append(result.token_id)
            tokens.append(result.token_id)
            if result.logprob is not None:
                seq.cumulative_logprob += result.logprob.logprob
                logprobs.append(result.logprob)
            reason = self._finish_reason(seq, result.token_id)
            if seq.matcher is not None and self._grammar_ends(seq, result.token_id):
                reason = reason or "stop"
            if reason is not None:
                break
        # KV is final for the last token before the drafts and the accepted drafts (those kept
        # when a stop came first): register full blocks of those only, then free the rest
        seq.num_computed_tokens = min(base + accepted, seq.num_tokens)
        self.block_manager.release_uncomputed(seq)
        if seq.num_computed_tokens // self.config.block_size > seq.num_registered_blocks:
            self.block_manager.register_computed_blocks(seq)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._forget_if_done(request)
        return SequenceDelta(request_id=request.request_id, index=seq.index, new_token_ids=tokens,
                             new_logprobs=logprobs if request.params.logprobs is not None else None,
                             finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
                             num_cached_tokens=request.num_cached_tokens)

    # ---- one step ahead (async_scheduling) ------------------------------------------------
    #
    #   call k:  schedule N+1 | build | inputs <- tokens of N (device) | launch N+1 | read N | deltas N
    #   GPU:     ...... step N ...... | step N+1 ...........................................
    #
    # At launch each sampling sequence gets a placeholder token (PENDING) that the next call
    # replaces with the token read back; the scheduler counts it like any token, the batch
    # builder's row for it is overwritten on the device from the previous step's token tensor.
    #
    # A draw that needs token N on the host (a grammar's mask: the matcher accepts N first;
    # penalties: they count the output tokens) splits the launch (_launch_split): only the draw
    # waits for the host, not the forward:
    #
    #   call k:  schedule N+1 | build | inputs <- N (device) | launch FORWARD N+1 | read N (matchers
    #            accept N) | N+1's masks and penalty inputs on the host | launch DRAW N+1 | deltas N
    #   GPU:     ... step N ... | forward N+1 ..................... | draw N+1
    #
    # so the host's read and mask filling overlap the forward; the GPU waits between the forward
    # and the draw only for what outlasts the forward. A sequence that N ended draws nothing.
    #
    # Speculation: drafts continue from the last sampled token, so a step that may propose settles
    # the launched step first and, when drafts are scheduled, runs as a synchronous
    # _speculative_step; a step without drafts launches one step ahead. A sequence backing off
    # (spec_decode/backoff.py) makes no step settle for it. A proposer's catch-up on
    # a launched step (speculator.settle: mtp's KV reads each row's next token) runs once that
    # step's own PENDING inputs are known, i.e. after the previous step is settled.
    def _step_async(self) -> list[SequenceDelta]:
        prev, self._inflight = self._inflight, None
        deltas: list[SequenceDelta] = []
        if prev is not None and self._may_speculate():    # drafts need the launched step's tokens
            deltas, prev = self._settle(prev), None
        # a grammar's mask and penalties read the previous step's tokens on the host: the draw waits, not the forward
        split = prev is not None and (self._constrained or any(_needs_output(s.params) for s in self.scheduler.running))
        drafts = self.speculator.propose(self.scheduler.running) if self.speculator is not None and prev is None else None
        out = self.scheduler.schedule()
        if drafts:
            drafts = self.speculator.fit(out, drafts)
        if not out.scheduled:
            if prev is None and not deltas:
                self._idle()
            if prev is None:
                return deltas
            deltas = self._settle(prev)
            if self.speculator is not None:   # mtp: forget the pending rows of what just ended
                self.speculator.settle()
            return deltas
        if drafts:
            return deltas + self._speculative_step(out, drafts)
        if split:
            launched, deltas = self._launch_split(out, prev)
        else:
            launched = self._launch(out, prev)
            if prev is not None:
                deltas = self._settle(prev)
        if prev is not None:
            self.steps_ahead += 1
            bm, bs = self.block_manager, self.config.block_size
            for seq, _ in out.scheduled:      # the tokens these blocks hold are all known now
                if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens // bs > seq.num_registered_blocks:
                    bm.register_computed_blocks(seq)
        if self.speculator is not None:       # every input of the launched step is known now
            self.speculator.settle()
        self._inflight = launched
        return deltas

    def _may_speculate(self) -> bool:
        """Whether this step may propose drafts once the launched step's tokens are known."""
        return self.speculator is not None and self.speculator.may_propose(self.scheduler.running, PENDING)

    def _launch(self, out: SchedulerOutput, prev: _InFlight | None) -> _InFlight:
        """_forward, then the draw queued on the device: each sampling sequence gets a PENDING
        placeholder that the next call's _settle replaces."""
        return self._queue_draw(self._forward(out, prev), out.step_no)

    def _queue_draw(self, fwd: _Forwarded, step_no: int) -> _InFlight:
        pending = self.sampler.launch(fwd.logits, fwd.requests, fwd.grammar)
        slots = []
        for _, seq in fwd.targets:
            seq.token_ids.append(PENDING)
            slots.append(len(seq.token_ids) - 1)
        return _InFlight(fwd.targets, slots, pending, step_no)

    def _launch_split(self, out: SchedulerOutput, prev: _InFlight) -> tuple[_InFlight, list[SequenceDelta]]:
        """The forward queued on the device before `prev` is settled, the draw after it (the
        timeline above): the matchers have accepted prev's tokens and the penalties read them, as
        a synchronous step's draw does. Returns the launched step and prev's deltas."""
        logits, targets = self._run_forward(out, prev)
        deltas = self._settle(prev)
        # a sequence that prev's token ended (stop, length, its grammar complete), or a request
        # ended since, draws nothing: a synchronous step would not have scheduled it
        live = [(row, seq) for row, seq in targets if seq.status is not SequenceStatus.FINISHED]
        return self._queue_draw(self._draws(logits, live), out.step_no), deltas

    def _take_pending_inputs(self, batch, scheduled: list[ScheduledSeq], prev: "_InFlight") -> None:
        """input_ids rows whose token is still PENDING <- the previous step's sampled tokens."""
        src_of = {id(seq): k for k, (_, seq) in enumerate(prev.targets)}
        dst, src, row = [], [], 0
        for seq, num_new in scheduled:
            c = seq.num_computed_tokens
            if seq.token_ids[c + num_new - 1] == PENDING:   # only ever the last token
                dst.append(row + num_new - 1)
                src.append(src_of[id(seq)])
            row += num_new
        if not dst:
            return
        if dst[-1] - dst[0] == len(dst) - 1 and src == list(range(src[0], src[0] + len(src))):
            # the usual decode step (every row pending, in the previous step's order): one slice
            # copy, where the general case queues two index uploads and two kernels between steps
            batch.input_ids[dst[0]:dst[-1] + 1].copy_(prev.pending.tokens[src[0]:src[-1] + 1])
            return
        dev = batch.input_ids.device
        batch.input_ids.index_copy_(0, to_device(dst, dev), prev.pending.tokens.index_select(0, to_device(src, dev)))

    def _settle(self, launched: "_InFlight") -> list[SequenceDelta]:
        """Read a launched step's tokens back and apply them (the host sync)."""
        t = time.perf_counter()
        results = launched.pending.results()
        self.last_sync_s += time.perf_counter() - t
        if launched.targets:                  # read back: the step is done on the device
            self.scheduler.prefill_rate.read(launched.step_no)
        deltas = []
        for (_, seq), slot, result in zip(launched.targets, launched.slots, results):
            if seq.status is SequenceStatus.FINISHED or seq.token_ids[slot] != PENDING:
                continue                       # aborted, or ended by the previous token
            constrained = (self._constrained or self._failed) and seq.request.grammar is not None
            if constrained and seq.request.grammar.error is not None:
                self._fail_constrained(seq.request)
                continue
            if seq.index in seq.request.dropped:
                del seq.token_ids[slot:]
                self.scheduler.abort_sequence(seq)
                self._forget_if_done(seq.request)
                continue
            if result.blocked:
                del seq.token_ids[slot:]
                if (reason := self._blocked(seq)) is not None:
                    self.scheduler.finish(seq, reason)
                    self._forget_if_done(seq.request)
                    deltas.append(self._delta(seq, None, reason))
                continue
            seq.token_ids[slot] = result.token_id
            if result.logprob is not None:
                seq.cumulative_logprob += result.logprob.logprob
            reason = self._finish_reason_at(seq, result.token_id, slot + 1)
            if constrained and seq.matcher is not None and self._grammar_ends(seq, result.token_id):
                reason = reason or "stop"
            if reason is not None:
                del seq.token_ids[slot + 1:]   # a later placeholder: its step is wasted
                self.scheduler.finish(seq, reason)
                self._forget_if_done(seq.request)
            deltas.append(self._delta(seq, result, reason))
        return deltas

    def _idle(self) -> None:
        """Nothing was scheduled and nothing drew. Held draws wait for their compile: block for
        it briefly (a caller's step loop must not spin); else raise when nothing can change."""
        self.scheduler.prefill_rate.idled()       # nothing in flight: unread steps would time the wait
        if self._compiling:
            self._compiling.wait()
        elif self._stuck():
            raise RuntimeError("engine stuck: a waiting request cannot be scheduled on an idle engine")

    def _stuck(self) -> bool:
        """Requests wait, yet nothing runs and no block will come back: blocks held for or awaited
        from another engine (KV hand-off), or by a load from a lower KV tier, do come back."""
        return bool(self.scheduler.waiting and not self.scheduler.running and not self.exported
                    and not self._importing and not self.scheduler.loading)

    def _finish_reason_at(self, seq: Sequence, token_id: int, num_tokens: int) -> str | None:
        """_finish_reason for the token at index num_tokens - 1 of seq.token_ids."""
        if token_id in seq.request.stop_ids:
            return "stop"
        if num_tokens - seq.num_prompt_tokens >= seq.request.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return HANDOFF if seq.request.export_kv else None

    def _delta(self, seq: Sequence, result: SampleResult | None, reason: str | None) -> SequenceDelta:
        """seq's delta of this step: its drawn token, or none (result None: a draw _blocked ended it)."""
        request = seq.request
        if result is None:
            tokens, logprobs = [], [] if request.params.logprobs is not None else None
        else:
            tokens, logprobs = [result.token_id], None if result.logprob is None else [result.logprob]
        return SequenceDelta(
            request_id=request.request_id, index=seq.index, new_token_ids=tokens, new_logprobs=logprobs,
            finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=self._take_prompt_logprobs(seq) if request.prompt_lp is not None else None)

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence):
        """The prompt logprobs, once: on sample 0's first delta (n > 1: once per request)."""
        state = seq.request.prompt_lp
        if seq.index != 0 or state.sent or not state.done:
            return None
        state.sent = True
        return state.output()

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
        request, params = seq.request, seq.request.params
        position = seq.num_output_tokens
        # The output list is copied only for the rows that read it (penalties, bad words, min_tokens).
        needs_output = _needs_output(params) or position < params.min_tokens
        return SampleRequest(row, params, request.seed, seq.index, request.prompt_token_ids,
                             seq.output_token_ids if needs_output else (), request.stop_ids, position)

    def _append(self, seq: Sequence, result: SampleResult) -> SequenceDelta | None:
        request = seq.request
        if seq.index in request.dropped:                 # aborted before it existed (n > 1)
            self.scheduler.abort_sequence(seq)
            self._forget_if_done(request)
            return None
        constrained = (self._constrained or self._failed) and request.grammar is not None  # one test unconstrained
        if constrained and request.grammar.error is not None:
            self._fail_constrained(request)
            return None
        if result.blocked:
            if (reason := self._blocked(seq)) is None:
                return None
            self.scheduler.finish(seq, reason)
            self._forget_if_done(request)
            return self._delta(seq, None, reason)
        seq.token_ids.append(result.token_id)
        if result.logprob is not None:
            seq.cumulative_logprob += result.logprob.logprob
        reason = self._finish_reason(seq, result.token_id)
        if constrained and seq.matcher is not None and self._grammar_ends(seq, result.token_id):
            reason = reason or "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._forget_if_done(request)
        return self._delta(seq, result, reason)

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        return self._finish_reason_at(seq, token_id, len(seq.token_ids))

    # ---- constrained decoding (gpu_worker/structured) ---------------------------------------
    def _grammar_mask(self, draws: list[tuple[Sequence, list[int]]]) -> GrammarMask | None:
        """The token bitmask of a step's constrained draws, None when none is. `draws`: each
        drawing sequence with the drafts it verifies, in draw-row order (1 + len(drafts) rows
        each). A sample's first draw makes its matcher from the compiled grammar (settled: the
        scheduler holds a draw until then); a grammar that fails leaves the rows unconstrained
        and the request is ended when its draw is applied (_fail_constrained)."""
        entries = []
        row = 0
        for seq, drafts in draws:
            first, row = row, row + 1 + len(drafts)
            job = seq.request.grammar
            if job is None or job.error is not None:
                continue
            if seq.matcher is None:
                try:
                    seq.matcher = new_matcher(job.wait(), seq.token_ids[seq.num_prompt_tokens:
                                                                         seq.num_tokens - len(drafts)])
                except GrammarError as exc:
                    job.error = job.error or str(exc)
                    continue
            entries.append((first, seq.matcher, drafts))
        if not entries:
            return None
        return self.grammar_masks.build(entries, row)

    @staticmethod
    def _grammar_ends(seq: Sequence, token_id: int) -> bool:
        """Advance seq's matcher by its sampled token: True when the grammar is complete (or,
        never with the mask applied, rejects the token)."""
        return not seq.matcher.accept_token(token_id) or seq.matcher.is_terminated()

    def _fail_constrained(self, request: Request) -> None:
        """End a request whose grammar failed to compile: its blocks go back, take_failed reports it."""
        self._fail(request, request.grammar.error, busy=request.grammar.busy)

    def _fail(self, request: Request, message: str, *, busy: bool = False) -> None:
        """End a request with an error: its blocks go back, take_failed reports it."""
        if self.requests.get(request.request_id) is request:
            self.scheduler.abort(request)
            del self.requests[request.request_id]
            self._forget_constrained(request.request_id)
            self._failed.append(FailedRequest(request.request_id, message, busy))

    def _blocked(self, seq: Sequence) -> str | None:
        """seq drew with every token masked: nothing may be emitted. "stop" when its grammar may
        end here (the masks banned only the stop token it needs: allowed_token_ids without EOS,
        min_tokens); else the request fails with an error naming its masks, and None."""
        if seq.matcher is not None and any(seq.matcher.accept_token(t) for t in self.eos_token_ids):
            return "stop"
        params = seq.request.params
        used = [name for name, on in (("allowed_token_ids", params.allowed_token_ids is not None),
                                      ("bad_words", bool(params.bad_words_token_ids)),
                                      ("min_tokens", params.min_tokens > 0),
                                      ("the structured output constraint", params.structured is not None)) if on]
        self._fail(seq.request, f"no token can be generated at output position {seq.num_output_tokens}: "
                                f"{' and '.join(used) or 'its masks'} together exclude every token; "
                                "allow more tokens or drop a constraint")
        return None

    def _forget_constrained(self, request_id: str) -> None:
        self._constrained.discard(request_id)
        self._compiling.discard(request_id)

    def _settle_grammars(self) -> None:
        """Requests whose compile settled since the last step: the compiled ones draw from this
        step on, the failed ones (a compile error, or the time limit passed) end now, before
        their prompt costs more."""
        for request in self._compiling.poll().failed:
            self._fail_constrained(request)

    def _forget_if_done(self, request: Request) -> None:
        if request.finished:
            self.requests.pop(request.request_id, None)
            self._forget_constrained(request.request_id)
            if any(s.finish_reason == HANDOFF for s in request.seqs):
                self.exported[request.request_id] = request

    # ---- KV hand-off between a prefill and a decode engine (gpu_worker/kv_transfer) ---------
    def release_export(self, request_id: str) -> bool:
        """Free the blocks an exported request holds (the decode engine acknowledged, failed, or
        the request was aborted); its full blocks stay in the prefix cache. False if unknown."""
        request = self.exported.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if seq.finish_reason == HANDOFF:
                self.block_manager.free(seq)
        return True

    def settle(self) -> list[SequenceDelta]:
        """Finish the step async scheduling launched, if any, and return its deltas: afterwards
        every running sequence's KV is final up to its last token (a drain holds them then)."""
        if self._inflight is None:
            return []
        prev, self._inflight = self._inflight, None
        return self._settle(prev)

    def hold_for_move(self, request_id: str) -> bool:
        """A draining engine's running request, to move with its KV (a peer move): it leaves the
        batch and the blocks of each sample still going are held (`exported`, the sample finished
        with HANDOFF) until release_export, like a prefill's export; samples that ended stay
        ended. A decoding request qualifies: every sample still going running, every token of it
        but the last computed, no step in flight (settle() first), n > 1 but under mtp. A
        grammar's matcher stays behind (the peer rebuilds it from the output tokens); with
        speculation, blocks past the computed tokens (slots of drafts) are freed first, so only
        final KV is held, and the proposer hands off what the peer needs (mtp: its pending row,
        as a prefill's export does; a draft model's KV stays, the peer computes its own).
        False: nothing changed (it is recomputed elsewhere instead).

            token_ids   | prompt .......... | output ..... t |   t: drawn, not yet computed
            KV held     |<------- num_tokens - 1 ------->|       blocks: ceil((num_tokens - 1) / bs)
        """
        request = self.requests.get(request_id)
        if (request is None or request.needs_fork or request.export_kv or self._inflight is not None
                or (request.n != 1 and self._hands_off_draft_state)):
            return False
        live = [s for s in request.seqs if s.status is not SequenceStatus.FINISHED]
        if not live or any(s.status is not SequenceStatus.RUNNING or s.num_new_tokens != 1
                           or s.num_output_tokens < 1 for s in live):
            return False
        for seq in live:
            self.block_manager.release_uncomputed(seq)   # lookahead slots: never sent as if valid
            self.scheduler.finish(seq, HANDOFF)          # out of the batch; its blocks stay held
            if self.speculator is not None:
                self.speculator.hold(seq)
        del self.requests[request_id]
        self._forget_constrained(request_id)
        self.exported[request_id] = request
        return True

    def held_outputs(self, request_id: str) -> dict[int, list[int]] | None:
        """Sample index -> output tokens of each sample held by hold_for_move (None if not held)."""
        request = self.exported.get(request_id)
        if request is None or request.export_kv:
            return None
        return {s.index: s.output_token_ids for s in request.seqs if s.finish_reason == HANDOFF}

    def prefilled_blocks(self, request_id: str) -> list[int]:
        """An export_kv request whose prompt is still being computed: the ids of its prompt's
        leading full blocks that the steps so far computed, in table order (their KV is final:
        later chunks write after them; on a GPU, work queued after the step reads them after it).
        [] once its prefill ended, or for any other request. The prefill worker streams these to
        the decode engine while the next chunks run."""
        request = self.requests.get(request_id)
        if request is None or not request.export_kv or len(request.seqs) != 1:
            return []
        seq = request.seqs[0]
        if seq.status is not SequenceStatus.RUNNING:     # waiting, or preempted: nothing computed
            return []
        # mtp's layer moves too, and lags the target by one position (spec_decode/mtp.py)
        final = seq.num_computed_tokens - (1 if self.speculator is not None and self.speculator.handoff_caches() else 0)
        return seq.block_table[:min(final, seq.num_prompt_tokens) // self.config.block_size]

    def keep_export(self, request_id: str) -> bool:
        """Decode an exported request here after all (no decode engine could take it): its
        samples held for the hand-off rejoin the batch with the KV and first tokens they hold, as
        if their KV had just arrived, and draw what they would have drawn; one still prefilling
        just goes on as a request of this engine. False if unknown."""
        request = self.exported.pop(request_id, None)
        if request is None:
            live = self.requests.get(request_id)
            if live is None or not live.export_kv:
                return False
            live.export_kv = False             # still prefilling: it simply goes on here
            return True
        request.export_kv = False
        for seq in request.seqs:
            if seq.finish_reason == HANDOFF:
                seq.finish_reason = None
                self.scheduler.add_prefilled(seq)
                if self.speculator is not None and request.handoff_hidden is not None:
                    self.speculator.resume(seq, request.handoff_hidden)     # mtp: its pending row
        request.handoff_hidden = None
        self.requests[request_id] = request
        if request.grammar is not None:        # its matchers go on from the first tokens
            self._constrained.add(request_id)
        return True

    def import_prefilled(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                         seed: int, samples: list[tuple[int, int, float]] | None, priority: int = 0,
                         cache_salt: str = "", num_cached_tokens: int = 0,
                         num_output_tokens: int = 0) -> Sequence | None:
        """Reserve blocks for a request prefilled on another engine, whose samples (index, first
        token, its cumulative logprob) go on here; None: the other engine is still prefilling
        (its blocks stream in meanwhile) and the samples come with admit_imported. The returned
        sequence's block table covers the prompt: its leading blocks that this engine's prefix
        cache already holds are reused (block_table[:num_computed_tokens // block_size]), the
        rest await the KV. None (nothing reserved) when the pool lacks free blocks now. Raises
        RequestError like add_request. num_output_tokens: a peer move of a decoding request (one
        sample): the last this many ids of prompt_token_ids are its output so far, computed like
        the prompt but counted as output, so it goes on as if it had never moved (a grammar's
        matcher is made at its first draw and accepts that output first: _grammar_mask).

            prompt_token_ids | prompt ............ | output[:-1] |  + samples' token: output[-1]
                             |<- num_prompt_tokens ->|<- num_output_tokens ->|
        """
        tokens = self._validate(request_id, prompt_token_ids, params, priority, cache_salt)
        if not isinstance(num_output_tokens, int) or not 0 <= num_output_tokens < len(tokens) or (
                num_output_tokens and params.n != 1):
            raise RequestError("invalid num_output_tokens: a moved request has one sample and a prompt")
        if not isinstance(num_cached_tokens, int) or not 0 <= num_cached_tokens <= len(tokens):
            raise RequestError("invalid num_cached_tokens: at most the prompt's tokens")
        prompt = tokens[:len(tokens) - num_output_tokens]
        request = self._import_request(request_id, prompt, params, priority, cache_salt, seed, samples)
        if num_output_tokens and num_output_tokens + 1 >= request.max_tokens:   # a move with nothing left to draw
            raise RequestError("invalid num_output_tokens: no room left to generate")
        seq = Sequence(request, min(i for i, _, _ in samples) if samples else 0, list(tokens), len(prompt))
        bm = self.block_manager
        hits = bm.lookup_full_blocks(seq)
        if not bm.allocate_prefill(seq, hits, len(tokens) - len(hits) * bm.block_size):
            return None
        if self.kv_tiers is not None:          # blocks it evicted go down a tier before the KV lands
            self.kv_tiers.flush()
        self._arrivals += 1
        self._submit_grammar(request)
        # a moved request's prompt was computed elsewhere and arrives whole: its usage says cached, as
        # a recomputed move's says for the prompt blocks its new engine found
        request.num_cached_tokens = len(prompt) if num_output_tokens else num_cached_tokens
        self.requests[request_id] = request
        self._importing[request_id] = (seq, sorted(samples) if samples is not None else None)
        return seq

    def import_moved(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                     seed: int, samples: list[tuple[int, int, float]], outputs: dict[int, list[int]],
                     num_shared_blocks: int, priority: int = 0, cache_salt: str = "") -> tuple[list[int], int] | None:
        """Reserve blocks for a peer move of an n > 1 request (kv_transfer/group.py): each sample
        in `samples` (index, its last token, cumulative logprob) goes on from the prompt plus its
        `outputs` (its output but the last token, whose KV comes); the others have ended. Returns
        (the group's transfer table, how many of its leading blocks this engine's prefix cache
        held: they do not move), or None (nothing reserved) when the pool lacks free blocks now.
        admit_imported rebuilds the group: the shared blocks shared, each sample at its position
        (budget, penalties, seeded draws, cumulative logprob as if it had never moved; a draft
        model's KV computed over each sample's moved context)."""
        prompt = self._validate(request_id, prompt_token_ids, params, priority, cache_salt)
        if params.n < 2 or self._hands_off_draft_state:
            raise RequestError("invalid samples: a moved group has n > 1 and needs an engine without mtp")
        request = self._import_request(request_id, prompt, params, priority, cache_salt, seed, samples)
        if sorted(outputs) != sorted(i for i, _, _ in samples) or any(
                _as_token_ids(out, self.vocab_size) is None or len(out) + 1 >= request.max_tokens
                for out in outputs.values()):
            raise RequestError("invalid samples: one output per moved sample, with room left to generate")
        full_blocks = len(prompt) // self.config.block_size
        if not isinstance(num_shared_blocks, int) or not 0 <= num_shared_blocks <= full_blocks:
            raise RequestError("invalid num_shared_blocks: at most the prompt's full blocks")
        seqs = [Sequence(request, i, prompt + list(outputs[i]), len(prompt)) for i in sorted(outputs)]
        hits = group.reserve(self.block_manager, seqs, num_shared_blocks)
        if hits is None:
            return None
        if self.kv_tiers is not None:          # blocks it evicted go down a tier before the KV lands
            self.kv_tiers.flush()
        self._arrivals += 1
        self._submit_grammar(request)
        request.num_cached_tokens = len(prompt)      # computed elsewhere, as a one-sample move's
        self.requests[request_id] = request
        self._importing[request_id] = (seqs[0], sorted(samples))
        self._moved_groups[request_id] = seqs
        self._group_hits[request_id] = hits
        return group.flat_table(seqs, num_shared_blocks), hits

    def _admit_group(self, request_id: str) -> None:
        """admit_imported of a moved group: each sample still going joins the batch on its blocks;
        one aborted meanwhile frees its own (the shared ones stay with the others)."""
        seqs = self._moved_groups.pop(request_id)
        hits = self._group_hits.pop(request_id, 0)
        _, held = self._importing.pop(request_id)
        going_on = {i: (token, logprob) for i, token, logprob in held}
        request = seqs[0].request
        by_index = {s.index: s for s in seqs}
        if self.speculator is not None:        # a draft model's KV of each live sample's context:
            first = hits * self.config.block_size      # the shared blocks once (past this pool's own
            for seq in seqs:                           # hits), then each sample's own blocks
                if seq.index in going_on:
                    own_from, seq.num_computed_tokens = seq.num_computed_tokens, seq.num_tokens
                    self.speculator.catch_up(seq, min(first, own_from), self.config.max_num_batched_tokens)
                    first = own_from
        for index in range(request.n):
            seq = by_index.get(index)
            if seq is not None and index in going_on:
                seq.num_computed_tokens = seq.num_tokens
                self.block_manager.register_computed_blocks(seq)
                token, seq.cumulative_logprob = going_on[index]
                seq.token_ids.append(token)
                self.scheduler.add_prefilled(seq)
                request.seqs.append(seq)
                continue
            if seq is not None:
                self.block_manager.free(seq)
            request.seqs.append(Sequence(request, index, list(request.prompt_token_ids), len(request.prompt_token_ids),
                                         status=SequenceStatus.FINISHED, finish_reason="stop"))

    @property
    def _hands_off_draft_state(self) -> bool:
        """mtp: a moved sequence takes its pending row along (Request.handoff_hidden, one per
        request), so an n > 1 request moves without its KV (recomputed). n-gram drafts need nothing;
        a draft model's KV is computed on the receiver (catch_up)."""
        return self.speculator is not None and bool(self.speculator.handoff_caches())

    def _import_request(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
                        cache_salt: str, seed: int, samples: list[tuple[int, int, float]] | None) -> Request:
        """The Request of an import (a prefilled hand-off's or a peer move's), its checks shared."""
        if request_id in self.exported:
            raise RequestError(f"invalid request_id: {request_id!r} still holds exported KV blocks")
        if samples is not None:
            self._check_samples(params, samples)
        # the sampler's keys take [0, 2**63-1] only (a request's own seed is checked there too)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
            raise RequestError(f"invalid seed: must be an integer in [0, {MAX_SEED}]")
        max_tokens = self.max_model_len - len(prompt)
        if params.max_tokens is not None:
            max_tokens = min(params.max_tokens, max_tokens)
        stop_ids = tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)
        return Request(request_id, prompt, params, int(priority), cache_salt, self._arrivals, seed,
                       max_tokens, stop_ids=stop_ids)

    def _check_samples(self, params: SamplingParams, samples: list[tuple[int, int, float]]) -> None:
        indices = [i for i, _, _ in samples]
        if not samples or len(set(indices)) != len(indices) or not all(0 <= i < params.n for i in indices):
            raise RequestError(f"invalid samples: distinct sample indices in [0, {params.n}) expected")
        if any(_as_token_ids([t], self.vocab_size) is None for _, t, _ in samples) or not all(
                isinstance(lp, float) and lp <= 1e-3 for _, _, lp in samples):   # (NaN compares false; 1e-3: rounding)
            raise RequestError(f"invalid samples: first tokens must be integers in [0, {self.vocab_size}), "
                               "cumulative logprobs floats <= 0 (NaN is not)")

    def admit_imported(self, request_id: str, samples: list[tuple[int, int, float]] | None = None,
                       last_hidden: Any = None) -> None:
        """Every block of an imported request holds its KV now (a moved group's: _admit_group):
        its samples join the batch as if this engine had prefilled the prompt (a draft model first
        computes its own KV of the prompt, and of a moved request's output: the hand-off moves the
        target's only; mtp's layer comes with it, and `last_hidden`, the other engine's hidden
        state (H,) on the host at the last computed position, lets it draft from the first step),
        and its full blocks join the prefix cache. `samples`: those import_prefilled did not have
        yet (raises RequestError when invalid; the request stays importing, for abort_request)."""
        if request_id in self._moved_groups:
            self._admit_group(request_id)
            return
        seq, held = self._importing[request_id]
        if held is None:
            if samples is None:
                raise RequestError("invalid samples: the first tokens of a streamed import are missing")
            self._check_samples(seq.request.params, samples)
            held = sorted(samples)
        resume = None
        if self.speculator is not None and last_hidden is not None:
            resume = self.speculator.resume_state(last_hidden)
        del self._importing[request_id]
        request = seq.request
        hit_tokens = seq.num_computed_tokens   # this engine's own prefix hits: not imported
        seq.num_computed_tokens = seq.num_tokens       # the prompt (and a moved request's output)
        going_on = {i: (token, logprob) for i, token, logprob in held}
        if self.speculator is not None and going_on:   # a draft model's KV of the imported prompt
            self.speculator.catch_up(seq, hit_tokens, self.config.max_num_batched_tokens)
        self.block_manager.register_computed_blocks(seq)
        for index in range(request.n):
            if index not in going_on:          # ended on the prefill engine, or aborted since
                request.seqs.append(Sequence(request, index, list(seq.token_ids), seq.num_prompt_tokens,
                                             status=SequenceStatus.FINISHED, finish_reason="stop"))
                continue
            sample = seq if index == seq.index else seq.fork(index)   # forks share the blocks
            if sample is not seq:
                self.block_manager.fork(seq, sample)
            request.seqs.append(sample)
        if seq.index not in going_on:          # the sequence that reserved the blocks was aborted
            self.block_manager.free(seq)
        for sample in request.seqs:
            if sample.index in going_on:
                token, logprob = going_on[sample.index]
                sample.token_ids.append(token)
                sample.cumulative_logprob = logprob
                self.scheduler.add_prefilled(sample)
                if resume is not None:         # mtp: drafts from its first step
                    self.speculator.resume(sample, resume)

    def is_importing(self, request_id: str) -> bool:
        """True while an imported request's blocks wait for their KV."""
        return request_id in self._importing

    def _abort_handoff(self, request_id: str, index: int | None) -> None:
        """abort_request of a request whose blocks are held for, or awaited from, another engine:
        the whole request frees its blocks; one sample (index) only leaves the hand-off."""
        exported = self.exported.get(request_id)
        if exported is not None:
            for seq in exported.seqs:
                if seq.finish_reason == HANDOFF and index in (None, seq.index):
                    self.block_manager.free(seq)
                    seq.finish_reason = "abort"
            if not any(s.finish_reason == HANDOFF for s in exported.seqs):
                del self.exported[request_id]
            return
        seq, samples = self._importing[request_id]
        if samples is not None:                # known: one sample may leave alone
            samples[:] = [s for s in samples if index not in (None, s[0])]
        if not samples and (samples is not None or index is None):
            self._importing.pop(request_id)
            for held in self._moved_groups.pop(request_id, [seq]):     # a moved group: every sample's
                self.block_manager.free(held)
            self._group_hits.pop(request_id, None)
            del self.requests[request_id]
            self._forget_constrained(request_id)

    def _prepare_gpu(self) -> None:
        """CUDA + triton attention: compile the eager-step kernel variants, then (unless
        enforce_eager) capture decode CUDA graphs: a padded batch ladder up to cuda_graph_max_bs
        rows (_max_decode_rows: verification steps as decode rows count theirs), for contexts up to
        max_model_len; the runner replays them for pure-decode steps that fit (mtp: graphs that keep
        the pre-norm states, and nothing more);
        and prefill graphs for steps that prefill one prompt's up to prefill_graph_max_tokens
        remaining tokens; and piecewise graphs (everything but attention) for the other steps of up
        to piecewise_graph_max_tokens tokens."""
        cfg = self.config
        if self.device.type != "cuda" or self.setup.attention_backend != "triton":
            return
        t = time.perf_counter()
        if hasattr(self.runner, "warmup"):            # compile Triton's eager-step variants now,
            self.runner.warmup(cfg.max_num_seqs, min(cfg.max_num_batched_tokens, self.max_model_len))  # not mid-serving
        if self.speculator is not None:               # a draft model's too (its shapes differ)
            self.speculator.warmup(cfg.max_num_seqs, min(cfg.max_num_batched_tokens, self.max_model_len))
        self._warm_sampler()
        log.info("compiled the eager-step kernels in %.1f s", time.perf_counter() - t)
        if cfg.enforce_eager or not hasattr(self.runner, "capture_cuda_graphs"):
            return
        decode_rows = min(cfg.cuda_graph_max_bs, self._max_decode_rows())
        if self.speculator is not None and self.speculator.reads_prenorm:   # mtp reads pre-norm states:
            self.runner.capture_prenorm_cuda_graphs(decode_rows, self.max_model_len)   # the decode graphs
            log.info("speculative method %s: decode graphs keep the pre-norm states; prefill and piecewise "
                     "steps run eager", self.speculator.config.method)     # keep them; the others could not
            return
        self.runner.capture_cuda_graphs(decode_rows, self.max_model_len)
        prefill_tokens = min(cfg.prefill_graph_max_tokens, cfg.max_num_batched_tokens, self.max_model_len - 1)
        if prefill_tokens > 0 and hasattr(self.runner, "capture_prefill_graphs"):
            self.runner.capture_prefill_graphs(prefill_tokens, self.max_model_len)
        piecewise_tokens = min(cfg.piecewise_graph_max_tokens, cfg.max_num_batched_tokens)
        if piecewise_tokens > 0 and hasattr(self.runner, "capture_piecewise_graphs"):
            self.runner.capture_piecewise_graphs(piecewise_tokens)

    def _max_decode_rows(self) -> int:
        """The most rows a decode step can have: max_num_seqs, or with speculation a verification
        step's up to disable_by_batch_size x (1 + num_speculative_tokens) if more."""
        spec = self.config.speculative
        if spec is None:
            return self.config.max_num_seqs
        verify_rows = min(spec.disable_by_batch_size, self.config.max_num_seqs) * (1 + spec.num_speculative_tokens)
        return max(self.config.max_num_seqs, verify_rows)

    def _warm_sampler(self) -> None:
        """One greedy, one plain and one filtered draw: compiles the sampling kernel."""
        logits = torch.zeros((3, self.vocab_size), dtype=torch.float32, device=self.device)
        kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0),
                 SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01, seed=0)]
        self.sampler(logits, [SampleRequest(i, p, 0, 0, [0], (), (), 0) for i, p in enumerate(kinds)])

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
                   "block_size": bm.block_size, "steps_ahead": self.steps_ahead,
                   **({"spec_decode": self.speculator.stats_dict()} if self.speculator is not None else {}),
                   **({"kv_tiers": self.kv_tiers.stats_dict()} if self.kv_tiers is not None else {})})

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()


def _check_allowed_left(params: SamplingParams, stop_ids: tuple[int, ...]) -> None:
    """A RequestError when the first draw's masks are known to leave no token: every id of
    allowed_token_ids is a one-token bad word, or a stop token that min_tokens masks. (Later
    draws, multi-token bad words and grammars are checked as they draw: Engine._blocked.)"""
    if params.allowed_token_ids is None:
        return
    banned = {word[0] for word in params.bad_words_token_ids if len(word) == 1}
    by = ["bad_words"] if banned else []
    if params.min_tokens > 0 and stop_ids:
        banned.update(stop_ids)
        by.append("min_tokens (it masks EOS and stop_token_ids until min_tokens are generated)")
    if banned.issuperset(params.allowed_token_ids):
        raise RequestError(f"invalid allowed_token_ids: {' and '.join(by)} ban every one of them; "
                           "allow more tokens")
