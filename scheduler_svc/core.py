"""The global scheduler's pure core: messages and worker-set changes in, envelopes out. No sockets.

    submit(Submit)          admission: 400 (too long, or prompt logprobs no worker makes) / 429 (tenant
                            or queue full) / 503 (no worker),
                            else queued (Admitted) and dispatched when a worker has room; with prefix
                            hints (cache_aware) and several workers to choose from, first a
                            PrefixQuery to the shell (prefix_hints.py) and the queue after its answer
    prefix_matched(id, m)   the prefix-cache index's answer to a PrefixQuery (None: no answer)
    abort(Abort)            queued: dropped, its gateway told (RequestFailed); dispatched: forwarded
                            to its worker (whose detokenizer tells the gateway)
    worker_status(status)   finished requests leave; load numbers refresh; queue drains (only a
                            status of the worker's current epoch counts; others are ignored); a
                            heartbeat's `active` list names the requests an earlier scheduler
                            dispatched there (a restart): they hold slots until they end
    set_workers(views)      the live set from Redis: a worker gone or restarted (new epoch) moves its
                            in-flight requests elsewhere (migration, below)
    resumed(Resume)         a moving request's detokenizer says where its stream stands: it is queued
                            again, to continue on another worker from those tokens (a stream it
                            never opened: from its start, and its gateway is told, Moved)
    submit(resubmitted)     a gateway whose scheduler stopped sends its live requests again (adopt):
                            one a worker lists as held (`inherited`) is adopted there, so this core can
                            move it should that worker die (a hand-off onto both its prefill and its
                            decode worker: unless a mixed worker holds it, adoption waits until every
                            worker has listed what it holds); one no worker holds moves like a dead
                            worker's request, from its stream's tokens (or from its start: it never
                            reached a worker)

Migration: a request whose worker died (lease lapsed, replaced) or handed it back while draining
(WorkerStatus.handed_back) continues elsewhere. Its detokenizer holds the tokens the client has, so
the core asks it (Migrate, naming the worker left: its late tokens are dropped) and dispatches the
answer (Resume) like a new request, but whole on one worker and carrying each sample's tokens
(Dispatch.resume_output): the engine computes prompt + those as its prefix and samples on from the
next position, with the same seed (a seeded request draws what it would have drawn where it was;
an unseeded one draws on from the same tokens). A request moved --max-migrations times already
fails: a RequestFailed to its gateway, an Abort to its detokenizer. One that finds no worker left
waits in the queue up to --migration-wait-s for one to join (the last worker restarting: its
stream pauses, then goes on), then fails the same way (expire_waits, on every registry poll).

Queue order: (priority, arrival), lower priority value first. Routing: routing.route(scorer, hint), the hint a prefix match
(prefix_hints.py); a request of a known conversation goes to its last turn's worker while that one
can take it (conversations.py, routing.conversation_worker).

Prefill/decode pools: a request routed to a prefill worker P and a decode worker D gets an AwaitKV
to D and a Dispatch naming D's KV socket to P; it is in flight on both until each reports it
finished (P once the hand-off ended, D once decoding ended; D's report first means P holds the
request from then on: D had no room for its KV, and P decodes it itself; so does P's `kept` report,
a hand-off that failed otherwise, D perhaps dead: D is told to drop its half). An Abort goes to both.
Such a request gets a seed when the client gave none, so any worker that computes it draws the same
tokens. P gone with the request: D runs it whole (Dispatch.resumes: the client may have its first
token already, and its detokenizer skips the tokens it has seen), so the client sees one stream; D
gone: P is told to drop it without ending its stream (Abort, reason "moved") and the request moves
like any other (or fails, when it may not move again), its Migrate naming P too (P may have kept
it and streamed on: the detokenizer drops what P sends after the Migrate). The seed fixed at
pairing is a function of the request id (_pairing_seed), so a scheduler that adopts a hand-off
after a restart knows it too.

Peer moves: a draining worker that holds a handed-back request's KV (WorkerStatus.kv_held) lets it
move with it. Once the detokenizer's Resume is in, the worker chosen for it (any live one with room)
gets the Dispatch with `kv_from`, if it is of the holder's role and has a KV socket and the holder's
KV layout and transport (routing.pairable), and the holder a MoveKV naming it; the peer decodes on from the
received KV, or recomputes from the Resume's tokens when it does not come (its fallback, within
the hand-off lease). Otherwise the holder is told to free the KV (Abort "moved") and the request is
recomputed as any moved one.

Runs: each dispatch gets a run number (`_Req.run`, Dispatch.run, AwaitKV.run: both halves of a
hand-off share it); workers echo it in their reports, and a report of another run is ignored (the
late "finished" of a half aborted with reason "moved" must not end the run sent back to that worker).
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from scheduler_svc.conversations import ConversationTable
from scheduler_svc.prefix_hints import PREFIX_INDEX, PrefixHints
from scheduler_svc.routing import (Scorer, WorkerView, able, conversation_worker, layout_differences, least_loaded,
                                   pairable, route, same_layout)
from services import metrics
from services.envelope import Envelope
from services.protocol.kv_events import MatchResponse
from services.protocol.messages import (
    Abort, Admitted, AwaitKV, Dispatch, Migrate, MoveKV, Moved, Rejected, RequestFailed, Resume, Submit, WorkerStatus,
    failure_of)

log = logging.getLogger("kvmesh.scheduler")


def live_outputs(msg: Resume) -> list[list[int]]:
    """The tokens of a moving stream's samples that have not ended."""
    ended = set(msg.ended)
    return [out for i, out in enumerate(msg.output_token_ids) if i not in ended]


