"""The gateway's side of the stack: tokenize (gRPC), submit (ZMQ), and route replies to requests.

    job = await backend.start(prompts, params, tenant=..., priority=..., cache_salt=...)
    async for batch in job.batches():                # [(prompt_index, TextDelta), ...]
        ...
    job.close()                                      # aborts whatever did not finish (disconnects)

Every internal request id is made here, random (`new_request_id`): a client never picks one and
nobody can guess another's. Replies arrive on this gateway's ZMQ inbox: Admitted / Rejected
(scheduler), TextBatch (detokenizer), RequestFailed (scheduler, worker, detokenizer); `inbox_senders` names
the roles (CURVE keys) each may come from, and the inbox drops the rest.
With --local-detokenizer (needs --local-tokenizer) the gateway is its requests' detokenizer: each
Submit names this inbox as `detok_addr`, so workers send it StreamOpen / StepOutput / Abort, and
the same DetokCore the tokenizer service runs turns them into text here (a stop string's Abort
goes to the scheduler); one process hop less for every token.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import grpc
import msgspec
from redis.exceptions import RedisError

from services import metrics
from services.config import GatewayConfig
from services.gateway.models import ModelCatalog
from services.gateway.schemas import ApiError, param_of
from services.protocol.messages import (
    Abort, Admitted, DetokenizeReply, DetokenizeRequest, GatewayInbox, Rejected, RequestFailed, StepOutput, StreamOpen,
    Submit, TextBatch, TextDelta, TokenizeReply, TokenizeRequest, failure_of)
from services.protocol.sampling import SamplingParams, SamplingParamsError
from services.redis_client import RedisAuth
from services.registry import Membership, Registry
from services.security.curve import Plane, with_role
from services.text.streams import SCHEDULER, STREAM_MAX_AGE_S, DetokCore
from services.tokenize import (
    PromptTooLong, TokenizeError, check_chars, detokenize_off_loop, prompt_chars, tokenize_off_loop)
from services.transport import Receiver, Sender, grpc_channel, tcp_addr, unary_stub

log = logging.getLogger("kvmesh.gateway")
TOKENIZER_SERVICE = "kvmesh.Tokenizer"


def new_request_id() -> str:
    """An internal request id: 128 random bits, so a forged Abort cannot name someone else's request."""
    return "r-" + secrets.token_hex(16)


def inbox_senders(local_detokenizer: bool) -> dict[type, tuple[str, ...]]:
    """Message -> the roles that may send it to a gateway's inbox. Workers stream tokens here only
    to a gateway that detokenizes its own requests."""
    senders: dict[type, tuple[str, ...]] = {Admitted: ("scheduler",), Rejected: ("scheduler",),
                                            RequestFailed: ("scheduler", "worker", "tokenizer"), TextBatch: ("tokenizer",)}
    if local_detokenizer:
        senders |= {StreamOpen: ("worker",), StepOutput: ("worker",), Abort: ("worker", "scheduler")}
    return senders


