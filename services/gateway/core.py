"""The gateway's pure core: the request table and every request's state machine. No sockets, no
clock of its own (each call takes `now`, monotonic seconds), no event loop.

    submitted ──every prompt Admitted──► admitted ──first text──► streaming ──every sample ended──► finished
        │                                   │                         │
        ├─ Rejected / RequestFailed ────────┼─► rejected              ├─ RequestFailed, timeout,
        └─ admission deadline ──────────────┘   (a plain error)       │  orphaned ──► failed
                                                                      │  (an error chunk, then [DONE])
                   close() before the end (the client left) ──────────┴─► aborted (Aborts upstream)

A job is one HTTP request: one internal request per prompt (`rids`), each with n samples. The shell
(services/gateway/backend.py) feeds the core what its inbox reads (`step`), asks it to check a
job's deadline when a wait runs out (`expire`), and carries out what it answers: `Outbox.deliver`
(per job: JOB_ADMITTED, (prompt index, TextDelta) or an ApiError, in order) and `Outbox.send`
(Envelope(dest, msg): SCHEDULER, a worker's inbox address, or for a Resume the inbox of the
scheduler that asked).

When the gateway turns tokens into text itself (the local text path), `step` also takes the
workers' StreamOpen / StepOutput / Abort (and the scheduler's Migrate, whose Resume goes back to
the scheduler that asked) and runs them through the text path's DetokCore; a stop
string that ends a sample still running is told to its worker directly (StreamOpen names the
worker's inbox) and to the scheduler, whose bookkeeping ends with it.

The scheduler holds nothing a request needs to stream (tokens go worker -> detokenizer -> gateway),
but a request it queued is lost with it, and only it can move a request whose worker dies. So when
the registry names another scheduler (`redrive`), every live job's unfinished requests are sent to
it again (Submit.resubmitted: it adopts those a worker holds and moves or starts the rest), at most
MAX_SUBMITS times a job; with no scheduler registered a job waits, within its deadline (a job not
yet admitted: admission_timeout_s from its first submit).

What a move before the first token costs the client: a request sent again before its first token
(the scheduler that died had it queued, or its worker died with it), or one the scheduler moved off a
stopped worker before it opened its stream (Moved: dispatched to a worker that died before running
it), waits from its Submit to that first token, and only this core sees both ends on one clock:
kvmesh_gateway_resubmit_wait_seconds and one INFO line per request, naming which. One that had
streamed is its detokenizer's to time (services/text/streams.py: the wait from its last tokens), and
the detokenizer leaves a re-sent stream that had passed nothing on to this one.

Messages for a job that already ended (or that this gateway never made) are dropped and counted in
`late_messages`; a StepOutput from an older epoch of a worker is dropped by the DetokCore.
"""
from __future__ import annotations

import enum
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from services import metrics
from services.envelope import SCHEDULER, Envelope
from services.gateway.schemas import ApiError, param_of
from services.protocol.messages import (
    Abort, Admitted, Migrate, Moved, Rejected, RequestFailed, StepOutput, StreamOpen, Submit, TextBatch, TextDelta,
    failure_of)
from services.text.streams import DetokCore


class Phase(enum.Enum):
    SUBMITTED = "submitted"
    ADMITTED = "admitted"
    STREAMING = "streaming"
    FINISHED = "finished"
    REJECTED = "rejected"
    FAILED = "failed"
    ABORTED = "aborted"


LIVE = (Phase.SUBMITTED, Phase.ADMITTED, Phase.STREAMING)
JOB_ADMITTED = "admitted"   # delivered once, when the scheduler accepted every prompt of the job
MAX_SUBMITS = 3             # a job's Submits go out at most this often (the first time and after scheduler restarts)
log = logging.getLogger("kvmesh.gateway")


class Delivery(NamedTuple):
    job_id: int
    item: Any   # JOB_ADMITTED, (prompt index, TextDelta) or an ApiError (the job ended)


@dataclass
class Outbox:
    deliver: list[Delivery] = field(default_factory=list)
    send: list[Envelope] = field(default_factory=list)
    first_text: list[Job] = field(default_factory=list)   # jobs whose first tokens this call brought