PROMPT_LOGPROBS_CODE = "prompt_logprobs_unavailable"
NO_PROMPT_LOGPROBS = ("invalid prompt_logprobs: no worker of this deployment computes prompt logprobs (tensor-parallel "
                      "and mtp-speculation workers do not); leave out prompt_logprobs (and, on completions, logprobs "
                      "with echo)")


@dataclass(frozen=True)
class Limits:
    max_queue: int = 4096
    max_tenant_inflight: int = 1024
    worker_capacity_factor: float = 2.0
    retry_after_s: int = 1
    pd_min_prefill_tokens: int = 256   # routing.route: fewer uncached prompt tokens run on D alone
    conversation_max_load: float = 1.0  # routing.conversation_worker: past this load a conversation moves
    max_migrations: int = 3            # times a request may move to another worker mid-stream
    migration_wait_s: float = 60.0     # how long a moved request with no worker left waits for one


@dataclass
class _Req:
    submit: Submit
    hint: Any = None               # what the scorer reads besides load (prefix_hints: a prefix match)
    block_hashes: list[bytes] | None = None   # prefix_hints: recorded for its worker(s) at dispatch
    matching: bool = False         # admitted, out of the queue until the prefix index answers
    worker_id: str | None = None   # None while queued; with a hand-off, the decode worker
    prefill_id: str | None = None  # the prefill worker, until it reports the hand-off ended
    received_at: float = 0.0       # clock(): the Submit read off the socket (the shell's time, if given)
    dispatched_at: float = 0.0
    migrations: int = 0            # times it moved to another worker mid-stream
    moving: str = ""               # the migration reason while its detokenizer's Resume is awaited
    resume: Resume | None = None   # where its stream stood when it last moved (dispatched with it)
    run: int = 0                   # its current run (Dispatch.run): reports of another run are stale
    moved_from: str = ""           # the worker it last left
    kv_from: str = ""              # a draining worker holding its KV for a peer move (WorkerStatus.kv_held)
    drained: bool = False          # requeued after a drain's hand-back: its dispatch is counted (DRAIN_MOVES)