class Job:
    """One HTTP request: one internal request per prompt, each with n samples."""

    def __init__(self, backend: "Backend", rids: list[str], n: int, timeout_s: float) -> None:
        self.backend, self.rids, self.n, self.timeout_s = backend, rids, n, timeout_s
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.detok_of: dict[str, str] = {}   # request id -> the detokenizer streaming its text
        self.scheduler_addr = ""             # the scheduler that holds (queued) these requests
        self.progressed = False              # a token arrived: the request reached a worker
        self.queue: asyncio.Queue = asyncio.Queue()
        self.submitted = 0.0                 # monotonic: just before the Submits go to the scheduler's socket
        self.first_read = 0.0                # monotonic: the first text delta read off the inbox
        self.unfinished = {(rid, j) for rid in rids for j in range(n)}
        self.closed = False
        for rid in rids:
            backend.jobs[rid] = self

    async def admitted(self, timeout_s: float) -> None:
        """Wait until the scheduler accepted every prompt; raise its ApiError otherwise."""
        waiting = set(self.rids)
        early: list = []
        deadline = time.monotonic() + timeout_s
        while waiting:
            left = deadline - time.monotonic()
            try:
                msg = self.queue.get_nowait() if not self.queue.empty() else await _get(self.queue, left)
            except TimeoutError:
                raise ApiError(503, "the scheduler did not answer in time; retry later", type_="server_error",
                               code="scheduler_unavailable", retry_after=1) from None
            if isinstance(msg, Rejected):
                raise ApiError(msg.status, msg.message, type_=_error_type(msg.status), code=msg.code,
                               retry_after=msg.retry_after_s, param=_param(msg.status, msg.message))
            if isinstance(msg, RequestFailed):   # failed before the answer began: a plain error
                raise ApiError(msg.status, msg.message, type_=_error_type(msg.status), code=msg.code,
                               retry_after=1 if msg.status == 503 else 0, param=_param(msg.status, msg.message))
            waiting.discard(msg.request_id)
            if not isinstance(msg, Admitted):
                early.append(msg)   # a delta (or failure) that overtook the admission
        for msg in early:
            self.queue.put_nowait(msg)

    async def batches(self) -> AsyncIterator[list[tuple[int, TextDelta]]]:
        """Every delta already arrived (at least one) per iteration: one write per batch, not per token."""
        while self.unfinished:
            try:
                msg = self.queue.get_nowait() if not self.queue.empty() else await _get(self.queue, self.timeout_s)
            except TimeoutError:
                raise ApiError(504, "the request made no progress in time", type_="server_error",
                               code="timeout") from None
            batch: list[tuple[int, TextDelta]] = []
            while True:
                if isinstance(msg, TextDelta):
                    self.progressed = True
                    if msg.finish_reason is not None:
                        self.unfinished.discard((msg.request_id, msg.index))
                    batch.append((self.index[msg.request_id], msg))
                elif isinstance(msg, RequestFailed):
                    if batch:
                        yield batch
                    raise ApiError(msg.status, msg.message, type_=_error_type(msg.status), code=msg.code,
                                   param=_param(msg.status, msg.message))
                if self.queue.empty():
                    break
                msg = self.queue.get_nowait()
            if batch:
                yield batch

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        pending = {rid for rid, _ in self.unfinished}
        for rid in self.rids:
            self.backend.jobs.pop(rid, None)
            if rid in pending:
                self.backend.abort(rid)


async def _get(queue: asyncio.Queue, timeout_s: float) -> object:
    """queue.get() with a timeout (raises TimeoutError); cheaper than wait_for (no extra task)."""
    async with asyncio.timeout(max(timeout_s, 0.001)):
        return await queue.get()


def _prompt_error(req: TokenizeRequest, exc: TokenizeError) -> ApiError:
    """A prompt the tokenizer refused, as a 400 naming the request's field."""
    param = "messages" if req.messages is not None else "prompt"
    code = "context_length_exceeded" if isinstance(exc, PromptTooLong) else None
    return ApiError(400, str(exc), param=param, code=code)