@dataclass
class Job:
    id: int
    rids: list[str]
    n: int
    scheduler_addr: str                  # the scheduler holding these requests (its address and registry id)
    submitted_at: float
    deadline: float                      # admission deadline, then the progress deadline
    phase: Phase = Phase.SUBMITTED
    waiting: set[str] = field(default_factory=set)                   # prompts not yet admitted
    unfinished: set[tuple[str, int]] = field(default_factory=set)    # (request id, sample) not ended
    first_read: float = 0.0              # when the first tokens' text was ready (the shell's clock; 0: not yet)
    tokens_seen: bool = False            # text with tokens arrived
    index: dict[str, int] = field(default_factory=dict)              # request id -> prompt index
    submits: dict[str, Submit] = field(default_factory=dict)         # request id -> its Submit (sent again;
                                                                     # its detok_addr streams its text)
    sends: int = 1                       # times its Submits went to a scheduler
    started: set[str] = field(default_factory=set)    # request ids whose first tokens (or end) came
    resent_early: set[str] = field(default_factory=set)   # request ids sent again before that: timed then
    moved_early: set[str] = field(default_factory=set)    # request ids moved (Moved) before that: timed then

    @property
    def progressed(self) -> bool:
        """Text arrived: the requests reached a worker, so the scheduler no longer holds them."""
        return self.phase is Phase.STREAMING


