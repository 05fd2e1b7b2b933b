"""The global scheduler's pure core: messages and worker-set changes in, envelopes out. No sockets.

    submit(Submit)          admission: 400 (too long) / 429 (tenant or queue full) / 503 (no worker),
                            else queued (Admitted) and dispatched when a worker has room; with prefix
                            hints (cache_aware) and several workers to choose from, first a
                            PrefixQuery to the shell (prefix_hints.py) and the queue after its answer
    prefix_matched(id, m)   the prefix-cache index's answer to a PrefixQuery (None: no answer)
    abort(Abort)            queued: dropped, its gateway told (RequestFailed); dispatched: forwarded
                            to its worker (whose detokenizer tells the gateway)
    worker_status(status)   finished requests leave; load numbers refresh; queue drains (only a
                            status of the worker's current epoch counts; others are ignored)
    set_workers(views)      the live set from Redis: a worker gone or restarted (new epoch) fails its
                            in-flight requests with a clear error (gateway) and frees detok state

Queue order: (priority, arrival), lower priority value first. Routing: routing.pick(scorer, hint).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from scheduler_svc.prefix_hints import PREFIX_INDEX, PrefixHints
from scheduler_svc.routing import Scorer, WorkerView, least_loaded, pick
from services.envelope import Envelope
from services.protocol.kv_events import MatchResponse
from services.protocol.messages import (
    Abort, Admitted, Dispatch, Rejected, RequestFailed, Submit, WorkerStatus, failure_of)

log = logging.getLogger("kvmesh.scheduler")


@dataclass(frozen=True)
class Limits:
    max_queue: int = 4096
    max_tenant_inflight: int = 1024
    worker_capacity_factor: float = 2.0
    retry_after_s: int = 1


@dataclass
class _Req:
    submit: Submit
    hint: Any = None               # what the scorer reads besides load (prefix_hints: a prefix match)
    block_hashes: list[bytes] | None = None   # prefix_hints: recorded for its worker at dispatch
    matching: bool = False         # admitted, out of the queue until the prefix index answers
    worker_id: str | None = None   # None while queued
    received_at: float = 0.0       # clock(): the Submit read off the socket (the shell's time, if given)
    dispatched_at: float = 0.0


class SchedulerCore:
    # A dispatched request the worker does not list as active this long after dispatch has ended
    # and its "finished" report was lost (e.g. sent before the worker knew this scheduler).
    RECONCILE_AFTER_S = 5.0

    def __init__(self, limits: Limits = Limits(), scorer: Scorer = least_loaded,
                 clock: Callable[[], float] = time.monotonic, prefix_hints: PrefixHints | None = None) -> None:
        self.limits, self.scorer, self.clock = limits, scorer, clock
        self.prefix_hints = prefix_hints   # None: routed without prefix matches (no PrefixQuery)
        self.workers: dict[str, WorkerView] = {}
        self.requests: dict[str, _Req] = {}
        self.tenant_inflight: dict[str, int] = {}
        self._queue: list[tuple[int, int, str]] = []   # (priority, arrival no, request id)
        self._queued = 0
        self._arrivals = itertools.count()
        self.rejections: dict[str, int] = {}
        self.worker_failures = 0

    # ---- admission -----------------------------------------------------------------------
    def submit(self, msg: Submit, received_at: float | None = None) -> list[Envelope]:
        """`received_at` (this core's clock) is when the shell read msg off its socket; default now."""
        rid = msg.request_id
        if rid in self.requests:
            return [self._reject(msg, 400, "duplicate_request", "request id already in use")]
        eligible = self._eligible()
        if not eligible:
            return [self._reject(msg, 503, "no_workers", "no worker is available to serve this model; retry later")]
        max_len = min(w.max_model_len for w in eligible if w.max_model_len) if any(
            w.max_model_len for w in eligible) else 0
        need = len(msg.prompt_token_ids) + (msg.params.max_tokens or 1)
        if max_len and need > max_len:
            return [self._reject(msg, 400, "context_length_exceeded",
                                 f"this model's maximum context length is {max_len} tokens; the request has "
                                 f"{len(msg.prompt_token_ids)} prompt tokens and asks for "
                                 f"{msg.params.max_tokens or 1} more; reduce the prompt or max_tokens")]
        if self.tenant_inflight.get(msg.tenant, 0) >= self.limits.max_tenant_inflight:
            return [self._reject(msg, 429, "rate_limit_exceeded",
                                 "too many concurrent requests for this API key; retry later")]
        if self._queued >= self.limits.max_queue:
            return [self._reject(msg, 429, "server_overloaded", "the server is overloaded; retry later")]
        req = self.requests[rid] = _Req(msg, received_at=self.clock() if received_at is None else received_at)
        self.tenant_inflight[msg.tenant] = self.tenant_inflight.get(msg.tenant, 0) + 1
        self._queued += 1                  # counted as queued from admission, its prefix match included
        admitted = Envelope(msg.reply_addr, Admitted(request_id=rid))
        if self.prefix_hints is not None and len(eligible) > 1:   # where is its prefix? ask first
            req.matching = True
            return [Envelope(PREFIX_INDEX, self.prefix_hints.query(msg, eligible)), admitted]
        self._enqueue(req)
        # the dispatch is on the request's critical path (first token); the admission reply is not
        return [*self.dispatch(), admitted]

    def prefix_matched(self, request_id: str, match: MatchResponse | None) -> list[Envelope]:
        """The prefix-cache index's answer to this core's PrefixQuery (None, or not `available`: no
        index, or it was slow or failing: routed by load and recent dispatches). A request aborted
        meanwhile is gone: nothing happens."""
        req = self.requests.get(request_id)
        if req is None or not req.matching:
            return []
        req.matching = False
        eligible = self._eligible()
        if eligible:                         # (else it waits in the queue for a worker, like any other)
            req.hint, req.block_hashes = self.prefix_hints.hint(req.submit, eligible, match, self.clock())
        self._enqueue(req)
        return self.dispatch()

    def _enqueue(self, req: _Req) -> None:
        heapq.heappush(self._queue, (req.submit.priority, next(self._arrivals), req.submit.request_id))

    def _reject(self, msg: Submit, status: int, code: str, message: str) -> Envelope:
        self.rejections[code] = self.rejections.get(code, 0) + 1
        retry = self.limits.retry_after_s if status in (429, 503) else 0
        return Envelope(msg.reply_addr, Rejected(request_id=msg.request_id, status=status, code=code,
                                                 message=message, retry_after_s=retry))

    @property
    def has_eligible_worker(self) -> bool:
        return bool(self._eligible())

    def _eligible(self) -> list[WorkerView]:
        live = [w for w in self.workers.values() if not w.draining]
        # Until prefill/decode hand-off exists, only mixed workers run whole requests; other
        # roles are used when no mixed worker exists (each then does the whole request).
        mixed = [w for w in live if w.role == "mixed"]
        return mixed or live

    # ---- dispatch ------------------------------------------------------------------------
    def dispatch(self) -> list[Envelope]:
        out: list[Envelope] = []
        factor = self.limits.worker_capacity_factor
        while self._queue:
            room = [w for w in self._eligible() if len(w.inflight) < w.capacity(factor)]
            if not room:
                break
            _, _, rid = heapq.heappop(self._queue)
            req = self.requests.get(rid)
            if req is None or req.worker_id is not None:
                continue  # aborted while queued (lazy deletion)
            self._queued -= 1
            worker = pick(room, req.submit, self.scorer, req.hint)
            req.worker_id = worker.id
            req.dispatched_at = self.clock()
            worker.inflight.add(rid)
            worker.dispatched += 1
            if req.block_hashes and self.prefix_hints is not None:   # for the next ones sharing its prefix
                self.prefix_hints.dispatched(worker.id, req.block_hashes, req.dispatched_at)
                req.block_hashes = None
            s = req.submit
            out.append(Envelope(worker.addr, Dispatch(
                request_id=rid, epoch=worker.epoch, prompt_token_ids=s.prompt_token_ids, params=s.params,
                priority=s.priority, cache_salt=s.cache_salt, reply_addr=s.reply_addr, detok_addr=s.detok_addr)))
        return out

    # ---- request end ---------------------------------------------------------------------
    def abort(self, msg: Abort) -> list[Envelope]:
        req = self.requests.get(msg.request_id)
        if req is None:
            return []
        if req.worker_id is None:           # queued or matching: forget it (heap entry deleted lazily)
            self._queued -= 1
            self._forget(msg.request_id)
            return [Envelope(req.submit.reply_addr, failure_of(msg))]   # its gateway ends the stream
        worker = self.workers.get(req.worker_id)
        return [Envelope(worker.addr, msg)] if worker else []

    def _forget(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is None:
            return
        tenant = req.submit.tenant
        left = self.tenant_inflight.get(tenant, 1) - 1
        if left > 0:
            self.tenant_inflight[tenant] = left
        else:
            self.tenant_inflight.pop(tenant, None)
        if req.worker_id and (w := self.workers.get(req.worker_id)):
            w.inflight.discard(rid)

    def worker_status(self, msg: WorkerStatus) -> list[Envelope]:
        w = self.workers.get(msg.worker_id)
        if w is None or w.epoch != msg.epoch:
            # another incarnation's (a stale one's "finished" list would forget live requests);
            # a newer one's counts once the registry shows its epoch
            return []
        w.running, w.waiting = msg.running, msg.waiting
        w.free_blocks, w.cached_blocks, w.total_blocks = msg.free_blocks, msg.cached_blocks, msg.total_blocks
        for rid in msg.finished:
            req = self.requests.get(rid)
            if req is not None and req.worker_id == w.id:
                self._forget(rid)
        if msg.active is not None:
            active, now = set(msg.active), self.clock()
            for rid in [r for r in w.inflight if r not in active]:
                if now - self.requests[rid].dispatched_at > self.RECONCILE_AFTER_S:
                    log.info("request %s left worker %s without a report; forgetting it", rid, w.id)
                    self._forget(rid)
        return self.dispatch()

    # ---- membership ----------------------------------------------------------------------
    def set_workers(self, views: list[WorkerView]) -> list[Envelope]:
        """Replace the live set. Gone or re-epoched workers fail their in-flight requests."""
        out: list[Envelope] = []
        fresh = {v.id: v for v in views}
        for wid, old in list(self.workers.items()):
            new = fresh.get(wid)
            if new is None or new.epoch != old.epoch:
                out += self._fail_worker(old, "gone" if new is None else "restarted")
                del self.workers[wid]
                if self.prefix_hints is not None:   # a new epoch starts with an empty cache
                    self.prefix_hints.forget_worker(wid)
        for wid, view in fresh.items():
            cur = self.workers.get(wid)
            if cur is None:
                log.info("worker %s epoch %d joined (%s, %s)", wid, view.epoch, view.role, view.addr)
                self.workers[wid] = view
            else:  # keep our in-flight set; refresh what the record says
                cur.draining, cur.addr, cur.role = view.draining, view.addr, view.role
                cur.max_num_seqs, cur.max_model_len = view.max_num_seqs, view.max_model_len
                cur.prefix_query_tokens, cur.prefix_hit_tokens = view.prefix_query_tokens, view.prefix_hit_tokens
        return out + self.dispatch()

    def _fail_worker(self, w: WorkerView, why: str) -> list[Envelope]:
        self.worker_failures += 1
        log.warning("worker %s epoch %d %s; failing %d in-flight requests", w.id, w.epoch, why, len(w.inflight))
        out: list[Envelope] = []
        for rid in list(w.inflight):
            req = self.requests.get(rid)
            if req is None:
                continue
            s = req.submit
            out.append(Envelope(s.reply_addr, RequestFailed(
                request_id=rid, status=503, code="worker_failed",
                message="the worker serving this request stopped; please retry")))
            out.append(Envelope(s.detok_addr, Abort(request_id=rid, reason="worker_failed")))
            self._forget(rid)
        return out

    # ---- introspection -------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def num_inflight(self) -> int:
        return len(self.requests) - self._queued