def _error_type(status: int) -> str:
    return {400: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")


def _param(status: int, message: str) -> str | None:
    """A worker's 400 (a parameter only it can judge, e.g. a token id past the vocabulary) names
    its field the way the gateway's own checks do."""
    return param_of(message) if status == 400 else None


class Backend:
    def __init__(self, cfg: GatewayConfig, plane: Plane) -> None:
        self.cfg = cfg
        self.plane = plane
        self.jobs: dict[str, Job] = {}
        self.trust = plane.trust     # gRPC and Redis use the same trust material as ZeroMQ
        self.registry = Registry(cfg.redis_url, RedisAuth.of(self.trust))
        self.scheduler: Sender | None = None
        self.tokenizers: dict[str, object] = {}    # grpc target -> stub
        self.detokenizers: dict[str, object] = {}  # the same targets' Detokenize
        self._rr = itertools.count()
        self.catalog = ModelCatalog()              # served models, their names and limits
        self.workers_ready = 0
        self.token_chars: int | None = None        # the tokenizer services' longest token, in characters
        # tokenization and detokenization of long inputs: off the event loop, a bounded number at once
        self.pool = ThreadPoolExecutor(max_workers=cfg.tokenize_threads, thread_name_prefix="tokenize")
        self.redis_error = ""                     # why the last registry read failed; "" when it worked
        self.id = f"gw-{os.getpid()}-{secrets.token_hex(4)}"   # a registry name, unrelated to request ids
        self.detok_addrs: list[str] = []
        grace = 2 * cfg.heartbeat_ms / 1000   # vanished records kept this long (Redis restart)
        self.members = {kind: Membership(grace) for kind in ("scheduler", "tokenizer", "worker")}
        self.local_tok = None
        if cfg.local_tokenizer:
            from services.text.tokenizer import load_tokenizer
            self.local_tok = load_tokenizer(cfg.local_tokenizer)
        # --local-detokenizer: this process streams its requests' text (module docstring)
        self.detok: DetokCore | None = DetokCore(self.local_tok) if self.local_tok and cfg.local_detokenizer else None

    async def start_background(self) -> None:
        cfg = self.cfg
        self.receiver: Receiver = Receiver(GatewayInbox, cfg.host, cfg.zmq_port, name="gateway", plane=self.plane,
                                           senders=inbox_senders(self.detok is not None))
        self.reply_addr = with_role(tcp_addr(cfg.reachable_host(), self.receiver.port), "gateway")
        self.lease = await self.registry.register("gateway", self.id, addrs={"zmq": self.reply_addr},
                                                  info={}, lease_ms=cfg.lease_ms)
        await self.discover()
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._discovery_loop())]

    async def stop(self) -> None:
        for t in getattr(self, "_tasks", []):
            t.cancel()
        await self.lease.release()
        await self.registry.close()
        self.receiver.close()
        if self.scheduler:
            self.scheduler.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- discovery -----------------------------------------------------------------------
    async def discover(self) -> None:
        cfg, now = self.cfg, time.monotonic()
        live = {kind: self.members[kind].update(await self.registry.list(kind), now)
                for kind in ("scheduler", "tokenizer", "worker")}
        sched = [cfg.scheduler_addr] if cfg.scheduler_addr else [
            r.addrs["zmq"] for r in live["scheduler"] if "zmq" in r.addrs]
        if sched and (self.scheduler is None or self.scheduler.addr != sched[0]):
            if self.scheduler:
                self.scheduler.close()
            self.scheduler = Sender(sched[0], plane=self.plane, server_role="scheduler")
        elif not sched and self.scheduler is not None:
            self.scheduler.close()
            self.scheduler = None
        if cfg.tokenizer_addr:
            targets = [t.strip() for t in cfg.tokenizer_addr.split(",") if t.strip()]
        else:
            targets = [r.addrs["grpc"] for r in live["tokenizer"] if "grpc" in r.addrs]
        for t in targets:
            if t not in self.tokenizers:
                channel = grpc_channel(t, self.trust, "tokenizer")
                self.tokenizers[t] = unary_stub(channel, TOKENIZER_SERVICE, "Tokenize", TokenizeReply)
                self.detokenizers[t] = unary_stub(channel, TOKENIZER_SERVICE, "Detokenize", DetokenizeReply)
        for t in [t for t in self.tokenizers if t not in targets]:
            del self.tokenizers[t]
            self.detokenizers.pop(t, None)
        self.detok_addrs = [r.addrs["zmq"] for r in live["tokenizer"] if "zmq" in r.addrs]
        # they serve one model; the largest is the safe bound should one differ
        self.token_chars = max((int(r.info.get("max_token_chars") or 0) for r in live["tokenizer"]), default=0) or None
        workers = [w for w in live["worker"] if not w.info.get("draining")]
        self.workers_ready = len(workers)
        self.catalog = ModelCatalog.of(w.info for w in workers)
        self._fail_orphans()

    def _fail_orphans(self) -> None:
        """Fail requests that can no longer finish instead of letting them wait request_timeout_s:
        their detokenizer is gone, or the scheduler holding them (queued, no token yet) is."""
        live = set(self.detok_addrs)
        if self.detok is not None:
            live.add(self.reply_addr)
        sched = self.scheduler.addr if self.scheduler is not None else ""
        for job in {id(j): j for j in self.jobs.values()}.values():
            if not job.progressed and job.scheduler_addr != sched:
                job.queue.put_nowait(RequestFailed(
                    request_id=job.rids[0], status=503, code="scheduler_failed",
                    message="the scheduler holding this request stopped; please retry"))
                continue
            for rid, _ in list(job.unfinished):
                if job.detok_of.get(rid, "") not in live:
                    job.queue.put_nowait(RequestFailed(
                        request_id=rid, status=503, code="tokenizer_failed",
                        message="the service streaming this request's text stopped; please retry"))
                    break

    async def _discovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_ms / 1000)
            if self.detok is not None:
                self.detok.expire(STREAM_MAX_AGE_S)
            try:
                await self.discover()
                await self.lease.renew({"inflight": len(self.jobs)})
                self.redis_error = ""
            except (RedisError, OSError) as exc:
                self.redis_error = str(exc) or type(exc).__name__
                log.warning("discovery failed: Redis: %s", exc)
            except Exception as exc:
                log.warning("discovery failed: %s", exc)

    @property
    def ready(self) -> bool:
        return self.not_ready_reason is None

    @property
    def not_ready_reason(self) -> str | None:
        """Why /ready answers 503, or None. Redis first: without it the stack cannot notice a
        worker that dies, so the last known members are not trusted for readiness."""
        if self.redis_error:
            return "the registry (Redis) is unreachable"
        if not self.scheduler:
            return "no scheduler is registered"
        if not (self.tokenizers and self.detok_addrs):
            return "no tokenizer is registered"
        if not self.workers_ready:
            return "no worker is registered"
        return None

    # ---- requests ------------------------------------------------------------------------
    def bounded(self, req: TokenizeRequest, model: str) -> TokenizeRequest:
        """`req` refused past `model`'s context length (its workers' max_model_len; none known: unbounded)."""
        return msgspec.structs.replace(req, max_prompt_tokens=self.catalog.max_model_lens.get(model, 0))

    async def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        if self.local_tok is not None:
            return await self._tokenize_locally(req)
        if not self.tokenizers:
            raise ApiError(503, "no tokenizer service is available; retry later", type_="server_error",
                           code="tokenizer_unavailable", retry_after=1)
        try:   # the tokenizer service checks too; here it costs no gRPC round trip of megabytes
            check_chars(req, prompt_chars(req), self.token_chars)
        except PromptTooLong as exc:
            raise _prompt_error(req, exc) from None
        targets = list(self.tokenizers)
        stub = self.tokenizers[targets[next(self._rr) % len(targets)]]
        try:
            reply = await stub(req, timeout=30)  # type: ignore[operator]
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE:     # PromptTooLong in the service
                raise _prompt_error(req, PromptTooLong(exc.details() or "the prompt is too long")) from None
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise _prompt_error(req, TokenizeError(exc.details() or "invalid prompt")) from None
            log.warning("tokenize failed: %s %s", exc.code(), exc.details())
            raise ApiError(503, "the tokenizer service is unavailable; retry later", type_="server_error",
                           code="tokenizer_unavailable", retry_after=1) from None
        # a tokenizer service that predates max_prompt_tokens ignores it
        if req.max_prompt_tokens and len(reply.prompt_token_ids) > req.max_prompt_tokens:
            raise _prompt_error(req, PromptTooLong(
                f"the prompt has {len(reply.prompt_token_ids)} tokens; this model's maximum context length is "
                f"{req.max_prompt_tokens} tokens; shorten the prompt"))
        return reply

    async def token_ids(self, req: TokenizeRequest) -> list[int]:
        """The prompt's ids alone (the /tokenize route): no detokenizer needs to be up."""
        if self.local_tok is None:
            return (await self.tokenize(req)).prompt_token_ids
        return await self._local_ids(req)

    async def _local_ids(self, req: TokenizeRequest) -> list[int]:
        try:
            return await tokenize_off_loop(self.local_tok, req, self.pool)
        except TokenizeError as exc:
            raise _prompt_error(req, exc) from None

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeReply:
        """The /detokenize route and /tokenize's token strings: here when this gateway has the
        tokenizer, else through a tokenizer service's gRPC Detokenize."""
        if self.local_tok is not None:
            try:
                return await detokenize_off_loop(self.local_tok, req, self.pool)
            except TokenizeError as exc:
                raise ApiError(400, str(exc), param="tokens") from None
        if not self.detokenizers:
            raise ApiError(503, "no tokenizer service is available; retry later", type_="server_error",
                           code="tokenizer_unavailable", retry_after=1)
        targets = list(self.detokenizers)
        stub = self.detokenizers[targets[next(self._rr) % len(targets)]]
        try:
            return await stub(req, timeout=30)  # type: ignore[operator]
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ApiError(400, exc.details() or "invalid token ids", param="tokens") from None
            log.warning("detokenize failed: %s %s", exc.code(), exc.details())
            raise ApiError(503, "the tokenizer service is unavailable; retry later", type_="server_error",
                           code="tokenizer_unavailable", retry_after=1) from None

    async def _tokenize_locally(self, req: TokenizeRequest) -> TokenizeReply:
        if self.detok is None and not self.detok_addrs:
            raise ApiError(503, "no tokenizer service is available to stream text; retry later",
                           type_="server_error", code="tokenizer_unavailable", retry_after=1)
        ids = await self._local_ids(req)
        detok = self.reply_addr if self.detok is not None else self.detok_addrs[next(self._rr) % len(self.detok_addrs)]
        return TokenizeReply(prompt_token_ids=ids, detok_addr=detok, vocab_size=self.local_tok.vocab_size)

    def check_vocab(self, model: str, params: SamplingParams) -> None:
        """Refuse token ids past the model's vocabulary (logit_bias, stop_token_ids; top_k) here,
        before a stream begins, rather than in the worker after it has (which checks again)."""
        if vocab := self.catalog.vocab_sizes.get(model):
            try:
                params.validate(vocab)
            except SamplingParamsError as exc:
                raise ApiError(400, str(exc), param=param_of(str(exc))) from None

    async def start(self, prompts: list[TokenizeRequest], params: SamplingParams, *, model: str, tenant: str,
                    priority: int, cache_salt: str) -> tuple[Job, list[int]]:
        """Tokenize, submit and wait for admission. Returns the job and each prompt's token count."""
        t0 = time.monotonic()
        prompts = [self.bounded(p, model) for p in prompts]
        if len(prompts) == 1:   # the common case: no task per prompt
            replies = [await self.tokenize(prompts[0])]
        else:
            replies = await asyncio.gather(*(self.tokenize(p) for p in prompts))
        metrics.GATEWAY_TOKENIZE.observe(time.monotonic() - t0)
        if self.scheduler is None:
            raise ApiError(503, "the scheduler is unavailable; retry later", type_="server_error",
                           code="scheduler_unavailable", retry_after=1)
        rids = [new_request_id() for _ in prompts]
        job = Job(self, rids, params.n, self.cfg.request_timeout_s)
        job.detok_of = {rid: rep.detok_addr for rid, rep in zip(rids, replies)}
        job.scheduler_addr = self.scheduler.addr
        now = time.time()
        try:
            # stamped before the sends: were this process descheduled between a send and the stamp,
            # the upstream stage would miss time the scheduler and worker already spent
            job.submitted = time.monotonic()
            for rid, rep in zip(rids, replies):
                self.scheduler.send(Submit(
                    request_id=rid, tenant=tenant, prompt_token_ids=rep.prompt_token_ids, params=params,
                    priority=priority, cache_salt=cache_salt, reply_addr=self.reply_addr,
                    detok_addr=rep.detok_addr, arrival=now))
            await job.admitted(self.cfg.admission_timeout_s)
        except BaseException:
            job.close()
            raise
        return job, [len(r.prompt_token_ids) for r in replies]

    def fail_inflight(self) -> None:
        """This gateway is stopping: end every request in flight with a 503 (streams: an error chunk
        and [DONE]) while their connections are still open, rather than cut them."""
        for rid, job in list(self.jobs.items()):
            job.queue.put_nowait(failure_of(Abort(request_id=rid, reason="shutdown")))

    def abort(self, rid: str) -> None:
        if self.scheduler is not None:
            self.scheduler.send(Abort(request_id=rid, reason="client"))

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.receiver.recv()
            if isinstance(msg, TextBatch):
                self._route(msg.deltas, time.monotonic())
            elif isinstance(msg, (StreamOpen, StepOutput, Abort)):
                self._detokenize(msg)
            else:
                job = self.jobs.get(msg.request_id)
                if job is not None:
                    job.queue.put_nowait(msg)

    def _route(self, deltas: list[TextDelta], read_at: float) -> None:
        """Text deltas to their jobs; `read_at` (monotonic) ends a job's upstream stage."""
        for d in deltas:
            job = self.jobs.get(d.request_id)
            if job is not None:
                if not job.first_read and d.num_new_tokens:
                    job.first_read = read_at
                    metrics.GATEWAY_UPSTREAM.observe(read_at - job.submitted)
                job.queue.put_nowait(d)

    def _detokenize(self, msg: StreamOpen | StepOutput | Abort) -> None:
        """A worker's (or the scheduler's) message for this gateway's own detokenizer."""
        if self.detok is None:
            log.warning("dropped a %s: this gateway does not detokenize (--local-detokenizer)", type(msg).__name__)
            return
        read_at, started = time.monotonic(), self.detok.samples_started
        try:
            if isinstance(msg, StreamOpen):
                out = self.detok.open(msg)
            elif isinstance(msg, StepOutput):
                out = self.detok.step(msg)
            else:
                out = self.detok.abort(msg)
        except Exception:  # one bad stream must not stop the others
            log.exception("detokenizer failed on a %s", type(msg).__name__)
            return
        done = time.monotonic()
        for env in out:
            if env.dest == SCHEDULER:          # a stop string ended a sample: free its KV
                if self.scheduler is not None:
                    self.scheduler.send(env.msg)
            elif isinstance(env.msg, TextBatch):   # its reply address is this inbox
                self._route(env.msg.deltas, done)
            elif (job := self.jobs.get(env.msg.request_id)) is not None:   # RequestFailed: an aborted stream
                job.queue.put_nowait(env.msg)
        if self.detok.samples_started != started:
            metrics.DETOK_FIRST_TOKEN.observe(done - read_at)
