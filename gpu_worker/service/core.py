"""The worker's pure core: dispatches and aborts in, one engine step, messages out. No sockets.

    core.run([Dispatch, Abort, ...]) -> [Envelope(dest, msg), ...]

A Dispatch names the worker incarnation (epoch) it was meant for; one for another epoch is refused
with a RequestFailed. When the registry lease lapses and the worker rejoins with a new epoch, the
shell calls rejoin(): every request of the old epoch is dropped without a word (the scheduler has
failed them already), their KV blocks freed.

Per step it emits one StepOutput per detokenizer holding every sequence's new tokens (usually a
single message), a StreamOpen before a request's first tokens (same destination, so ordered),
and a WorkerStatus to the scheduler when requests ended. All engine calls happen in run(), which
the shell executes in one worker thread.

Per request it times where the worker's share of time-to-first-token goes (vLLM's request-level
histograms), observed into `services.metrics` as each stage ends:

    received ──queue──► scheduled ──prefill──► first token ──decode──► last token
       │ └─admit─► in the engine                    │ └─send─► StepOutput on the detokenizer's socket
       └──────────── worker TTFT ───────────────────┘

`received` is when the engine thread read the Dispatch off its socket (run()'s `received`; run()'s
start when not given); `admit` ends when the engine holds the request (decode and validation);
`scheduled` the start of the step that first computed any of its prompt tokens (seen after that
step: the engine's sequence has num_computed_tokens > 0, or the engine already forgot the
request); `first token` / `last token` the end of the step whose StepOutput carried the request's
first / last tokens; `send` ends when the shell handed that StepOutput to the socket
(`note_sent`). The step that produced the first token also reports how long it waited for the
device (`Engine.last_sync_s`, where the engine has it). Decode is observed only for requests that
finished (engine finish or stop string), not for aborted ones. An engine without a `requests`
table gets TTFT and decode only.

Prefill/decode hand-off (the shell moves the KV, gpu_worker/service/handoff.py):

    prefill worker   Dispatch(handoff_to=D) -> the engine prefills with export_kv; the step that
                     draws the first token streams it (HANDOFF is internal: the detokenizer sees an
                     unfinished sample) -> take_handoffs() lists (request, D) once every sample is
                     drawn -> the shell's sender thread moves the KV while this core steps on;
                     an abort meanwhile goes to the sender (take_stops) and the engine keeps the
                     blocks it reads -> handoff_done() frees them: D took the request (it leaves
                     this worker), or not (D had no room, refused, failed or went silent past
                     the hand-off lease): it decodes here (the engine's keep_export), from the
                     KV and first tokens it holds, and the next WorkerStatus lists it in `kept`
                     (the scheduler drops the decode half; should it have moved the request
                     first, its Abort "moved" drops it here too and the stream goes on elsewhere)
    decode worker    AwaitKV -> `awaiting` until the KV arrives -> adopt_imports(): admitted
                     requests decode and stream here; dropped ones leave

Peer moves (a drain that moves requests with their KV): peer_moves.py, whose methods this core has.

Runs: every Dispatch and AwaitKV carries the scheduler's run number of the request (a move is a
new run). Reports echo it (`finished_runs`, `active_runs`, `kept_runs`), so a late report of an
aborted run is not read as one of a later run sent back here. A Dispatch of a request whose earlier
run's blocks the hand-off sender still reads (aborted, not yet released) waits until they are
released (`_deferred`), so the two runs never share the engine's request id.
"""
from __future__ import annotations

import logging
import time

import msgspec
from dataclasses import dataclass, field
from typing import Any

from gpu_worker.outputs import RequestBusy, RequestError, SequenceDelta
from gpu_worker.sequence import HANDOFF
from gpu_worker.service.peer_moves import PeerMoves, peer_fits
from services import metrics
from services.envelope import SCHEDULER, Envelope
from services.protocol.messages import (
    Abort, AwaitKV, Dispatch, MoveKV, PromptTokenLogprob, RequestFailed, SeqTokens, StepOutput, StreamOpen,
    WorkerStatus)
from gpu_worker.service.request_state import Req as _Req

log = logging.getLogger("kvmesh.worker")

@dataclass
class _Deferred:
    """A Dispatch waiting for the blocks of an earlier run of its request to be released."""
    dispatch: Dispatch
    received: float
    ended: set[int] = field(default_factory=set)   # samples aborted meanwhile (stop strings)


