"""The gateway's shell around GatewayCore (services/gateway/core.py): sockets, discovery, the text
path, and one asyncio queue per job for the HTTP routes.

    job, prompt_lens = await backend.start(prompts, params, model=..., tenant=..., priority=..., cache_salt=...,
                                           conversation=...)
    async for batch in job.batches():                # [(prompt_index, TextDelta), ...]
        ...
    job.close()                                      # aborts whatever did not finish (disconnects)

Every internal request id is made here, random (`new_request_id`): a client never picks one and
nobody can guess another's. Replies arrive on this gateway's ZMQ inbox: Admitted / Rejected
(scheduler), TextBatch (a tokenizer service's detokenizer), RequestFailed (scheduler, worker,
detokenizer) and, when this gateway makes its own text (LocalText), the workers' StreamOpen /
StepOutput / Abort; `inbox_senders` names the roles (CURVE keys) each may come from, and the
inbox drops the rest.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Any, AsyncIterator

import msgspec
from redis.exceptions import RedisError

from services import metrics
from services.config import GatewayConfig
from services.gateway.core import JOB_ADMITTED, LIVE, SCHEDULER, GatewayCore, Job as CoreJob, Outbox, Phase
from services.gateway.discovery import Discovery
from services.gateway.models import ModelCatalog
from services.gateway.schemas import ApiError, param_of
from services.gateway.text_path import LOCAL_TEXT_SENDERS, LocalText, RemoteText, TextPath, bounded
from services.protocol.messages import (
    Admitted, DetokenizeReply, DetokenizeRequest, GatewayInbox, Moved, Rejected, RequestFailed, Resume, Submit,
    TextBatch, TokenizeReply, TokenizeRequest)
from services.protocol.sampling import (MAX_PROMPT_LOGPROBS_ENTRIES, MAX_PROMPT_LOGPROBS_TOKENS, SamplingParams,
                                        SamplingParamsError)
from services.redis_client import RedisAuth
from services.registry import Registry
from services.security.curve import Plane, with_role
from services.text.streams import STREAM_MAX_AGE_S
from services.transport import Receiver, Sender, SenderPool, tcp_addr

log = logging.getLogger("kvmesh.gateway")

# message -> the roles that may send it to any gateway's inbox
SENDERS: dict[type, tuple[str, ...]] = {Admitted: ("scheduler",), Rejected: ("scheduler",), Moved: ("scheduler",),
                                        RequestFailed: ("scheduler", "worker", "tokenizer"),
                                        TextBatch: ("tokenizer",)}


def check_prompt_logprobs_len(replies: list[TokenizeReply], top: int, copies: int) -> None:
    """Prompt logprobs (and a completion's echo with logprobs) are made for bounded prompts only,
    and one answer holds a bounded number of them: each prompt's tokens x (top + 1) entries,
    `copies` times (a completion's n choices each carry their prompt's)."""
    longest = max(len(r.prompt_token_ids) for r in replies)
    if longest > MAX_PROMPT_LOGPROBS_TOKENS:
        raise ApiError(400, f"invalid prompt_logprobs: prompts of at most {MAX_PROMPT_LOGPROBS_TOKENS} tokens may "
                            f"ask for prompt logprobs (or echo them with logprobs); this one has {longest}",
                       param="prompt_logprobs")
    entries = sum(len(r.prompt_token_ids) for r in replies) * (top + 1) * copies
    if entries > MAX_PROMPT_LOGPROBS_ENTRIES:
        raise ApiError(400, f"invalid prompt_logprobs: the answer would carry {entries} prompt logprobs (prompt "
                            f"tokens x (prompt_logprobs + 1) x choices), at most {MAX_PROMPT_LOGPROBS_ENTRIES} "
                            "may be asked at once; send fewer or shorter prompts, a smaller n or prompt_logprobs",
                       param="prompt_logprobs")


def new_request_id() -> str:
    """An internal request id: 128 random bits, so a forged Abort cannot name someone else's request."""
    return "r-" + secrets.token_hex(16)


def inbox_senders(local_text: bool) -> dict[type, tuple[str, ...]]:
    """Message -> the roles that may send it to a gateway's inbox. Workers stream tokens here only
    to a gateway that makes its own text."""
    return SENDERS | LOCAL_TEXT_SENDERS if local_text else dict(SENDERS)


def text_path_of(cfg: GatewayConfig, plane: Plane) -> TextPath:
    if cfg.text_in_gateway:
        return LocalText(cfg.model, cfg.tokenize_threads)
    targets = [t.strip() for t in cfg.tokenizer_addr.split(",") if t.strip()]
    return RemoteText(plane.trust, targets)


class Job:
    """The routes' view of one core job: its deliveries, in order, through one queue."""

    def __init__(self, backend: "Backend", core_job: CoreJob) -> None:
        self.backend, self.core_job = backend, core_job
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    @property
    def submitted(self) -> float:
        """monotonic: just before the Submits went to the scheduler's socket."""
        return self.core_job.submitted_at

    @property
    def first_read(self) -> float:
        """monotonic: when the first text with tokens was ready to write."""
        return self.core_job.first_read

    async def _next(self) -> Any:
        """The next delivery; at the core's deadline for this job, the core decides (expire)."""
        while self.queue.empty():
            if self.core_job.phase not in LIVE:   # ended, and its last delivery already taken
                raise ApiError(500, "the request ended", type_="server_error", code="internal_error")
            left = self.core_job.deadline - time.monotonic()
            if left > 0:
                try:
                    async with asyncio.timeout(left):
                        return await self.queue.get()
                except TimeoutError:
                    pass
            self.backend.expire(self.core_job.id)
        return self.queue.get_nowait()

    async def admitted(self) -> None:
        """Wait until the scheduler accepted every prompt; raise its ApiError otherwise."""
        while (item := await self._next()) is not JOB_ADMITTED:   # the core delivers it before any text
            if isinstance(item, ApiError):
                raise item

    async def batches(self) -> AsyncIterator[list[tuple[int, Any]]]:
        """Every delta already arrived (at least one) per iteration: one write per batch, not per token."""
        while self.core_job.phase is not Phase.FINISHED or not self.queue.empty():
            item = await self._next()
            batch: list[tuple[int, Any]] = []
            while True:
                if isinstance(item, ApiError):
                    if batch:
                        yield batch
                    raise item
                if item is not JOB_ADMITTED:
                    batch.append(item)
                if self.queue.empty():
                    break
                item = self.queue.get_nowait()
            if batch:
                yield batch

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.backend.close_job(self)


class Backend:
    def __init__(self, cfg: GatewayConfig, plane: Plane) -> None:
        self.cfg = cfg
        self.plane = plane
        self.trust = plane.trust     # gRPC and Redis use the same trust material as ZeroMQ
        self.text: TextPath = text_path_of(cfg, plane)
        self.core = GatewayCore(cfg.admission_timeout_s, cfg.request_timeout_s, self.text.detok)
        self.jobs: dict[int, Job] = {}
        self.stopping = False                     # SIGTERM: new requests get a 503 while these finish
        self.registry = Registry(cfg.redis_url, RedisAuth.of(self.trust))
        self.discovery = Discovery(self.registry, cfg.heartbeat_ms, cfg.scheduler_addr,
                                   with_tokenizers=not cfg.text_in_gateway, lease_ms=cfg.lease_ms)
        self.scheduler: Sender | None = None
        self.scheduler_key = ""                   # Members.scheduler_key of self.scheduler
        self.workers: SenderPool = SenderPool(plane)   # stop strings go to the worker directly
        self.worker_addrs: set[str] = set()            # those the pool has a socket for
        # Resumes (the local detokenizer's answers to Migrates) go to the scheduler inbox that asked:
        # never through `workers`, whose sockets close with their worker's record, dropping a Resume
        # still queued on a connection being made (the moved request would wait forever)
        self.schedulers: SenderPool = SenderPool(plane)
        self.catalog = ModelCatalog()              # served models, their names and limits
        self.workers_ready = 0
        self.redis_error = ""                     # why the last registry read failed; "" when it worked
        self.id = f"gw-{os.getpid()}-{secrets.token_hex(4)}"   # a registry name, unrelated to request ids
        self.reply_addr = ""

    async def start_background(self) -> None:
        cfg = self.cfg
        self.receiver: Receiver = Receiver(GatewayInbox, cfg.host, cfg.zmq_port, name="gateway", plane=self.plane,
                                           senders=inbox_senders(self.text.detok is not None))
        self.reply_addr = with_role(tcp_addr(cfg.reachable_host(), self.receiver.port), "gateway")
        if isinstance(self.text, LocalText):
            self.text.inbox_addr = self.reply_addr
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
        self.workers.close()
        self.schedulers.close()
        self.text.close()

    # ---- discovery -----------------------------------------------------------------------
    async def discover(self) -> None:
        members = await self.discovery.read()
        sched = members.scheduler_addr
        if self.scheduler is not None and self.scheduler.addr != sched:
            self.scheduler.close()
            self.scheduler = None
        if sched and self.scheduler is None:
            self.scheduler = Sender(sched, plane=self.plane, server_role="scheduler")
        self.scheduler_key = members.scheduler_key
        self.text.update(members.tokenizers)
        self.workers_ready = len(members.workers)
        self.catalog = ModelCatalog.of(w.info for w in members.workers)
        live_workers = {w.addrs.get("zmq", "") for w in members.workers}
        for addr in self.worker_addrs - live_workers:   # gone: their sockets too
            self.workers.drop(addr)
        self.worker_addrs &= live_workers
        self.carry_out(self.core.redrive(self.scheduler_key))
        self.carry_out(self.core.orphans(self.text.detok_addrs()))

    async def _discovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_ms / 1000)
            if self.text.detok is not None:
                self.text.detok.expire(STREAM_MAX_AGE_S)
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
        if self.stopping:
            return "the gateway is shutting down"
        if self.redis_error:
            return "the registry (Redis) is unreachable"
        if not self.scheduler:
            return "no scheduler is registered"
        if (reason := self.text.not_ready_reason()) is not None:
            return reason
        if not self.workers_ready:
            return "no worker is registered"
        return None

    # ---- requests ------------------------------------------------------------------------
    def bounded(self, req: TokenizeRequest, model: str) -> TokenizeRequest:
        """`req` refused past `model`'s context length (its workers' max_model_len; none known: unbounded)."""
        return bounded(req, self.catalog.max_model_lens.get(model, 0))

    async def token_ids(self, req: TokenizeRequest) -> list[int]:
        return await self.text.token_ids(req)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeReply:
        return await self.text.detokenize(req)

    def check_vocab(self, model: str, params: SamplingParams) -> None:
        """Refuse token ids past the model's vocabulary (logit_bias, stop_token_ids; top_k) here,
        before a stream begins, rather than in the worker after it has (which checks again)."""
        if vocab := self.catalog.vocab_sizes.get(model):
            try:
                params.validate(vocab)
            except SamplingParamsError as exc:
                raise ApiError(400, str(exc), param=param_of(str(exc))) from None

    def open_job(self, submits: list[Submit], n: int) -> Job:
        job = Job(self, self.core.submit(submits, n, self.scheduler_key, time.monotonic()))
        self.jobs[job.core_job.id] = job
        return job

    async def start(self, prompts: list[TokenizeRequest], params: SamplingParams, *, model: str, tenant: str,
                    priority: int, cache_salt: str, conversation: str = "",
                    prompt_logprobs_copies: int = 1) -> tuple[Job, list[int]]:
        """Tokenize, submit and wait for admission. Returns the job and each prompt's token count.
        prompt_logprobs_copies: how many times the answer carries each prompt's prompt logprobs
        (a completion: on each of its n choices; a chat: once)."""
        t0 = time.monotonic()
        prompts = [self.bounded(p, model) for p in prompts]
        if params.bad_words:    # encoded with the first prompt, by the same tokenizer
            prompts[0] = msgspec.structs.replace(prompts[0], bad_words=params.bad_words)
        if len(prompts) == 1:   # the common case: no task per prompt
            replies = [await self.text.tokenize(prompts[0])]
        else:
            replies = await asyncio.gather(*(self.text.tokenize(p) for p in prompts))
        if params.bad_words:
            if not replies[0].bad_words_token_ids:   # a tokenizer service older than bad_words
                raise ApiError(503, "the tokenizer service cannot encode bad_words yet; retry later",
                               type_="server_error", code="tokenizer_unavailable", retry_after=1)
            params = msgspec.structs.replace(params, bad_words_token_ids=replies[0].bad_words_token_ids)
            self.check_vocab(model, params)
        metrics.GATEWAY_TOKENIZE.observe(time.monotonic() - t0)
        if params.prompt_logprobs is not None:
            check_prompt_logprobs_len(replies, params.prompt_logprobs, prompt_logprobs_copies)
        if self.stopping:
            raise ApiError(503, "the gateway is shutting down; retry on another one", type_="server_error",
                           code="shutdown", retry_after=1)
        if self.scheduler is None:
            raise ApiError(503, "the scheduler is unavailable; retry later", type_="server_error",
                           code="scheduler_unavailable", retry_after=1)
        now = time.time()
        submits = [Submit(request_id=new_request_id(), tenant=tenant, prompt_token_ids=rep.prompt_token_ids,
                          params=params, priority=priority, cache_salt=cache_salt, reply_addr=self.reply_addr,
                          detok_addr=rep.detok_addr, arrival=now, conversation=conversation) for rep in replies]
        # stamped before the sends: were this process descheduled between a send and the stamp,
        # the upstream stage would miss time the scheduler and worker already spent
        job = self.open_job(submits, params.n)
        try:
            for submit in submits:
                self.scheduler.send(submit)
            await job.admitted()
        except BaseException:
            job.close()
            raise
        return job, [len(r.prompt_token_ids) for r in replies]

    async def finish_inflight(self, grace_s: float) -> None:
        """This gateway is stopping: refuse new requests (/ready says so at once) and give those in
        flight up to grace_s to end on their own; fail_inflight ends what is left."""
        self.stopping = True
        deadline = time.monotonic() + grace_s
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def fail_inflight(self) -> None:
        """This gateway is stopping: end every request in flight with a 503 (streams: an error chunk
        and [DONE]) while their connections are still open, rather than cut them."""
        self.carry_out(self.core.fail_all("shutdown"))

    def expire(self, job_id: int) -> None:
        self.carry_out(self.core.expire(time.monotonic(), job_id))

    def close_job(self, job: Job) -> None:
        self.jobs.pop(job.core_job.id, None)
        self.carry_out(self.core.close(job.core_job.id, time.monotonic()))

    def carry_out(self, out: Outbox) -> None:
        if out.first_text:   # the upstream stage ends once their text is ready (detokenized here, too)
            ready = time.monotonic()
            for core_job in out.first_text:
                core_job.first_read = ready
                metrics.GATEWAY_UPSTREAM.observe(ready - core_job.submitted_at)
        for job_id, item in out.deliver:
            if (job := self.jobs.get(job_id)) is not None:
                job.queue.put_nowait(item)
        for dest, msg in out.send:
            if dest == SCHEDULER or (self.scheduler is not None and dest == self.scheduler.addr):
                if self.scheduler is not None:
                    self.scheduler.send(msg)
            elif isinstance(msg, Resume):     # another scheduler's (one this gateway has not discovered yet)
                self.schedulers.send(dest, msg)
            else:
                self.worker_addrs.add(dest)
                self.workers.send(dest, msg)

    async def _recv_loop(self) -> None:
        detok = self.text.detok
        while True:
            msg = await self.receiver.recv()
            read_at = time.monotonic()
            started = detok.samples_started if detok is not None else 0
            try:
                out = self.core.step([msg], read_at)
            except Exception:  # one bad message must not stop the others
                log.exception("the gateway core failed on a %s", type(msg).__name__)
                continue
            self.carry_out(out)
            if detok is not None and detok.samples_started != started:
                metrics.DETOK_FIRST_TOKEN.observe(time.monotonic() - read_at)