def _error_type(status: int) -> str:
    return {400: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")


def _param(status: int, message: str) -> str | None:
    """A worker's 400 (a parameter only it can judge, e.g. a token id past the vocabulary) names
    its field the way the gateway's own checks do."""
    return param_of(message) if status == 400 else None


class GatewayCore:
    def __init__(self, admission_timeout_s: float, request_timeout_s: float,
                 detok: DetokCore | None = None) -> None:
        self.admission_timeout_s, self.request_timeout_s = admission_timeout_s, request_timeout_s
        self.detok = detok                       # the local text path's stream core, else None
        self.jobs: dict[int, Job] = {}
        self.job_of: dict[str, Job] = {}         # request id -> its live job
        self.worker_of: dict[str, str] = {}      # request id -> its worker's inbox (local text: StreamOpen)
        self.late_messages = 0
        self._ids = itertools.count(1)

    # ---- the client's side -----------------------------------------------------------------
    def submit(self, submits: list[Submit], n: int, scheduler_addr: str, now: float) -> Job:
        """A job whose Submits the shell is about to send (one per prompt)."""
        rids = [s.request_id for s in submits]
        job = Job(next(self._ids), rids, n, scheduler_addr, now, now + self.admission_timeout_s, waiting=set(rids),
                  unfinished={(rid, j) for rid in rids for j in range(n)},
                  index={rid: i for i, rid in enumerate(rids)}, submits={s.request_id: s for s in submits})
        self.jobs[job.id] = job
        for rid in rids:
            self.job_of[rid] = job
        return job

    def close(self, job_id: int, now: float) -> Outbox:
        """The route is done with the job: a job still live is aborted (its client left)."""
        out = Outbox()
        job = self.jobs.get(job_id)
        if job is not None:
            if job.phase in LIVE:
                self._end(job, Phase.ABORTED, out, "client")
            self._forget(job)
        return out

    def expire(self, now: float, job_id: int | None = None) -> Outbox:
        """Fail the job (or every job) whose deadline has passed: no admission in
        admission_timeout_s, or no progress in request_timeout_s."""
        out = Outbox()
        jobs = list(self.jobs.values()) if job_id is None else [self.jobs[job_id]] if job_id in self.jobs else []
        for job in jobs:
            if job.phase not in LIVE or now < job.deadline:
                continue
            if job.phase is Phase.SUBMITTED:
                self._fail(job, Phase.REJECTED, ApiError(
                    503, "the scheduler did not answer in time; retry later", type_="server_error",
                    code="scheduler_unavailable", retry_after=1), out, "timeout")
            else:
                self._fail(job, Phase.FAILED, ApiError(504, "the request made no progress in time",
                                                       type_="server_error", code="timeout"), out, "timeout")
        return out

    def fail_all(self, reason: str) -> Outbox:
        """This gateway is stopping: end every live job with the error an Abort for `reason` means."""
        out = Outbox()
        for job in list(self.jobs.values()):
            if job.phase in LIVE:
                self._on_failed(job, failure_of(Abort(request_id=job.rids[0], reason=reason)), out, reason,
                                failed="")
        return out

    def redrive(self, scheduler_addr: str) -> Outbox:
        """The registry names `scheduler_addr` ("": none): send every live job held by another one
        to it again, or fail a job sent MAX_SUBMITS times already (a scheduler restarting in a loop)."""
        out = Outbox()
        if not scheduler_addr:
            return out
        for job in list(self.jobs.values()):
            if job.phase not in LIVE or job.scheduler_addr == scheduler_addr:
                continue
            if job.sends >= MAX_SUBMITS:
                self._on_failed(job, RequestFailed(
                    request_id=job.rids[0], status=503, code="scheduler_failed",
                    message="the scheduler holding this request stopped; please retry"), out, "client", failed="")
                continue
            job.scheduler_addr, job.sends = scheduler_addr, job.sends + 1
            unfinished = {rid for rid, _ in job.unfinished}
            job.resent_early |= unfinished - job.started
            out.send += [Envelope(SCHEDULER, msgspec.structs.replace(job.submits[rid], resubmitted=True))
                         for rid in job.rids if rid in unfinished]
        return out

    def orphans(self, live_detok_addrs: set[str]) -> Outbox:
        """Fail jobs that can no longer finish instead of letting them wait request_timeout_s: the
        detokenizer streaming a request's text is gone."""
        out = Outbox()
        for job in list(self.jobs.values()):
            if job.phase in LIVE and any(job.submits[rid].detok_addr not in live_detok_addrs
                                           for rid, _ in job.unfinished):
                self._on_failed(job, RequestFailed(
                    request_id=job.rids[0], status=503, code="tokenizer_failed",
                    message="the service streaming this request's text stopped; please retry"), out, "client",
                    failed="")
        return out

    # ---- the inbox -------------------------------------------------------------------------
    def step(self, msgs: list[Any], now: float) -> Outbox:
        out = Outbox()
        for msg in msgs:
            if isinstance(msg, TextBatch):
                self._deltas(msg.deltas, now, out)
            elif isinstance(msg, (StreamOpen, StepOutput, Abort, Migrate)):
                self._text_stream(msg, now, out)
            elif (job := self.job_of.get(msg.request_id)) is None:
                self.late_messages += 1
            elif isinstance(msg, Admitted):
                self._admitted(job, msg.request_id, now, out)
            elif isinstance(msg, Moved):
                if msg.request_id not in job.started:
                    job.moved_early.add(msg.request_id)
            elif isinstance(msg, Rejected):
                self._fail(job, Phase.REJECTED, ApiError(
                    msg.status, msg.message, type_=_error_type(msg.status), code=msg.code,
                    retry_after=msg.retry_after_s, param=_param(msg.status, msg.message)), out, "client",
                    failed=msg.request_id)
            else:
                self._on_failed(job, msg, out, "client")
        return out

    def _admitted(self, job: Job, rid: str, now: float, out: Outbox) -> None:
        if job.phase is not Phase.SUBMITTED:
            return
        job.waiting.discard(rid)
        if not job.waiting:
            job.phase = Phase.ADMITTED
            job.deadline = now + self.request_timeout_s
            out.deliver.append(Delivery(job.id, JOB_ADMITTED))

    def _deltas(self, deltas: list[TextDelta], now: float, out: Outbox) -> None:
        for d in deltas:
            job = self.job_of.get(d.request_id)
            if job is None:
                self.late_messages += 1
                continue
            if job.phase is Phase.SUBMITTED:   # text overtook the admission: it was admitted
                self._admitted(job, d.request_id, now, out)
            if not job.tokens_seen and d.num_new_tokens:
                job.tokens_seen = True
                out.first_text.append(job)
            if d.request_id not in job.started and (d.num_new_tokens or d.finish_reason is not None):
                self._started(job, d.request_id, now)
            job.phase = Phase.STREAMING
            job.deadline = now + self.request_timeout_s
            out.deliver.append(Delivery(job.id, (job.index[d.request_id], d)))
            if d.finish_reason is not None:
                job.unfinished.discard((d.request_id, d.index))
                if not job.unfinished:
                    job.phase = Phase.FINISHED
                    self._forget_requests(job)

    @staticmethod
    def _started(job: Job, rid: str, now: float) -> None:
        """The request's first tokens came: a request sent again before them has its wait timed."""
        job.started.add(rid)
        if rid not in job.resent_early and rid not in job.moved_early:
            return
        # sent again and moved too (a restart while it moved) is one wait, logged once as re-sent
        how = "sent again" if rid in job.resent_early else "moved off its worker"
        job.resent_early.discard(rid)
        job.moved_early.discard(rid)
        wait = now - job.submitted_at
        metrics.GATEWAY_RESUBMIT_WAIT.observe(wait)
        # one line per such request (rare, like the detokenizer's per moved stream): kvmesh bench
        # chaos reads these for exact quantiles
        log.info("request %s, %s before its first token, got it %.3f ms after its submit", rid, how, 1000 * wait)

    def _text_stream(self, msg: StreamOpen | StepOutput | Abort | Migrate, now: float, out: Outbox) -> None:
        """A worker's (or the scheduler's) message for the local text path's detokenizer."""
        if self.detok is None:
            self.late_messages += 1
            return
        if isinstance(msg, Migrate):             # the Resume goes to the scheduler's inbox it names
            out.send += self.detok.migrate(msg)
            return
        if isinstance(msg, StreamOpen):
            if msg.request_id in self.job_of and msg.worker_addr:
                self.worker_of[msg.request_id] = msg.worker_addr
            self.detok.open(msg)
            return
        envelopes = self.detok.step(msg) if isinstance(msg, StepOutput) else self.detok.abort(msg)
        for env in envelopes:
            if env.dest == SCHEDULER:            # a stop string ended a sample the worker still runs
                worker = self.worker_of.get(env.msg.request_id)
                if worker:
                    out.send.append(Envelope(worker, env.msg))
                out.send.append(Envelope(SCHEDULER, env.msg))
            elif isinstance(env.msg, TextBatch):
                self._deltas(env.msg.deltas, now, out)
            elif (job := self.job_of.get(env.msg.request_id)) is not None:   # RequestFailed: an aborted stream
                self._on_failed(job, env.msg, out, "client")
            else:
                self.late_messages += 1

    # ---- ends ------------------------------------------------------------------------------
    def _on_failed(self, job: Job, msg: RequestFailed, out: Outbox, abort_reason: str,
                   failed: str | None = None) -> None:
        """A RequestFailed for one of the job's requests: before admission a plain error, after it
        an error that ends the stream (a plain error still when nothing was streamed). Retry after
        1 s when the stack is unavailable (503) or busy (429: a worker's per-key compile cap). The
        failed request is not aborted (upstream ended it) unless `failed` says otherwise ("")."""
        failed = msg.request_id if failed is None else failed
        retry_after = 1 if msg.status in (429, 503) else 0
        if job.phase is Phase.SUBMITTED:
            self._fail(job, Phase.REJECTED, ApiError(
                msg.status, msg.message, type_=_error_type(msg.status), code=msg.code,
                retry_after=retry_after, param=_param(msg.status, msg.message)),
                out, abort_reason, failed=failed)
        else:
            self._fail(job, Phase.FAILED, ApiError(
                msg.status, msg.message, type_=_error_type(msg.status), code=msg.code, retry_after=retry_after,
                param=_param(msg.status, msg.message)), out, abort_reason, failed=failed)

    def _fail(self, job: Job, phase: Phase, err: ApiError, out: Outbox, abort_reason: str,
              failed: str = "") -> None:
        out.deliver.append(Delivery(job.id, err))
        self._end(job, phase, out, abort_reason, skip=failed)

    def _end(self, job: Job, phase: Phase, out: Outbox, abort_reason: str, skip: str = "") -> None:
        """The job is over: Abort upstream every request of it that may still run (not `skip`,
        the one whose failure ended it: upstream already knows)."""
        pending = {rid for rid, _ in job.unfinished} - {skip}
        for rid in job.rids:
            if rid in pending:
                out.send.append(Envelope(SCHEDULER, Abort(request_id=rid, reason=abort_reason)))
        job.phase = phase
        self._forget_requests(job)

    def _forget_requests(self, job: Job) -> None:
        """Later messages for the job's requests are late; the job stays until the route closes it."""
        for rid in job.rids:
            if self.job_of.get(rid) is job:
                del self.job_of[rid]
            self.worker_of.pop(rid, None)

    def _forget(self, job: Job) -> None:
        self._forget_requests(job)
        self.jobs.pop(job.id, None)