class WorkerCore(PeerMoves):
    def __init__(self, engine: Any, worker_id: str, epoch: int, inbox_addr: str = "") -> None:
        self.engine = engine
        self.worker_id, self.epoch = worker_id, epoch
        self.inbox_addr = inbox_addr   # named in StreamOpen: a detokenizing gateway aborts stopped samples here
        self.requests: dict[str, _Req] = {}
        self.num_steps = 0
        self.num_requests = 0       # accepted since start
        self.tokens_out = 0
        self.last_step_s = 0.0
        self._finished: list[tuple[str, int]] = []    # (request id, run) ended since the last status
        self._kept: list[tuple[str, int]] = []        # (request id, run) hand-offs taken back to decode here
        # Dispatches of a request whose earlier run's blocks the sender still reads: run when released
        self._deferred: dict[str, _Deferred] = {}
        # requests whose prompt the engine has not started: checked after every step, so the
        # cost per step is O(requests not yet scheduled). Only for engines that expose a
        # `requests` table (the real engine and the null engine do).
        self._unscheduled: dict[str, _Req] = {}
        self._sees_scheduling = isinstance(getattr(engine, "requests", None), dict)
        self._first_tokens: list[float] = []   # ends of steps that produced first tokens, not yet sent
        self._handoffs: list[tuple[str, str]] = []     # (request id, decode worker) ready to hand off
        self._cancels: list[tuple[str, str]] = []      # (request id, decode worker) that need no hand-off
        # handed to the shell's sender, whose thread reads their blocks: the engine keeps them
        # until handoff_done, even when the request is aborted meanwhile (_stops tells the sender)
        self._sending: set[str] = set()
        self._stops: list[str] = []
        self.hands_off = False                         # prefill worker: the shell runs hand-offs
        self.streams_kv = False                        # ... and streams blocks while prompts prefill
        self._prefilling: dict[str, _Req] = {}         # hand-offs still prefilling, streaming on
        self._stream_blocks: list[tuple[str, str, int, list[int]]] = []   # (rid, D, first block, ids)
        self._streaming: set[str] = set()              # streamed to the sender, not yet submitted
        self.imports: Any = None                       # decode worker: handoff.AwaitedImports
        self.awaiting: dict[str, _Req] = {}            # decode worker: announced, KV not yet here
        # this epoch's hand_back() requests, repeated in every heartbeat: the heartbeat travels on
        # another socket, and one that reached the scheduler first without them in `active` would
        # have it forget them, where `handed_back` has it move them (moving twice is a no-op)
        self.handed_back: list[str] = []
        self._init_peer_moves()                        # peer_moves.py: a drain's moves with the KV

    # ---- one iteration -------------------------------------------------------------------
    def run(self, inbox: list[Any], received: float | None = None) -> list[Envelope]:
        """`received`: perf_counter() when the inbox was read off the socket (default: now)."""
        out: list[Envelope] = []
        self._first_tokens.clear()             # note_sent() follows each run() in the shell
        if received is None:
            received = time.perf_counter()
        for msg in inbox:
            if isinstance(msg, Dispatch):
                self._dispatch(msg, out, received)
            elif isinstance(msg, AwaitKV):
                self._await_kv(msg, out, received)
            elif isinstance(msg, Abort):
                self._abort(msg, out)
            elif isinstance(msg, MoveKV):
                self._move_kv(msg)
        if self.held:
            self._expire_held()
        if self.engine.has_unfinished_requests():
            self._step(out)
        elif hasattr(self.engine, "idle"):     # the null engine has nothing to settle
            self.engine.idle()
        if self._finished or self._kept:
            out.append(Envelope(SCHEDULER, self.status(self._take_finished(), kept=self._take_kept())))
        return out

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def note_sent(self, now: float) -> None:
        """The shell handed run()'s envelopes to their sockets at `now` (perf_counter())."""
        for produced in self._first_tokens:
            metrics.WORKER_FIRST_SEND.observe(now - produced)
        self._first_tokens.clear()

    def rejoin(self, epoch: int) -> int:
        """Serve as incarnation `epoch` from now on. The old epoch's lease lapsed, so the scheduler
        has failed (or, on seeing the new epoch, will fail) every request it held: abort each one in
        the engine (its KV blocks are freed) and emit nothing more for any of them. Cached prefix
        blocks stay. Returns how many requests were dropped."""
        dropped = list(self.requests)
        for rid in dropped:
            self._abort_in_engine(rid)
        for rid in self.awaiting:
            self.imports.abort(rid)
        if self.imports is not None:
            self.imports.take_dropped()
        self.requests.clear()
        self.awaiting.clear()
        self._unscheduled.clear()
        self._finished.clear()
        self._kept.clear()
        self._deferred.clear()
        self._first_tokens.clear()
        self._handoffs.clear()       # the old epoch's cancels still tell their decode workers
        self._prefilling.clear()
        self._stream_blocks.clear()
        self.handed_back = []
        for rid in self.held:
            self.engine.release_export(rid)
        self.held.clear()
        self._peer_moves.clear()
        self.epoch = epoch
        return len(dropped)

    def _dispatch(self, msg: Dispatch, out: list[Envelope], received: float) -> None:
        if msg.epoch != self.epoch:     # meant for an incarnation that is gone (or not yet adopted)
            log.info("refusing request %s dispatched to epoch %d (serving epoch %d)",
                     msg.request_id, msg.epoch, self.epoch)
            out.append(Envelope(msg.reply_addr, RequestFailed(
                request_id=msg.request_id, status=503, code="worker_failed",
                message="the worker serving this request restarted; please retry")))
            return
        if msg.resumes and not self._take_over(msg.request_id):
            return
        if msg.request_id in self._sending and msg.request_id not in self.requests:
            # an earlier run of it, aborted, whose blocks the sender still reads: the engine still
            # holds it under this id, so this run starts once handoff_done released them
            self._deferred[msg.request_id] = _Deferred(msg, received)
            return
        handoff_to = msg.handoff_to if self.hands_off else ""   # no sender here: run it whole
        if msg.kv_from and self.imports is not None and peer_fits(msg):
            self._await_peer(msg, out, received)
            return
        try:
            if handoff_to:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                        priority=msg.priority, cache_salt=msg.cache_salt, export_kv=True)
            elif msg.resume_output:     # moved here mid-stream: it goes on after the tokens streamed
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                        priority=msg.priority, cache_salt=msg.cache_salt,
                                        resume_output=msg.resume_output, resume_ended=msg.resume_ended)
            else:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                        priority=msg.priority, cache_salt=msg.cache_salt)
        except RequestError as exc:
            status, code = (429, "rate_limit_exceeded") if isinstance(exc, RequestBusy) else (400, "invalid_request")
            out.append(Envelope(msg.reply_addr, RequestFailed(
                request_id=msg.request_id, status=status, code=code, message=str(exc))))
            self._finished.append((msg.request_id, msg.run))
            return
        metrics.WORKER_ADMIT.observe(time.perf_counter() - received)
        req = _Req(msg.detok_addr, msg.reply_addr, msg.params.n, received, run=msg.run, handoff_to=handoff_to,
                   prompt_tokens=len(msg.prompt_token_ids), done=set(msg.resume_ended))
        self.requests[msg.request_id] = req
        if handoff_to and self.streams_kv:
            self._prefilling[msg.request_id] = req
        if self._sees_scheduling:
            self._unscheduled[msg.request_id] = req
        self.num_requests += 1
        out.append(Envelope(msg.detok_addr, self._open(msg)))

    def _open(self, msg: Dispatch) -> StreamOpen:
        return StreamOpen(
            request_id=msg.request_id, params=msg.params, reply_addr=msg.reply_addr,
            num_prompt_tokens=len(msg.prompt_token_ids), prompt_tail=msg.prompt_token_ids[-8:],
            worker_addr=self.inbox_addr, resumes=msg.resumes, worker_id=self.worker_id, worker_epoch=self.epoch)

    def _take_over(self, rid: str) -> bool:
        """A re-run of rid, whose prefill worker (or a drained worker moving it here) died: False
        when its KV arrived before that (it decodes here already); else what was reserved for the
        KV is freed, an awaited peer move forgotten, and it runs whole."""
        if rid in self.requests:
            return False
        if self.awaiting.pop(rid, None) is not None:
            self._peer_moves.pop(rid, None)
            self.imports.abort(rid)
            self.imports.take_dropped()
        return True

    def _abort_in_engine(self, rid: str) -> None:
        """Abort rid in the engine, unless its blocks are being sent: the sender is told to stop,
        and handoff_done frees them."""
        if rid in self._sending:
            self._stops.append(rid)
        else:
            self.engine.abort_request(rid)
            self._prefilling.pop(rid, None)
            # blocks streamed while it prefilled, or ready and not yet handed to the sender: D drops it
            if rid in self._streaming or any(h[0] == rid for h in self._handoffs):
                self._streaming.discard(rid)
                self._handoffs = [h for h in self._handoffs if h[0] != rid]
                self._cancels.append((rid, self.requests[rid].handoff_to))

    def _abort(self, msg: Abort, out: list[Envelope]) -> None:
        req = self.requests.get(msg.request_id)
        if req is None and msg.request_id in self.held:      # W: no move now; free the KV
            del self.held[msg.request_id]
            self.engine.release_export(msg.request_id)
            return
        if req is None and msg.request_id in self._sending and msg.request_id not in self._stops:
            self._stops.append(msg.request_id)               # W, mid-move: the sender ends it
            return
        if req is None and msg.request_id in self._peer_moves:   # D: its stream is ours
            if self._peer_sample_ended(msg):
                return
            self._peer_moves.pop(msg.request_id)
            awaited = self.awaiting.pop(msg.request_id)
            self.imports.abort(msg.request_id)
            self.imports.take_dropped()
            self._finished.append((msg.request_id, awaited.run))
            if msg.reason != "moved":
                out.append(Envelope(awaited.detok_addr, Abort(request_id=msg.request_id, reason=msg.reason)))
            return
        if req is None and msg.request_id in self._deferred:
            self._abort_deferred(msg, out)
            return
        if req is None and msg.request_id in self.awaiting:
            if msg.index is not None:          # one sample: it leaves the hand-off, if it has begun
                self.engine.abort_request(msg.request_id, msg.index)
                return
            # its KV has not arrived: free what is reserved; the prefill worker ends the stream
            awaited = self.awaiting.pop(msg.request_id)
            self.imports.abort(msg.request_id)
            self.imports.take_dropped()
            self._finished.append((msg.request_id, awaited.run))
            return
        if req is None:
            return
        if msg.index is None:
            self._abort_in_engine(msg.request_id)
        elif msg.request_id in self._sending:
            # the sample's first token went out already; its blocks go on with the rest (D gets the
            # Abort too), and should this worker keep the request after all, it ends then
            req.stopped.add(msg.index)
            return
        else:
            self.engine.abort_request(msg.request_id, msg.index)
        if msg.index is not None:
            req.done.add(msg.index)
            if len(req.done) < req.n:
                return
        if msg.reason == "stop":         # its last sample ended by a stop string: a finish
            _observe_decode(req)
        del self.requests[msg.request_id]
        self._unscheduled.pop(msg.request_id, None)
        self._finished.append((msg.request_id, req.run))
        if msg.reason != "moved":        # "moved": its stream goes on at another worker; keep it open
            out.append(Envelope(req.detok_addr, Abort(request_id=msg.request_id, reason=msg.reason)))

    def _step(self, out: list[Envelope]) -> None:
        if self._stream_blocks:              # not taken after the last step (output held): this
            self._untake_stream_blocks()     # step may free or reuse those blocks; retake later
        t0 = time.perf_counter()
        try:
            deltas: list[SequenceDelta] = self.engine.step()
        except Exception:  # an engine bug must not hang clients: fail everything in flight
            log.exception("engine step failed; failing %d in-flight requests", len(self.requests))
            self.fail_all("the engine failed while running this request", out)
            return
        t1 = time.perf_counter()
        self.last_step_s = t1 - t0
        self.num_steps += 1
        self._fail_constrained(out)
        if self._unscheduled:
            self._note_scheduled(t0)
        if self._prefilling:
            self._note_prefilled()
        self._emit(deltas, t1, out)

    def settle(self, out: list[Envelope]) -> None:
        """Before hand_back: the step async scheduling launched ends, and its tokens go out, so
        that every running request's KV is final up to its last token (it may move with it)."""
        settle = getattr(self.engine, "settle", None)       # the null engine has none
        if settle is not None:
            self._emit(settle(), time.perf_counter(), out)

    def _emit(self, deltas: list[SequenceDelta], t1: float, out: list[Envelope]) -> None:
        if not deltas:
            return
        per_dest: dict[str, list[SeqTokens]] = {}
        tokens = 0
        for d in deltas:
            req = self.requests.get(d.request_id)
            if req is None:
                continue
            tokens += len(d.new_token_ids)
            handed = d.finish_reason == HANDOFF     # the sample goes on at the decode worker
            per_dest.setdefault(req.detok_addr, []).append(_seq_tokens(d, None if handed else d.finish_reason))
            if d.new_token_ids and req.first_token is None:
                self._first_tokens.append(t1)
                sync_s = getattr(self.engine, "last_sync_s", None)
                if sync_s is not None:
                    metrics.WORKER_FIRST_SYNC.observe(sync_s)
            if d.new_token_ids:
                _note_token(req, t1)
            if d.finish_reason is not None:
                req.done.add(d.index)
                if handed:
                    req.exported = True
                    req.handed.add(d.index)
                if len(req.done) >= req.n:
                    self._prefill_ended(d.request_id, req)
        if tokens:      # live, once a step: a bench finds the worker that holds a stream by it
            self.tokens_out += tokens
            metrics.TOKENS_OUT.inc(tokens)
        for dest, seqs in per_dest.items():
            out.append(Envelope(dest, StepOutput(worker_id=self.worker_id, epoch=self.epoch,
                                                 step=self.num_steps, seqs=seqs)))

    def _fail_constrained(self, out: list[Envelope]) -> None:
        """Requests the engine ended with an error (their grammar did not compile, or their masks
        left no token to draw): a 400 naming the field, or a 429 when the compile waited past its
        queue deadline for a thread (as add_request's RequestBusy), and their stream closed."""
        take = getattr(self.engine, "take_failed", None)
        for rid, message, busy in take() if take is not None else ():
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self._unscheduled.pop(rid, None)
            self._finished.append((rid, req.run))
            status, code = (429, "rate_limit_exceeded") if busy else (400, "invalid_request")
            out.append(Envelope(req.reply_addr, RequestFailed(
                request_id=rid, status=status, code=code, message=message)))
            out.append(Envelope(req.detok_addr, Abort(request_id=rid, reason=code)))

    def _prefill_ended(self, rid: str, req: _Req) -> None:
        """Every sample of rid has drawn its last token here, or its first before a hand-off."""
        self._prefilling.pop(rid, None)
        if req.exported:
            self._handoffs.append((rid, req.handoff_to))   # stays in `requests` until handoff_done
            return
        _observe_decode(req)
        del self.requests[rid]
        self._finished.append((rid, req.run))
        if req.handoff_to:                    # every sample ended at its first token
            self._streaming.discard(rid)
            self._cancels.append((rid, req.handoff_to))

    # ---- prefill/decode hand-off ------------------------------------------------------------
    def take_handoffs(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(to hand off, to cancel at the decode worker): (request id, decode worker address).
        The blocks of those to hand off stay held until handoff_done."""
        todo, cancel = self._handoffs, self._cancels
        self._handoffs, self._cancels = [], []
        self._sending.update(rid for rid, _ in todo)
        self._streaming.difference_update(rid for rid, _ in todo)
        return todo, cancel

    def _note_prefilled(self) -> None:
        """Hand-offs whose prompt the last step computed more full blocks of (engine.prefilled_blocks):
        those blocks are streamed while the next chunks run."""
        for rid, req in self._prefilling.items():
            ids = self.engine.prefilled_blocks(rid)
            if len(ids) > req.streamed:
                self._stream_blocks.append((rid, req.handoff_to, req.streamed, ids[req.streamed:]))
                req.streamed = len(ids)

    def _untake_stream_blocks(self) -> None:
        for rid, _, first, _ in self._stream_blocks:
            req = self._prefilling.get(rid)
            if req is not None:
                req.streamed = min(req.streamed, first)
        self._stream_blocks.clear()

    def take_stream_blocks(self) -> list[tuple[str, str, int, list[int]]]:
        """(request id, decode worker, first block, block ids): blocks to stream now, copied by the
        sender right away (the shell calls this after the step's output went out)."""
        ready, self._stream_blocks = self._stream_blocks, []
        self._streaming.update(rid for rid, *_ in ready)
        return ready

    def stop_streaming(self, rid: str) -> None:
        """The sender streams no more of rid (its snapshot budget is spent): the rest goes after its
        first token."""
        self._prefilling.pop(rid, None)

    def take_stops(self) -> list[str]:
        """Requests aborted while their hand-off runs: the sender ends it (handoff_done follows)."""
        stops, self._stops = self._stops, []
        return stops

    def handoff_done(self, rid: str, ok: bool, reason: str, out: list[Envelope]) -> None:
        """rid's hand-off ended, on the engine thread. ok: D holds it now, P's blocks are released.
        Not ok (D had no room, refused, failed, or went silent past the lease: dead, perhaps, before
        the scheduler noticed): this worker decodes it itself from the KV and first tokens it holds,
        the cheapest continuation, and lists it in `kept` for the scheduler. A request aborted
        meanwhile (its blocks were held for the sender) is released; so is one the engine cannot
        keep, whose client then gets a RequestFailed."""
        if rid not in self._sending:          # its streaming ended while it still prefilled
            self._stream_ended(rid, reason, out)
            return
        self._sending.discard(rid)
        req = self.requests.get(rid)
        if not ok and req is not None and self.engine.keep_export(rid):
            log.info("request %s: its hand-off failed (%s); decoding it here", rid, reason)
            req.done -= req.handed
            req.handed.clear()
            req.exported, req.handoff_to = False, ""
            self._kept.append((rid, req.run))
            for index in sorted(req.stopped):  # else those samples would decode on, for nobody
                if rid in self.requests:
                    self._abort(Abort(request_id=rid, index=index, reason="stop"), out)
            return
        self.engine.release_export(rid)
        if req is None:                       # aborted while its blocks were read
            self._start_deferred(rid, out)
            return
        del self.requests[rid]
        self._finished.append((rid, req.run))
        if not ok:
            out.append(Envelope(req.reply_addr, RequestFailed(
                request_id=rid, status=503, code="worker_failed",
                message="the request's hand-off to a decode worker failed; please retry")))
            out.append(Envelope(req.detok_addr, Abort(request_id=rid, reason="worker_failed")))

    def _stream_ended(self, rid: str, reason: str, out: list[Envelope]) -> None:
        """The decode worker refused or failed rid's streamed blocks before its first token: it
        simply goes on here, as a request of this worker (listed in `kept`); should the engine not
        keep it, its client gets a RequestFailed, as for a hand-off that fails."""
        if rid not in self._streaming:        # ended here meanwhile (aborted): nothing left to do
            return
        self._streaming.discard(rid)
        self._prefilling.pop(rid, None)
        req = self.requests.get(rid)
        if req is None:
            return
        if self.engine.keep_export(rid):
            log.info("request %s: its decode worker took no blocks (%s); running it here", rid, reason)
            req.handoff_to = ""
            self._kept.append((rid, req.run))
            return
        self.engine.abort_request(rid)
        del self.requests[rid]
        self._unscheduled.pop(rid, None)
        self._finished.append((rid, req.run))
        out.append(Envelope(req.reply_addr, RequestFailed(
            request_id=rid, status=503, code="worker_failed",
            message="the request's hand-off to a decode worker failed; please retry")))
        out.append(Envelope(req.detok_addr, Abort(request_id=rid, reason="worker_failed")))

    def _start_deferred(self, rid: str, out: list[Envelope]) -> None:
        """rid's earlier run released its blocks: a later run that waited for that starts now,
        with the sample aborts that came for it meanwhile."""
        deferred = self._deferred.pop(rid, None)
        if deferred is None:
            return
        self._dispatch(deferred.dispatch, out, deferred.received)
        for index in sorted(deferred.ended):
            if rid in self.requests:
                self._abort(Abort(request_id=rid, index=index, reason="stop"), out)

    def _abort_deferred(self, msg: Abort, out: list[Envelope]) -> None:
        """An Abort for a run that waits for its earlier run's blocks (_deferred): one sample is
        noted for its start; the whole request ends here, as a started one would."""
        deferred = self._deferred[msg.request_id]
        if msg.index is not None:
            deferred.ended.add(msg.index)
            if len(deferred.ended) < deferred.dispatch.params.n:
                return
        del self._deferred[msg.request_id]
        self._finished.append((msg.request_id, deferred.dispatch.run))
        if msg.reason != "moved":
            out.append(Envelope(deferred.dispatch.detok_addr, Abort(request_id=msg.request_id, reason=msg.reason)))

    def _await_kv(self, msg: AwaitKV, out: list[Envelope], received: float) -> None:
        if msg.epoch != self.epoch or self.imports is None or msg.request_id in self.requests:
            log.info("refusing to await the KV of %s (epoch %d, serving epoch %d, role without a KV socket: %s)",
                     msg.request_id, msg.epoch, self.epoch, self.imports is None)
            self._finished.append((msg.request_id, msg.run))
            return
        self.awaiting[msg.request_id] = _Req(msg.detok_addr, msg.reply_addr, msg.n, received, run=msg.run)
        self.imports.await_request(msg.request_id)
        self.num_requests += 1

    def adopt_imports(self, out: list[Envelope]) -> None:
        """After the shell served the KV socket: requests admitted decode here from now on; a peer
        move whose KV did not come is recomputed here (its failure, if any, goes to `out`)."""
        now = time.perf_counter()
        for rid in self.imports.take_admitted():
            req = self.awaiting.pop(rid, None)
            if req is not None:
                req.first_token = req.last_token = now    # the first token came from the prefill worker
                self.requests[rid] = req
                self._peer_admitted(rid)
        for rid in self.imports.take_dropped():
            if rid in self._peer_moves:
                self._peer_fallback(rid, out)
            elif (req := self.awaiting.pop(rid, None)) is not None:
                self._finished.append((rid, req.run))

    def hand_back(self) -> WorkerStatus:
        """Draining, out of time: stop every request held here and free its KV, without a word to
        its detokenizer (its stream goes on at another worker). Returns the status that lists them
        for the scheduler (`handed_back`), which moves each one."""
        moved = [rid for rid in self._peer_moves if rid in self.awaiting]   # streams of ours, KV not here
        handed = [*self.requests, *self._deferred, *moved]
        # listed before they leave `requests`: a heartbeat built meanwhile names them one way or the other
        self.handed_back = [*self.handed_back, *handed]   # a new list: the heartbeat thread reads it
        held: list[str] = []
        deadline = time.monotonic() + self.move_lease_s
        for rid in self.requests:
            if self._hold_for_peer(rid):
                self.held[rid] = deadline              # its KV waits for a MoveKV, up to the lease
                held.append(rid)
            else:
                self._abort_in_engine(rid)
        self._log_drain_ways(len(held), len(self.requests) - len(held))
        self._deferred.clear()          # never started: nothing of theirs is in the engine
        for rid, req in self.awaiting.items():   # KV awaited from a prefill worker: that one ends the stream
            self.imports.abort(rid)
            if rid not in self._peer_moves:
                self._finished.append((rid, req.run))
        self._peer_moves.clear()
        if self.imports is not None:
            self.imports.take_dropped()
        self.requests.clear()
        self.awaiting.clear()
        self._unscheduled.clear()
        status = self.status(self._take_finished(), handed_back=handed, kept=self._take_kept())
        return msgspec.structs.replace(status, kv_held=held) if held else status

    def fail_all(self, message: str, out: list[Envelope]) -> None:
        for rid, req in list(self.requests.items()):
            self._abort_in_engine(rid)
            out.append(Envelope(req.reply_addr, RequestFailed(
                request_id=rid, status=500, code="worker_error", message=message)))
            out.append(Envelope(req.detok_addr, Abort(request_id=rid, reason="worker_failed")))
            self._finished.append((rid, req.run))
        for rid, deferred in self._deferred.items():
            d = deferred.dispatch
            out.append(Envelope(d.reply_addr, RequestFailed(request_id=rid, status=500, code="worker_error",
                                                            message=message)))
            out.append(Envelope(d.detok_addr, Abort(request_id=rid, reason="worker_failed")))
            self._finished.append((rid, d.run))
        self.requests.clear()
        self._deferred.clear()
        self._unscheduled.clear()

    # ---- request stage times --------------------------------------------------------------
    def _note_scheduled(self, step_start: float) -> None:
        """Requests whose prompt the step that began at step_start started computing."""
        engine_requests = self.engine.requests
        for rid, req in list(self._unscheduled.items()):
            ereq = engine_requests.get(rid)
            # gone: finished (or failed) within the step, so it was scheduled in it
            if ereq is None or (ereq.seqs and ereq.seqs[0].num_computed_tokens > 0):
                del self._unscheduled[rid]
                req.scheduled = step_start
                metrics.WORKER_QUEUE.observe(step_start - req.received)

    # ---- load ----------------------------------------------------------------------------
    def _take_finished(self) -> list[tuple[str, int]]:
        done, self._finished = self._finished, []
        return done

    def _take_kept(self) -> list[tuple[str, int]]:
        kept, self._kept = self._kept, []
        return kept

    def load(self) -> dict[str, int]:
        s = self.engine.stats()
        return {"running": s.num_running, "waiting": s.num_waiting, "free_blocks": s.num_free_blocks,
                "cached_blocks": s.num_cached_blocks, "total_blocks": s.num_total_blocks,
                "requests": len(self.requests) + len(self.awaiting) + len(self._deferred),
                "requests_total": self.num_requests,
                "tokens_out": self.tokens_out, "prefix_query_tokens": s.prefix_query_tokens,
                "prefix_hit_tokens": s.prefix_hit_tokens, "pending_prompt_tokens": self.pending_prompt_tokens()}

    def pending_prompt_tokens(self) -> int:
        """Prompt tokens of the requests held here that have no first token yet: the prefill
        backlog (prefix-cache hits and chunks already computed still count, so it is an upper
        bound). The heartbeat thread calls this while the engine thread runs: list() copies the
        table in one step under the GIL, where iterating the dict itself could see it change."""
        return sum(r.prompt_tokens for r in list(self.requests.values()) if r.first_token is None)

    def status(self, finished: list[tuple[str, int]] | None = None, with_active: bool = False,
               handed_back: list[str] | None = None, kept: list[tuple[str, int]] | None = None) -> WorkerStatus:
        """Load numbers; `finished` and `kept`: (request, run) pairs after steps; `with_active`
        (heartbeats) lists every request held, with its run; `handed_back`: hand_back()'s requests
        (heartbeats repeat all of this epoch's)."""
        s = self.engine.stats()
        finished, kept = finished or [], kept or []
        active = active_runs = None
        if with_active:                   # copied in one step each: the engine thread changes them
            held = [*((rid, r.run) for rid, r in list(self.requests.items())),
                    *((rid, r.run) for rid, r in list(self.awaiting.items())),
                    *((rid, d.dispatch.run) for rid, d in list(self._deferred.items()))]
            active, active_runs = [rid for rid, _ in held], [run for _, run in held]
        return WorkerStatus(worker_id=self.worker_id, epoch=self.epoch, running=s.num_running,
                            waiting=s.num_waiting, free_blocks=s.num_free_blocks,
                            cached_blocks=s.num_cached_blocks, total_blocks=s.num_total_blocks,
                            finished=[rid for rid, _ in finished], finished_runs=[run for _, run in finished],
                            active=active, active_runs=active_runs,
                            kept=[rid for rid, _ in kept], kept_runs=[run for _, run in kept],
                            handed_back=handed_back or (self.handed_back if with_active else []))


def _note_token(req: _Req, now: float) -> None:
    if req.first_token is None:
        req.first_token = now
        metrics.WORKER_TTFT.observe(now - req.received)
        if req.scheduled is not None:
            metrics.WORKER_PREFILL.observe(now - req.scheduled)
    req.last_token = now


def _observe_decode(req: _Req) -> None:
    if req.first_token is not None:
        metrics.WORKER_DECODE.observe(req.last_token - req.first_token)


def _seq_tokens(d: SequenceDelta, finish_reason: str | None) -> SeqTokens:
    """`finish_reason`: d's, or None for a sample that goes on at a decode worker (its stream has
    not finished)."""
    logprobs = top = None
    if d.new_logprobs:
        logprobs = [lp.logprob for lp in d.new_logprobs]
        top = [[(int(t), float(v)) for t, v in lp.top] for lp in d.new_logprobs]
    prompt = None
    if d.prompt_logprobs is not None:
        prompt = [PromptTokenLogprob(e.token_id, e.logprob, e.rank, [(int(t), float(v)) for t, v in e.top])
                  for e in d.prompt_logprobs]
    return SeqTokens(d.request_id, d.index, list(d.new_token_ids), logprobs, top, finish_reason,
                     d.num_prompt_tokens, d.num_cached_tokens, prompt)