class SchedulerCore:
    # A dispatched request the worker does not list as active this long after dispatch has ended
    # and its "finished" report was lost (e.g. sent before the worker knew this scheduler).
    RECONCILE_AFTER_S = 5.0

    def __init__(self, limits: Limits = Limits(), scorer: Scorer = least_loaded,
                 clock: Callable[[], float] = time.monotonic, prefix_hints: PrefixHints | None = None,
                 conversations: ConversationTable | None = None) -> None:
        self.limits, self.scorer, self.clock = limits, scorer, clock
        self.prefix_hints = prefix_hints   # None: routed without prefix matches (no PrefixQuery)
        self.conversations = conversations   # None: a conversation's turns are routed like any request
        self.workers: dict[str, WorkerView] = {}
        self.requests: dict[str, _Req] = {}
        self.tenant_inflight: dict[str, int] = {}
        self._queue: list[tuple[int, int, str]] = []   # (priority, arrival no, request id)
        self._queued = 0
        self._arrivals = itertools.count()
        self.rejections: dict[str, int] = {}
        self.worker_failures = 0
        self.prefill_retries = 0          # requests a dead prefill worker left, re-run on their decode worker
        self.inbox_addr = ""              # this scheduler's inbox (the shell sets it): where Resumes come
        # resubmitted requests no worker has listed yet, while some worker has not reported
        self._unplaced: dict[str, tuple[Submit, float]] = {}
        # moved requests queued while no worker could take them -> (when they fail: expire_waits, why
        # they moved); counted as moved once dispatched
        self._waiting: dict[str, tuple[float, str]] = {}
        # run numbers, one per dispatch: from a random start, so a scheduler that restarted does not
        # reuse the numbers of its predecessor's runs (a late report of one must not match a new run)
        self._runs = itertools.count(secrets.randbelow(1 << 62))

    # ---- admission -----------------------------------------------------------------------
    def submit(self, msg: Submit, received_at: float | None = None) -> list[Envelope]:
        """`received_at` (this core's clock) is when the shell read msg off its socket; default now."""
        if msg.resubmitted:
            return self._adopt(msg, self.clock() if received_at is None else received_at)
        rid = msg.request_id
        if rid in self.requests:
            return [self._reject(msg, 400, "duplicate_request", "request id already in use")]
        eligible = self._eligible()
        if not eligible:
            return [self._reject(msg, 503, "no_workers", "no worker is available to serve this model; retry later")]
        if not (eligible := able(eligible, msg)):
            return [self._reject(msg, 400, PROMPT_LOGPROBS_CODE, NO_PROMPT_LOGPROBS)]
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
        req = self._register(msg, self.clock() if received_at is None else received_at)
        self._queued += 1                  # counted as queued from admission, its prefix match included
        admitted = Envelope(msg.reply_addr, Admitted(request_id=rid))
        # where is its prefix? ask first, when there is a choice to make: between workers, or
        # between prefilling on a prefill worker and decode-only on a decode worker that holds it
        if self.prefix_hints is not None and len(eligible) + len(self._prefill_pool()) > 1:
            req.matching = True
            return [Envelope(PREFIX_INDEX, self.prefix_hints.query(msg, eligible)), admitted]
        self._enqueue(req)
        # the dispatch is on the request's critical path (first token); the admission reply is not
        return [*self.dispatch(), admitted]

    def _register(self, msg: Submit, received_at: float) -> _Req:
        req = self.requests[msg.request_id] = _Req(msg, received_at=received_at)
        self.tenant_inflight[msg.tenant] = self.tenant_inflight.get(msg.tenant, 0) + 1
        return req

    # ---- adoption: requests an earlier scheduler held, sent again by their gateways ----------
    def _adopt(self, msg: Submit, received_at: float) -> list[Envelope]:
        """Admission was done by the scheduler that stopped: no limits are checked again. Until
        every worker has listed what it holds, a request none lists waits (`_unplaced`): it may
        be on one not heard from yet (a worker that never reports is gone within a lease)."""
        rid = msg.request_id
        admitted = Envelope(msg.reply_addr, Admitted(request_id=rid))
        if rid in self.requests:                   # sent again before this core's answer arrived
            return [admitted]
        holders = [w for w in self.workers.values() if rid in w.inherited]
        # a hand-off is held by a prefill and a decode worker: adopted onto one half only, the other
        # half's death would go unseen, so a request not on a mixed worker waits for every report
        if not any(w.role == "mixed" for w in holders) and not all(w.reported for w in self.workers.values()):
            self._unplaced[rid] = (msg, received_at)
            return []
        req = self._register(msg, received_at)
        if not holders:                            # its worker died, or it never reached one
            log.info("request %s, sent again, runs on no worker; asking its detokenizer where it stands", rid)
            req.moving = "resubmitted"
            return [admitted, Envelope(msg.detok_addr, Migrate(request_id=rid, worker_id="",
                                                               reply_addr=self.inbox_addr))]
        prefill = next((w for w in holders if w.role == "prefill"), None)
        worker = next((w for w in holders if w is not prefill), prefill)
        req.worker_id, req.dispatched_at = worker.id, self.clock()
        req.prefill_id = prefill.id if prefill is not None and prefill is not worker else None
        req.run = worker.inherited[rid] or 0    # the run its holders report (both halves: the same)
        if req.prefill_id is not None and msg.params.seed is None:   # the seed P draws with (_pairing_seed)
            req.submit = _with_seed(msg, _pairing_seed(rid))
        for w in holders:
            w.inherited.pop(rid, None)
            w.inflight.add(rid)
        return [admitted]

    def _place_unplaced(self) -> list[Envelope]:
        """Adopt (or move) the waiting resubmissions once every worker has listed what it holds."""
        if not self._unplaced or not all(w.reported for w in self.workers.values()):
            return []
        waiting, self._unplaced = self._unplaced, {}
        return [env for msg, at in waiting.values() for env in self._adopt(msg, at)]

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
        """Workers that can run a request whole: mixed and decode ones (decode workers run short
        prompts whole and decode the rest); prefill ones only while no decode worker exists."""
        live = [w for w in self.workers.values() if not w.draining]
        whole = [w for w in live if w.role != "prefill"]
        return whole or live

    def _prefill_pool(self) -> list[WorkerView]:
        if not any(w.role == "decode" for w in self.workers.values()):
            return []
        return [w for w in self.workers.values() if w.role == "prefill" and not w.draining]

    # ---- dispatch ------------------------------------------------------------------------
    def dispatch(self) -> list[Envelope]:
        out: list[Envelope] = []
        factor = self.limits.worker_capacity_factor
        later: list[tuple[int, int, str]] = []   # requests only busy workers can run: queued on
        while self._queue:
            room = [w for w in self._eligible() if w.holding < w.capacity(factor)]
            if not room:
                break
            entry = heapq.heappop(self._queue)
            rid = entry[2]
            req = self.requests.get(rid)
            if req is None or req.worker_id is not None:
                continue  # aborted while queued (lazy deletion)
            # a moved stream has its prompt logprobs already (the engine does not make them again)
            fits = room if req.resume is not None else able(room, req.submit)
            if not fits:
                if able(self._eligible(), req.submit):
                    later.append(entry)
                else:                 # the workers that could run it have left since its admission
                    out += self._refuse_queued(rid, req)
                continue
            self._queued -= 1
            prefill = [] if req.resume is not None else able([  # a moved stream goes on where its tokens are computed
                w for w in self._prefill_pool() if w.holding < w.capacity(factor)], req.submit)
            sticky = self._conversation_worker(req.submit, fits)
            chosen = route(fits, prefill, req.submit, self.scorer, req.hint, self.limits.pd_min_prefill_tokens,
                           sticky)
            if chosen.label != "mixed" or prefill:
                metrics.PD_ROUTES.labels(chosen.label).inc()
            out += self._send_to(rid, req, chosen.worker, chosen.prefill)
        for entry in later:
            heapq.heappush(self._queue, entry)
        return out

    def _refuse_queued(self, rid: str, req: _Req) -> list[Envelope]:
        """A queued request no live worker can compute (it asks for prompt logprobs): a 400."""
        self._queued -= 1
        self._forget(rid)
        self.rejections[PROMPT_LOGPROBS_CODE] = self.rejections.get(PROMPT_LOGPROBS_CODE, 0) + 1
        return [Envelope(req.submit.reply_addr, RequestFailed(request_id=rid, status=400, code=PROMPT_LOGPROBS_CODE,
                                                              message=NO_PROMPT_LOGPROBS)), *self._release_kv(req)]

    def _conversation_worker(self, s: Submit, room: list[WorkerView]) -> WorkerView | None:
        """The worker of the conversation's last turn, where it can take this one (routing.py)."""
        if self.conversations is None or not s.conversation:
            return None
        last = self.conversations.lookup(s.tenant, s.conversation, self.clock())
        worker = conversation_worker(room, last, self.limits.conversation_max_load)
        metrics.CONVERSATION_ROUTES.labels("new" if last is None else "kept" if worker else "moved").inc()
        return worker

    def _send_to(self, rid: str, req: _Req, worker: WorkerView, prefill: WorkerView | None) -> list[Envelope]:
        """`worker` runs the request whole, or decodes it after `prefill` handed it the KV."""
        req.worker_id, req.dispatched_at, req.run = worker.id, self.clock(), next(self._runs)
        if (waited := self._waiting.pop(rid, None)) is not None:    # a worker joined in time
            metrics.MIGRATIONS.labels(waited[1], "moved").inc()
        s, out = req.submit, []
        if self.conversations is not None and s.conversation:   # the next turn finds its KV there
            self.conversations.record(s.tenant, s.conversation, worker.id, req.dispatched_at)
        for w in (worker, prefill):
            if w is not None:
                w.inflight.add(rid)
                w.dispatched += 1
                if req.block_hashes and self.prefix_hints is not None:   # for the next ones sharing its prefix
                    self.prefix_hints.dispatched(w.id, req.block_hashes, req.dispatched_at)
        req.block_hashes = None
        if prefill is not None:
            req.prefill_id = prefill.id
            if s.params.seed is None:     # a re-run after P died must draw what P drew
                s = req.submit = _with_seed(s, _pairing_seed(rid))
            out.append(Envelope(worker.addr, AwaitKV(request_id=rid, epoch=worker.epoch, n=s.params.n,
                                                     reply_addr=s.reply_addr, detok_addr=s.detok_addr, run=req.run)))
        target = prefill or worker
        dispatch = _dispatch_of(rid, s, target, worker.kv_addr if prefill is not None else "", req.run,
                                resume=req.resume)
        move = self._peer_move(rid, req, worker) if req.kv_from else None
        if move is not None:      # a drained worker holds its KV: it goes along
            log.info("request %s moves to worker %s with its KV from %s", rid, worker.id, req.kv_from)
            dispatch = msgspec.structs.replace(dispatch, kv_from=req.kv_from)
            out.append(move)
        elif req.kv_from:         # ... or is freed
            out += self._release_kv(req)
        if req.drained:
            metrics.DRAIN_MOVES.labels("peer" if move is not None else "recompute").inc()
            req.drained = False
        if req.resume is not None:      # one line per moved request, as its "leaves worker" line
            log.info("request %s resumes on worker %s epoch %d after %d tokens", rid, target.id, target.epoch,
                     max((len(t) for t in req.resume.output_token_ids), default=0))
        out.append(Envelope(target.addr, dispatch))
        return out

    # ---- request end ---------------------------------------------------------------------
    def abort(self, msg: Abort) -> list[Envelope]:
        req = self.requests.get(msg.request_id)
        if req is None:
            if (waiting := self._unplaced.pop(msg.request_id, None)) is not None:
                return [Envelope(waiting[0].reply_addr, failure_of(msg))]
            return []
        if req.moving:                      # its detokenizer holds the stream: it lets go of it too
            self._forget(msg.request_id)
            return [Envelope(req.submit.reply_addr, failure_of(msg)), Envelope(req.submit.detok_addr, msg),
                    *self._release_kv(req)]
        if req.worker_id is None:           # queued or matching: forget it (heap entry deleted lazily)
            self._queued -= 1
            self._forget(msg.request_id)
            # its gateway ends the stream; a peer move's holder frees the KV
            out = [Envelope(req.submit.reply_addr, failure_of(msg)), *self._release_kv(req)]
            if req.resume is not None:      # a moved stream: its detokenizer holds it
                out.append(Envelope(req.submit.detok_addr, msg))
            return out
        holders = (self.workers.get(req.prefill_id or ""), self.workers.get(req.worker_id),
                   self.workers.get(req.kv_from))      # a peer move's sender: it stops and frees the KV
        return [Envelope(w.addr, msg) for w in holders if w is not None]

    def _forget(self, rid: str) -> None:
        self._waiting.pop(rid, None)
        req = self.requests.pop(rid, None)
        if req is None:
            return
        tenant = req.submit.tenant
        left = self.tenant_inflight.get(tenant, 1) - 1
        if left > 0:
            self.tenant_inflight[tenant] = left
        else:
            self.tenant_inflight.pop(tenant, None)
        for wid in (req.worker_id, req.prefill_id):
            if wid and (w := self.workers.get(wid)):
                w.inflight.discard(rid)

    def _leave(self, rid: str, w: WorkerView, run: int | None) -> None:
        """Worker w holds nothing of rid's `run` any more (None: a worker that numbers no runs): a
        prefill worker's part ends, a request ends. A report of another run is late: that run was
        aborted (moved) and rid was sent back to w since, so it says nothing of the run there now."""
        req = self.requests.get(rid)
        if req is None:
            return
        if run is not None and run != req.run:
            log.debug("request %s: worker %s's report of run %d is late (run %d now); ignored", rid, w.id, run,
                      req.run)
            return
        if req.prefill_id == w.id:
            req.prefill_id = None
            w.inflight.discard(rid)
        elif req.worker_id == w.id and req.prefill_id is not None:
            # D let go before P did: P decodes it itself (D had no room for its KV), or P's own
            # report (hand-off failed, aborted) follows; either way P holds the request now
            req.worker_id, req.prefill_id = req.prefill_id, None
            w.inflight.discard(rid)
        elif req.worker_id == w.id:
            self._forget(rid)

    def worker_status(self, msg: WorkerStatus) -> list[Envelope]:
        w = self.workers.get(msg.worker_id)
        if w is None or w.epoch != msg.epoch:
            # another incarnation's (a stale one's "finished" list would forget live requests);
            # a newer one's counts once the registry shows its epoch
            return []
        w.running, w.waiting = msg.running, msg.waiting
        w.free_blocks, w.cached_blocks, w.total_blocks = msg.free_blocks, msg.cached_blocks, msg.total_blocks
        # kept before finished: a kept hand-off that ended in the next step is listed in both, and
        # read the other way round its end would clear only the prefill half, leaving it on D
        out = [env for rid, run in _with_runs(msg.kept, msg.kept_runs) for env in self._kept(rid, run, w)]
        for rid, run in _with_runs(msg.finished, msg.finished_runs):
            self._leave(rid, w, run)
            if rid in w.inherited and (run is None or w.inherited[rid] in (None, run)):
                del w.inherited[rid]
        if msg.handed_back:      # only a draining worker hands requests back: send it nothing more,
            w.draining = True    # even before its registry record says so (the moves would come back)
        out += [env for rid in msg.handed_back if (req := self.requests.get(rid)) is not None
                and w.id in (req.worker_id, req.prefill_id) for env in self._move(rid, req, w, "drain")]
        for rid in msg.kv_held:     # its KV waits at w for a peer (a heartbeat may have moved it first)
            req = self.requests.get(rid)
            if req is not None and req.moving and req.moved_from == w.id:
                req.kv_from = w.id
            else:
                out.append(Envelope(w.addr, Abort(request_id=rid, reason="moved")))
        if msg.active is not None:
            active, now = dict(_with_runs(msg.active, msg.active_runs or [])), self.clock()
            # what an earlier scheduler sent it: it holds a slot until its end
            w.inherited = {rid: run for rid, run in active.items() if rid not in self.requests}
            w.reported = True
            for rid in [r for r in w.inflight if not _holds(active, r, self.requests[r].run)]:
                if now - self.requests[rid].dispatched_at > self.RECONCILE_AFTER_S:
                    log.info("request %s left worker %s without a report; forgetting it", rid, w.id)
                    self._leave(rid, w, None)
        return out + self._place_unplaced() + self.dispatch()

    def _kept(self, rid: str, run: int | None, p: WorkerView) -> list[Envelope]:
        """Prefill worker p decodes rid itself: its hand-off failed (the decode worker had no room,
        refused, failed, or went silent: dead, perhaps, before its lease lapsed here). p holds the
        request alone from now on; the decode worker drops its half, quietly ("moved": the stream
        goes on at p). Should the request have moved already (the decode worker's death seen first),
        this report is late: the move stands, its Abort "moved" drops the request at p, and its
        Migrate names p too, so the detokenizer drops what p streamed after it. The detokenizer
        leaves the decode worker too (a Migrate without a Resume)."""
        req = self.requests.get(rid)
        if req is None or req.prefill_id != p.id or (run is not None and run != req.run):
            return []
        decoder = self.workers.get(req.worker_id or "")
        req.worker_id, req.prefill_id = p.id, None
        log.info("request %s: its hand-off failed; prefill worker %s decodes it", rid, p.id)
        if decoder is None:
            return []
        decoder.inflight.discard(rid)
        # the decoder may hold it after all (its Ack late past P's lease): whatever it streams
        # before the Abort lands is dropped at the detokenizer, which leaves it now
        leave = Migrate(request_id=rid, worker_id=decoder.id, worker_epoch=decoder.epoch,
                        reply_addr=self.inbox_addr, resume=False)
        return [Envelope(decoder.addr, Abort(request_id=rid, reason="moved")),
                Envelope(req.submit.detok_addr, leave)]

    # ---- membership ----------------------------------------------------------------------
    def set_workers(self, views: list[WorkerView]) -> list[Envelope]:
        """Replace the live set. Gone or re-epoched workers fail their in-flight requests (those a
        prefill worker held for a live decode worker are re-run there)."""
        out: list[Envelope] = []
        fresh = {v.id: v for v in views}
        lost = {wid for wid, old in self.workers.items()
                if wid not in fresh or fresh[wid].epoch != old.epoch}
        for wid in sorted(lost):
            old, new = self.workers[wid], fresh.get(wid)
            out += self._fail_worker(old, "gone" if new is None else "restarted", lost)
            del self.workers[wid]
            if self.prefix_hints is not None:   # a new epoch starts with an empty cache
                self.prefix_hints.forget_worker(wid)
            if self.conversations is not None:
                self.conversations.forget_worker(wid)
        for wid, view in fresh.items():
            cur = self.workers.get(wid)
            if cur is None:
                log.info("worker %s epoch %d joined (%s, %s)", wid, view.epoch, view.role, view.addr)
                self.workers[wid] = view
                self._check_pairable(view)
            else:  # keep our in-flight set; refresh what the record says
                # draining ends only with the epoch: a record read before it said so does not undo it
                cur.draining, cur.addr, cur.role = cur.draining or view.draining, view.addr, view.role
                cur.kv_addr, cur.kv_layout, cur.kv_transport = view.kv_addr, view.kv_layout, view.kv_transport
                cur.max_num_seqs, cur.max_model_len = view.max_num_seqs, view.max_model_len
                cur.prompt_logprobs = view.prompt_logprobs
                cur.prefix_query_tokens, cur.prefix_hit_tokens = view.prefix_query_tokens, view.prefix_hit_tokens
        out += self._place_unplaced() + self.dispatch()
        return out + self.expire_waits()      # after the dispatch: a worker that joined just now takes them

    def _check_pairable(self, w: WorkerView) -> None:
        """A prefill or decode worker whose KV layout no worker of the other pool shares is never
        paired (its KV would be garbage there): say so once, when it joins."""
        other = {"prefill": "decode", "decode": "prefill"}.get(w.role)
        peers = [p for p in self.workers.values() if p.role == other]
        if other is None or not peers or any(pairable(w, p) for p in peers):
            return
        if w.kv_layout is None or all(p.kv_layout is None for p in peers):
            # not a mismatch to fix: the null engine publishes no layout (layout_differences would be empty)
            nothing = w if w.kv_layout is None else peers[0]
            log.warning("worker %s (%s) is not paired with a %s worker: %s holds no KV to move (the null model), "
                        "so the pools serve without hand-offs", w.id, w.role, other, nothing.id)
            return
        alike = [p for p in peers if same_layout(w, p)]
        if alike:
            log.error("worker %s (%s) moves KV with --kv-transport %s, which no %s worker of its KV layout "
                      "uses (theirs: %s); it will not be paired with any", w.id, w.role, w.kv_transport, other,
                      alike[0].kv_transport)
            return
        diffs = layout_differences(w, peers[0])
        weights = " (it loads other weights than they do: a rolling upgrade pairs old with old, new with new)" \
            if any(d.startswith("weights_digest:") for d in diffs) else ""
        log.error("worker %s (%s) has a KV layout no %s worker shares; it will not be paired with any%s. It differs "
                  "from %s's in %s", w.id, w.role, other, weights, peers[0].id, "; ".join(diffs))

    def _fail_worker(self, w: WorkerView, why: str, lost: set[str]) -> list[Envelope]:
        """`lost`: every worker gone in this update (a decode worker among them cannot take a re-run)."""
        self.worker_failures += 1
        log.warning("worker %s epoch %d %s; moving (or failing) its %d in-flight requests", w.id, w.epoch, why,
                    len(w.inflight))
        out: list[Envelope] = []
        for rid in list(w.inflight):
            req = self.requests.get(rid)
            if req is None:
                continue
            decoder = self.workers.get(req.worker_id or "") if req.prefill_id == w.id else None
            if decoder is not None and decoder.id not in lost:
                req.prefill_id = None
                w.inflight.discard(rid)
                self.prefill_retries += 1
                metrics.PD_ROUTES.labels("rerun").inc()
                log.warning("request %s: its prefill worker %s %s; re-running it on %s", rid, w.id, why, decoder.id)
                out.append(Envelope(decoder.addr, _dispatch_of(rid, req.submit, decoder, "", req.run, resumes=True)))
                continue
            out += self._move(rid, req, w, "worker_died")
        return out

    # ---- migration -----------------------------------------------------------------------
    def _move(self, rid: str, req: _Req, w: WorkerView, reason: str) -> list[Envelope]:
        """Worker w no longer runs rid (it died, or handed it back): ask its detokenizer where the
        stream stands (resumed() goes on), or fail it when it may not move again."""
        out: list[Envelope] = []
        other: WorkerView | None = None
        for wid in (req.worker_id, req.prefill_id):
            if wid and (holder := self.workers.get(wid)):
                holder.inflight.discard(rid)
                if holder is not w:     # the other half of a hand-off frees what it holds, silently:
                    # the stream goes on elsewhere, so its detokenizer must not end it
                    other = holder
                    out.append(Envelope(holder.addr, Abort(request_id=rid, reason="moved")))
        req.worker_id = req.prefill_id = None
        req.moved_from, req.kv_from = w.id, ""
        if req.migrations >= self.limits.max_migrations:
            return out + self._fail_moving(rid, req, reason)
        req.moving = reason
        log.info("request %s leaves worker %s (%s); asking its detokenizer where it stands", rid, w.id, reason)
        # the other half streams on until the Abort reaches it (a decode worker that had the KV, or
        # a prefill worker that took its failed hand-off back): the detokenizer leaves it too
        return out + [Envelope(req.submit.detok_addr,
                               Migrate(request_id=rid, worker_id=w.id, reply_addr=self.inbox_addr,
                                       worker_epoch=w.epoch, also_worker_id=other.id if other else "",
                                       also_worker_epoch=other.epoch if other else -1))]

    def resumed(self, msg: Resume) -> list[Envelope]:
        """The detokenizer's answer to a Migrate: requeue the request from where its stream stands.
        A stream it does not hold never opened (the request runs from its start) or is over (that
        run's text is dropped as late: the gateway ended the request already)."""
        req = self.requests.get(msg.request_id)
        if req is None or not req.moving:
            return []
        n = req.submit.params.n
        if req.kv_from and not (msg.known and len(msg.output_token_ids) == n and live_outputs(msg)
                                and all(live_outputs(msg))):
            return [*self._release_kv(req), *self.resumed(msg)]     # not a stream a peer move fits
        reason, req.moving = req.moving, ""
        if msg.known and len(set(msg.ended)) >= n:     # every sample ended meanwhile: nothing to run
            self._forget(msg.request_id)
            return []
        if msg.known and len(msg.output_token_ids) != n:
            log.warning("request %s: a Resume with %d samples for n=%d; failing it", msg.request_id,
                        len(msg.output_token_ids), n)
            return self._fail_moving(msg.request_id, req, reason)
        if not self._eligible():
            wait_s = self.limits.migration_wait_s
            if wait_s <= 0:
                return self._fail_moving(msg.request_id, req, reason)
            # the last worker is gone (restarting, perhaps): the stream pauses until one joins
            self._waiting[msg.request_id] = (self.clock() + wait_s, reason)
            log.warning("request %s: no worker can take it; it waits up to %.0f s for one", msg.request_id, wait_s)
        req.migrations += 1
        req.drained = reason == "drain"
        req.hint = None                # the prefix match named the worker it left; routed by load
        req.resume = msg if msg.known else Resume(request_id=msg.request_id, output_token_ids=[])
        if msg.request_id not in self._waiting:
            metrics.MIGRATIONS.labels(reason, "moved").inc()
        self._queued += 1
        self._enqueue(req)
        # a stream never opened (dispatched to a worker that died before it ran it, e.g. within
        # the lapsing lease) has no detokenizer state to time its wait from: its gateway times it
        # from the Submit. A re-sent request's gateway knows already (it sent it again). Sent ahead
        # of the Dispatch: one hop, where the first tokens take three and a step, so it comes first.
        told = [] if msg.known or reason == "resubmitted" else [
            Envelope(req.submit.reply_addr, Moved(request_id=msg.request_id))]
        return told + self.dispatch()

    def expire_waits(self) -> list[Envelope]:
        """Fail the moved requests that waited --migration-wait-s for a worker in vain."""
        now = self.clock()
        out: list[Envelope] = []
        for rid, (_, reason) in [(r, w) for r, w in self._waiting.items() if now >= w[0]]:
            self._queued -= 1               # (its heap entry is dropped lazily)
            log.warning("request %s: no worker joined within %.0f s; failing it", rid, self.limits.migration_wait_s)
            out += self._fail_moving(rid, self.requests[rid], reason)
        return out

    def _release_kv(self, req: _Req) -> list[Envelope]:
        """The draining worker holding req's KV frees it: the request is recomputed instead."""
        holder, req.kv_from = self.workers.get(req.kv_from), ""
        return [] if holder is None else [Envelope(holder.addr, Abort(request_id=req.submit.request_id,
                                                                      reason="moved"))]

    def _peer_move(self, rid: str, req: _Req, worker: WorkerView) -> Envelope | None:
        """The MoveKV that sends req's held KV to `worker`, when it can take it; None otherwise."""
        holder = self.workers.get(req.kv_from)
        # within a pool only (mixed to mixed, decode to decode): what the chart's policy lets through
        if (holder is None or holder is worker or holder.role != worker.role or not worker.kv_addr
                or not pairable(holder, worker)):
            return None
        outputs, several = req.resume.output_token_ids, req.submit.params.n > 1
        return Envelope(holder.addr, MoveKV(request_id=rid, epoch=holder.epoch, to=worker.kv_addr, run=req.run,
                                            output_token_ids=outputs[0], sample_outputs=outputs if several else [],
                                            ended=list(req.resume.ended) if several else []))

    def _fail_moving(self, rid: str, req: _Req, reason: str) -> list[Envelope]:
        metrics.MIGRATIONS.labels(reason, "failed").inc()
        self._forget(rid)
        s = req.submit
        return [Envelope(s.reply_addr, RequestFailed(request_id=rid, status=503, code="worker_failed",
                                                     message="the worker serving this request stopped; please retry")),
                Envelope(s.detok_addr, Abort(request_id=rid, reason="worker_failed")), *self._release_kv(req)]

    # ---- introspection -------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def num_inherited(self) -> int:
        """Requests workers hold that an earlier scheduler dispatched (after a restart)."""
        return sum(len(w.inherited) for w in self.workers.values())

    @property
    def num_inflight(self) -> int:
        return len(self.requests) - self._queued


