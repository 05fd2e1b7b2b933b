"""The streaming detokenizer's pure core: workers' token batches in, text deltas out. No sockets.

Run by the tokenizer service (tokenizer_svc/streams.py) and, with --text-in-gateway, by the gateway
itself (services/gateway/core.py: workers then send it their tokens directly, one process hop
less); it lives in services/ because both import it.

    open(StreamOpen)     a request starts: one SampleText (services/text/sample_text.py) per sample;
                         a re-run of a stream it holds (`resumes`: the worker that streamed its first
                         tokens died, another recomputes it with the same seed) keeps the stream and
                         skips as many leading tokens of each sample as it has seen
    step(StepOutput)     -> one TextBatch per gateway (all deltas of this step for it), and an
                            Abort(request, index) to the scheduler for every sample a stop string ended
    migrate(Migrate)     its worker stopped and the scheduler moves it: -> a Resume with each sample's
                         tokens so far (the next worker continues from them, so nothing is skipped);
                         tokens of the request from the worker it left (and from the other half
                         of a hand-off it names) are dropped from then on, until a StreamOpen of a
                         new run on that same worker (a Migrate naming no worker, from a
                         scheduler that restarted: the worker that streamed it last)
                         (the wait it adds to the client's stream: "Moved streams' stall" below);
                         one with resume=False only leaves that worker and answers nothing (a
                         hand-off its prefill worker kept: the decode worker's late tokens)
    abort(Abort)         forget the request (worker aborted it, or its worker died); when some of
                            its samples had not ended, a RequestFailed to its gateway, so the client's
                            stream ends with an error chunk and [DONE] instead of waiting for text
                            that will never come (the gateway drops it when the client left first)

A StepOutput from an older epoch of a worker than one already seen is dropped whole: that
incarnation's lease lapsed and its requests were failed. Tokens dropped, for that reason or because
their stream is gone, are counted in `dropped_tokens` and kvmesh_detok_dropped_tokens_total.

Moved streams' stall: a stream the scheduler moves waits from the last tokens it passed on before
the Migrate (the Migrate itself when none) to the first tokens from its new worker; that wait is
observed in kvmesh_detok_migration_stall_seconds and logged per request, and the stream counted in
kvmesh_detok_migrations_total{outcome="resumed"}. A stream moved again before those tokens waits
on from the first move (one stall, counted once); one aborted first (failed, client left, expired)
observes nothing and counts as "aborted"; a Migrate for a stream not held (it ended meanwhile, or
never opened) as "not_held": the scheduler runs it again from its start and tells its gateway
(Moved), which times a never-opened one's wait from the Submit, as a re-sent one's (an ended one's
gateway has dropped the request). A Migrate naming no worker (a restarted scheduler's, for a request
its gateway sent again) for a stream that has passed nothing on observes nothing here and counts as
"resent": the gateway re-sent it before its first token and times its client's whole wait from the
Submit (kvmesh_gateway_resubmit_wait_seconds), so the two histograms never hold one wait twice.
Times come from `clock` (monotonic; tests inject one).

A sample ends when the engine says so (eos/stop token: "stop", that token's text left out;
"length", "abort") or when one of its stop strings appears in the text, ending past the
sample's min_tokens-th token as in vLLM (then "stop", the text cut right before the stop string, and
the abort frees the sample's KV on the worker). Tokens of an ended sample are ignored. A
"stop" carries its stop_reason: the stop string that matched or the stop token id sampled.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services import metrics
from services.envelope import SCHEDULER, Envelope
from services.protocol.messages import (
    Abort, Migrate, PromptLogprobText, Resume, SeqTokens, StepOutput, StreamOpen, TextBatch, TextDelta,
    TokenLogprobText, failure_of)
from services.protocol.sampling import SamplingParams
from services.text.sample_text import SampleText, stop_token_of

STREAM_MAX_AGE_S = 3600.0  # a stream whose end was lost is forgotten after this (expire())
MAX_WORKERS_REMEMBERED = 4096  # newest epoch per worker id; past this, the first-seen ids go first
log = logging.getLogger("kvmesh.detok")


@dataclass
class _Sample:
    text: SampleText
    done: bool = False
    seen: int = 0          # tokens received for this sample (from its current worker)
    skip: int = 0          # leading tokens of a re-run that the client already has
    token_ids: list[int] = field(default_factory=list)   # every token passed on: where a moved stream resumes


@dataclass
class _Stream:
    reply_addr: str
    params: SamplingParams
    prompt_tail: list[int]
    opened: float
    samples: dict[int, _Sample] = field(default_factory=dict)
    # (worker id, epoch) the request moved away from (-1: every epoch): their late tokens are dropped
    left: frozenset[tuple[str, int]] = frozenset()
    source: tuple[str, int] | None = None   # (worker id, epoch) of the last tokens passed on
    last_sent: float | None = None          # when tokens of it were last passed on
    stalled_since: float | None = None      # moved: last_sent before the move (or the Migrate), until new tokens
    resent: bool = False                    # re-sent before any token passed on: its gateway times the wait

    @property
    def passed_on(self) -> bool:
        """Some sample's tokens (or end) went to the gateway: the gateway's first token came."""
        return any(s.token_ids or s.done for s in self.samples.values())

    @property
    def ended(self) -> bool:
        """Every sample started and ended."""
        return len(self.samples) == self.params.n and all(s.done for s in self.samples.values())


def _skip_seen(sample: _Sample, seq: SeqTokens) -> SeqTokens | None:
    """seq without the leading tokens the client already has (sample.skip of them); None if nothing
    new is left."""
    n = min(sample.skip, len(seq.token_ids))
    sample.skip -= n
    if n == len(seq.token_ids) and seq.finish_reason is None:
        return None
    return SeqTokens(seq.request_id, seq.index, seq.token_ids[n:], seq.logprobs and seq.logprobs[n:],
                     seq.top and seq.top[n:], seq.finish_reason, seq.num_prompt_tokens, seq.num_cached_tokens)


class DetokCore:
    def __init__(self, tokenizer: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.tok = tokenizer
        # the ids the engine stops on besides stop_token_ids (TextTokenizer reads the same config files)
        self.eos_ids: frozenset[int] = frozenset(getattr(tokenizer, "eos_token_ids", ()))
        self.clock = clock
        self.streams: dict[str, _Stream] = {}
        self.stop_hits = 0
        self.samples_started = 0   # samples whose first tokens a step carried (the shell times those steps)
        self._token_text: dict[int, tuple[str, list[int]]] = {}
        self.worker_epochs: dict[str, int] = {}   # worker id -> newest epoch seen
        self.dropped_tokens = {"stale_epoch": 0, "no_stream": 0, "moved": 0}
        self.migrations = dict.fromkeys(metrics.DETOK_MIGRATION_OUTCOMES, 0)   # moved streams by outcome

    def open(self, msg: StreamOpen) -> list[Envelope]:
        stream = self.streams.get(msg.request_id)
        if msg.resumes and stream is not None:
            for sample in stream.samples.values():
                sample.skip, sample.seen = sample.seen, 0
            # a move back to a worker the stream left: its new run streams from here on (its old
            # run's late tokens came before this, on the same connection)
            stream.left = stream.left - {(msg.worker_id, msg.worker_epoch)}
            return []
        self.streams[msg.request_id] = _Stream(msg.reply_addr, msg.params, msg.prompt_tail, self.clock())
        return []

    def migrate(self, msg: Migrate) -> list[Envelope]:
        stream = self.streams.get(msg.request_id)
        if not msg.resume:      # no move: only leave that worker (a hand-off kept by its prefill worker)
            if stream is not None and msg.worker_id:
                stream.left = stream.left | {(msg.worker_id, msg.worker_epoch)}
            return []
        if stream is None:
            self._moved("not_held")
            return [Envelope(msg.reply_addr, Resume(request_id=msg.request_id, output_token_ids=[], known=False))]
        if not stream.passed_on and (stream.resent or not msg.worker_id):
            # re-sent by its gateway before its first token: the gateway times this wait, from the Submit
            if not stream.resent:
                self._moved("resent")
            stream.stalled_since, stream.resent = None, True
        elif stream.stalled_since is None:    # moved again before its new worker's first tokens: one wait
            stream.stalled_since = stream.last_sent if stream.last_sent is not None else self.clock()
        # a scheduler that restarted does not know where the stream ran: the worker that streamed it
        # last is the one it leaves (its late tokens, e.g. a last step racing its end, are dropped)
        left = (msg.worker_id, msg.worker_epoch) if msg.worker_id else stream.source
        if left is not None:
            stream.left = stream.left | {left}
        if msg.also_worker_id:     # the other half of a hand-off, which may have streamed on
            stream.left = stream.left | {(msg.also_worker_id, msg.also_worker_epoch)}
        outputs: list[list[int]] = []
        for index in range(stream.params.n):
            sample = stream.samples.get(index)
            if sample is not None:      # the next worker sends only what follows these
                sample.skip = sample.seen = 0
            outputs.append(list(sample.token_ids) if sample is not None else [])
        ended = [i for i, sample in stream.samples.items() if sample.done]
        return [Envelope(msg.reply_addr, Resume(request_id=msg.request_id, output_token_ids=outputs, ended=ended))]

    def abort(self, msg: Abort) -> list[Envelope]:
        stream = self.streams.pop(msg.request_id, None)
        if stream is not None and stream.stalled_since is not None:
            self._moved("aborted")
        if stream is None or stream.ended:
            return []
        return [Envelope(stream.reply_addr, failure_of(msg))]

    def step(self, msg: StepOutput) -> list[Envelope]:
        if self._is_stale(msg):
            self._drop("stale_epoch", sum(len(seq.token_ids) for seq in msg.seqs))
            return []
        per_gateway: dict[str, list[TextDelta]] = {}
        out: list[Envelope] = []
        now = self.clock()
        for seq in msg.seqs:
            stream = self.streams.get(seq.request_id)
            if stream is None:  # aborted or unknown: nobody waits for it
                self._drop("no_stream", len(seq.token_ids))
                continue
            if stream.left and ((msg.worker_id, msg.epoch) in stream.left or (msg.worker_id, -1) in stream.left):
                # sent before its worker stopped (a restart under the same id is another worker)
                self._drop("moved", len(seq.token_ids))
                continue
            stream.source = (msg.worker_id, msg.epoch)
            if stream.stalled_since is not None and (seq.token_ids or seq.finish_reason):
                self._resumed(seq.request_id, stream, now)
            delta = self._advance(stream, seq, out)
            if delta is not None:
                stream.last_sent = now
                per_gateway.setdefault(stream.reply_addr, []).append(delta)
            if stream.ended:
                del self.streams[seq.request_id]
        out += [Envelope(addr, TextBatch(deltas=d)) for addr, d in per_gateway.items()]
        return out

    def _resumed(self, request_id: str, stream: _Stream, now: float) -> None:
        """A moved stream's first tokens from its new worker: the wait the move added is over."""
        assert stream.stalled_since is not None
        stall, stream.stalled_since = now - stream.stalled_since, None
        metrics.DETOK_MIGRATION_STALL.observe(stall)
        self._moved("resumed")
        # one line per moved request (rare, like the scheduler's "leaves worker" line): kvmesh bench
        # chaos reads these for exact quantiles
        log.info("request %s resumed on its new worker after a stall of %.3f ms", request_id, 1000 * stall)

    def _moved(self, outcome: str) -> None:
        self.migrations[outcome] += 1
        metrics.DETOK_MIGRATIONS.labels(outcome).inc()

    def _drop(self, reason: str, num_tokens: int) -> None:
        if num_tokens:
            self.dropped_tokens[reason] += num_tokens
            metrics.DETOK_DROPPED_TOKENS.labels(reason).inc(num_tokens)

    def _is_stale(self, msg: StepOutput) -> bool:
        newest = self.worker_epochs.get(msg.worker_id)
        if newest is not None and msg.epoch < newest:
            return True
        if newest is None and len(self.worker_epochs) >= MAX_WORKERS_REMEMBERED:
            del self.worker_epochs[next(iter(self.worker_epochs))]
        self.worker_epochs[msg.worker_id] = msg.epoch
        return False

    def _advance(self, stream: _Stream, seq: SeqTokens, out: list[Envelope]) -> TextDelta | None:
        p = stream.params
        sample = stream.samples.get(seq.index)
        if sample is None:
            sample = stream.samples[seq.index] = _Sample(SampleText(self.tok, stream.prompt_tail, p, self.eos_ids))
            self.samples_started += 1
        if sample.done:
            return None
        sample.seen += len(seq.token_ids)
        if sample.skip:
            seq = _skip_seen(sample, seq)
            if seq is None:
                return None
        sample.token_ids += seq.token_ids
        engine_finish = seq.finish_reason
        text, stopped = sample.text.push(seq.token_ids, engine_finish)
        finish, stop_reason = engine_finish, stop_token_of(seq.token_ids, engine_finish, p)
        if stopped:
            finish, stop_reason = "stop", sample.text.matched
            self.stop_hits += 1
            if engine_finish is None:  # the engine is still generating this sample: stop it
                out.append(Envelope(SCHEDULER, Abort(request_id=seq.request_id, index=seq.index, reason="stop")))
        if finish is not None:
            sample.done = True
        logprobs = self._logprobs(seq) if p.logprobs is not None and seq.logprobs is not None else None
        prompt = self._prompt_logprobs(seq) if seq.prompt_logprobs is not None else None
        return TextDelta(seq.request_id, seq.index, text, len(seq.token_ids), finish, logprobs,
                         seq.num_prompt_tokens, seq.num_cached_tokens, stop_reason, prompt)

    def _text_of(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._token_text.get(token_id)
        if cached is None:
            text = self.tok.decode([token_id], skip_special_tokens=False)
            cached = (text, list(text.encode("utf-8", errors="replace")))
            if len(self._token_text) < 1 << 18:
                self._token_text[token_id] = cached
        return cached

    def _logprobs(self, seq: SeqTokens) -> list[TokenLogprobText]:
        out = []
        tops = seq.top or [[] for _ in seq.token_ids]
        for tid, lp, top in zip(seq.token_ids, seq.logprobs or [], tops):
            text, raw = self._text_of(tid)
            alts = [(*self._text_of(t), v) for t, v in top]
            out.append(TokenLogprobText(text, lp, raw, [(a[0], a[2], a[1]) for a in alts]))
        return out

    def _prompt_logprobs(self, seq: SeqTokens) -> list[PromptLogprobText]:
        return [PromptLogprobText(e.token_id, self._text_of(e.token_id)[0], e.logprob, e.rank,
                                  [(t, self._text_of(t)[0], v) for t, v in e.top])
                for e in seq.prompt_logprobs or ()]

    def expire(self, max_age_s: float) -> int:
        """Forget streams older than max_age_s (their end was lost); returns how many."""
        now = self.clock()
        old = [rid for rid, s in self.streams.items() if now - s.opened > max_age_s]
        for rid in old:
            if self.streams.pop(rid).stalled_since is not None:
                self._moved("aborted")
        return len(old)