def _pairing_seed(rid: str) -> int:
    """The seed of a paired request the client gave none: a function of its id (128 random bits,
    made by the gateway), so a scheduler that restarts mid-hand-off fixes the seed its predecessor
    fixed, and a re-run on D still draws what P drew."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8, person=b"kvmesh-pd-seed").digest()) >> 1


def _with_seed(s: Submit, seed: int) -> Submit:
    return msgspec.structs.replace(s, params=msgspec.structs.replace(s.params, seed=seed))


def _dispatch_of(rid: str, s: Submit, worker: WorkerView, handoff_to: str, run: int, resumes: bool = False,
                 resume: Resume | None = None) -> Dispatch:
    """`resume`: where a moved stream stands (its detokenizer keeps it: `resumes`)."""
    if resume is not None:
        return Dispatch(request_id=rid, epoch=worker.epoch, prompt_token_ids=s.prompt_token_ids, params=s.params,
                        priority=s.priority, cache_salt=s.cache_salt, reply_addr=s.reply_addr,
                        detok_addr=s.detok_addr, resumes=True, resume_output=resume.output_token_ids,
                        resume_ended=resume.ended, run=run)
    return Dispatch(request_id=rid, epoch=worker.epoch, prompt_token_ids=s.prompt_token_ids, params=s.params,
                    priority=s.priority, cache_salt=s.cache_salt, reply_addr=s.reply_addr, detok_addr=s.detok_addr,
                    handoff_to=handoff_to, resumes=resumes, run=run)


def _with_runs(ids: list[str], runs: list[int]) -> list[tuple[str, int | None]]:
    """A WorkerStatus list with its runs; a worker that numbers no runs sends none (None: any run)."""
    if len(runs) != len(ids):
        return [(rid, None) for rid in ids]
    return list(zip(ids, runs))


def _holds(active: dict[str, int | None], rid: str, run: int) -> bool:
    """Does a heartbeat's active list name this run of rid?"""
    return rid in active and active[rid] in (None, run)
