"""`kvmesh scheduler`: the shell around SchedulerCore (ZMQ inbox, Redis discovery, health, metrics).

Handlers (everything this process accepts):

    Submit        -> core.submit          (from gateways, with the time it was read: the dispatch
                                           stage's start)
    (PrefixQuery) -> core.prefix_matched  (the core's question, with --routing cache_aware and several
                                           workers: the one gRPC Match at the prefix-cache index,
                                           PrefixClient, 50 ms deadline; no index or no answer: None)
    Abort         -> core.abort           (from gateways: disconnect; detokenizers: stop string)
    WorkerStatus  -> core.worker_status   (from workers, per finished step and per heartbeat)
    Resume        -> core.resumed         (from detokenizers: where a stream moving off a stopped
                                           worker stands)
    (Redis poll)  -> core.set_workers     (every heartbeat/2: joins, deaths, restarts, draining)

SENDERS names the roles (CURVE keys) each message may come from; the inbox drops the rest.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

from redis.exceptions import RedisError

from scheduler_svc.conversations import ConversationTable
from scheduler_svc.core import Limits, SchedulerCore
from scheduler_svc.prefix_hints import PREFIX_INDEX, PrefixHints, PrefixQuery
from scheduler_svc.routing import RoutingWeights, WorkerView, make_scorer
from services import metrics
from services.config import SchedulerConfig, load_or_exit
from services.envelope import Envelope
from services.logging import RateLimitedLog, setup as setup_logging
from services.protocol.messages import Abort, Dispatch, Resume, SchedulerInbox, Submit, WorkerStatus
from services.redis_client import RedisAuth
from services.registry import Membership, Registry, ServiceRecord
from services.security.curve import Plane, plane_or_exit, with_role
from services.shell import run_until_signal
from services.prefix_client import PrefixClient
from services.protocol.kv_events import MatchResponse
from services.transport import Receiver, SenderPool, add_health, grpc_server, run_async, set_serving, tcp_addr

log = logging.getLogger("kvmesh.scheduler")
# message -> the roles that may send it ("tokenizer": a detokenizer's stop string; a gateway with
# --text-in-gateway sends its stop strings as the gateway role)
SENDERS = {Submit: ("gateway",), Abort: ("gateway", "tokenizer"), WorkerStatus: ("worker",),
           Resume: ("gateway", "tokenizer")}


def view_of(r: ServiceRecord) -> WorkerView:
    info, load = r.info, r.load
    return WorkerView(id=r.id, epoch=r.epoch, addr=r.addrs.get("zmq", ""), role=info.get("role", "mixed"),
                      max_num_seqs=int(info.get("max_num_seqs", 128)),
                      max_model_len=int(info.get("max_model_len", 0)), draining=bool(info.get("draining")),
                      running=int(load.get("running", 0)), waiting=int(load.get("waiting", 0)),
                      free_blocks=int(load.get("free_blocks", 0)), cached_blocks=int(load.get("cached_blocks", 0)),
                      total_blocks=int(load.get("total_blocks", 0)), model_id=str(info.get("model_id", "")),
                      block_size=int(info.get("block_size", 16)), kv_addr=str(r.addrs.get("kv", "")),
                      kv_layout=info.get("kv_layout") if isinstance(info.get("kv_layout"), dict) else None,
                      kv_transport=str(info.get("kv_transport", "zmq")),
                      prompt_logprobs=bool(info.get("prompt_logprobs", True)),
                      prefix_query_tokens=int(load.get("prefix_query_tokens", 0)),
                      prefix_hit_tokens=int(load.get("prefix_hit_tokens", 0)))


_MALFORMED = RateLimitedLog(log, "worker records")


def readable_views(records: list[ServiceRecord]) -> list[WorkerView]:
    """The views of the records view_of can read; one with a field of the wrong type (written by
    hand, or by another version) is left out like a record that does not decode (logged,
    rate-limited): the others' routing and failover must not stop for it."""
    views = []
    for r in records:
        try:
            views.append(view_of(r))
        except (ValueError, TypeError) as exc:
            _MALFORMED.warn("ignoring worker %s: a malformed record (%s)", r.id[:64], exc)
    return views


def routing_weights(cfg: SchedulerConfig) -> RoutingWeights:
    return RoutingWeights(hit_weight=cfg.route_hit_weight, queue_weight=cfg.route_queue_weight,
                          running_weight=cfg.route_running_weight, kv_weight=cfg.route_kv_weight,
                          overflow_penalty=cfg.route_overflow_penalty, cpu_credit=cfg.route_cpu_credit,
                          disk_credit=cfg.route_disk_credit, shared_credit=cfg.route_shared_credit)


def conversation_table(cfg: SchedulerConfig) -> ConversationTable | None:
    """round_robin is the baseline that ignores where KV is, so it keeps no conversations either."""
    if cfg.routing == "round_robin" or cfg.route_conversation_ttl_s <= 0:
        return None
    return ConversationTable(cfg.route_conversation_ttl_s)


class SchedulerService:
    def __init__(self, cfg: SchedulerConfig, plane: Plane) -> None:
        self.cfg = cfg
        self.plane = plane
        self.core = SchedulerCore(Limits(cfg.max_queue, cfg.max_tenant_inflight, cfg.worker_capacity_factor,
                                         cfg.retry_after_s, cfg.pd_min_prefill_tokens,
                                         cfg.route_conversation_max_load, cfg.max_migrations, cfg.migration_wait_s),
                                  scorer=make_scorer(cfg.routing, routing_weights(cfg)),
                                  prefix_hints=PrefixHints() if cfg.routing == "cache_aware" else None,
                                  conversations=conversation_table(cfg))
        self.prefix: PrefixClient | None = None  # the prefix-cache index (cache_aware routing only)
        self.asking: set[asyncio.Task] = set()   # Match calls in flight (held: the loop keeps weak refs)
        self.senders: SenderPool = SenderPool(plane)
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # a vanished record is kept for two heartbeats, and for a lease after Redis lost its data
        # (registry.Membership), then its worker is dead
        self.membership = Membership(2 * cfg.heartbeat_ms / 1000, rejoin_s=cfg.lease_ms / 1000)
        self.labeled: dict[str, int] = {}   # worker ids with metric labels -> dispatches counted
        # a Submit that finds no eligible worker polls too: one poll at a time, so a read taken
        # before a restart is never applied after one taken since (the worker would flip back to
        # its dead epoch, and its new incarnation's requests be moved off it)
        self._polling = asyncio.Lock()
        self.handlers = {Submit: self.core.submit, Abort: self.core.abort, WorkerStatus: self.core.worker_status,
                         Resume: self.core.resumed}

    async def run(self) -> int:
        cfg = self.cfg
        self.trust = self.plane.trust     # gRPC and Redis use the same trust material as ZeroMQ
        server, grpc_port = grpc_server(cfg.host, cfg.port, self.trust)
        health = await add_health(server, cfg.host, cfg.health_port)
        await server.start()
        metrics_port = metrics.serve_metrics(cfg.host, cfg.metrics_port, "scheduler")
        self.receiver: Receiver = Receiver(SchedulerInbox, cfg.host, cfg.zmq_port, name="scheduler",
                                           plane=self.plane, senders=SENDERS)
        host = cfg.reachable_host()
        addrs = {"zmq": with_role(tcp_addr(host, self.receiver.port), "scheduler"), "grpc": f"{host}:{grpc_port}"}
        self.core.inbox_addr = addrs["zmq"]
        if metrics_port > 0:
            addrs["metrics"] = f"http://{host}:{metrics_port}/metrics"
        self.registry = Registry(cfg.redis_url, RedisAuth.of(self.trust))
        self.lease = await self.registry.register("scheduler", self.id, addrs=addrs, info={}, lease_ms=cfg.lease_ms)
        await self._poll_workers()
        await set_serving(health, True)
        log.info("scheduler ready: zmq %s", addrs["zmq"])
        tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._membership_loop())]
        code = await run_until_signal(tasks, "scheduler", log)
        await set_serving(health, False)
        await self.lease.release()
        await self.registry.close()
        if self.prefix is not None:
            await self.prefix.close()
        await server.stop(0.5)
        await health.stop()
        self.receiver.close()
        self.senders.close()
        return code

    def _send(self, out: list[Envelope]) -> None:
        for env in out:
            if env.dest == PREFIX_INDEX:
                self._ask_index(env.msg)
                continue
            self.senders.send(env.dest, env.msg)
            if isinstance(env.msg, Dispatch) and (req := self.core.requests.get(env.msg.request_id)) is not None:
                metrics.SCHED_DISPATCH.observe(self.core.clock() - req.received_at)

    def _ask_index(self, query: PrefixQuery) -> None:
        """The core's PrefixQuery: answered at once without an index, else by a Match call of its own."""
        if self.prefix is None:
            self._send(self.core.prefix_matched(query.request_id, None))
            return
        task = asyncio.create_task(self._match(self.prefix, query))
        self.asking.add(task)
        task.add_done_callback(self.asking.discard)

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.receiver.recv()
            read_at = self.core.clock()   # the dispatch stage starts here (core.submit's received_at)
            if isinstance(msg, Submit) and not self.core.has_eligible_worker:
                # A worker may have registered since the last poll (the gateway can see it
                # first): look once more before answering 503.
                try:
                    await self._poll_workers()
                except (RedisError, OSError) as exc:   # Redis away: answer from what we know
                    log.warning("registry poll failed: %s", exc)
            if isinstance(msg, Submit):
                self._send(self.core.submit(msg, received_at=read_at))
            else:
                self._send(self.handlers[type(msg)](msg))
            metrics.QUEUE_DEPTH.set(self.core.queue_depth)
            metrics.SCHED_RUNNING.set(self.core.num_inflight)

    async def _match(self, prefix: PrefixClient, query: PrefixQuery) -> None:
        """The one gRPC call of cache-aware routing; its answer (unavailable when the index is slow
        or failing: the core routes by load) goes back to the core."""
        t0 = time.perf_counter()
        match = await ask_index(prefix, query)
        metrics.PREFIX_MATCHES.labels("unavailable" if not match.available else
                                      "hit" if match.workers else "miss").inc()
        out = self.core.prefix_matched(query.request_id, match)     # (hashes the prompt's blocks)
        metrics.SCHED_PREFIX_MATCH.observe(time.perf_counter() - t0)
        self._send(out)
        metrics.QUEUE_DEPTH.set(self.core.queue_depth)

    async def _poll_prefix_index(self) -> None:
        if self.cfg.routing != "cache_aware":
            return
        records = await self.registry.list("prefix-cache")
        target = next((r.addrs["grpc"] for r in records if "grpc" in r.addrs), "")
        if target != (self.prefix.target if self.prefix else ""):
            timeout_s = self.cfg.prefix_match_timeout_ms / 1000
            old, self.prefix = self.prefix, (PrefixClient(target, self.trust, timeout_s=timeout_s) if target else None)
            if old is not None:
                await old.close()
            if self.prefix is not None:      # connected before the first Match needs it
                task = asyncio.create_task(self.prefix.connect())
                self.asking.add(task)
                task.add_done_callback(self.asking.discard)
            log.info("prefix-cache index %s", target or "gone: routing by load only")

    async def _poll_workers(self) -> None:
        async with self._polling:
            await self._apply_poll()

    async def _apply_poll(self) -> None:
        fresh = await self.registry.list("worker")
        records = self.membership.update(fresh, time.monotonic(), self.registry.incarnation)
        views = readable_views(records)
        before = self.core.worker_failures
        self._send(self.core.set_workers(views))
        metrics.WORKER_FAILURES.inc(self.core.worker_failures - before)
        metrics.WORKERS.set(len(self.core.workers))
        for gone in set(self.labeled) - set(self.core.workers):
            for gauge in (metrics.WORKER_RUNNING, metrics.WORKER_WAITING, metrics.WORKER_KV_USAGE,
                          metrics.WORKER_PREFIX_HIT, metrics.WORKER_DISPATCHED):
                gauge.remove(gone)
            del self.labeled[gone]
        query = hit = 0
        for w in self.core.workers.values():
            metrics.WORKER_RUNNING.labels(w.id).set(w.running)
            metrics.WORKER_WAITING.labels(w.id).set(w.waiting)
            metrics.WORKER_KV_USAGE.labels(w.id).set(w.kv_usage)
            metrics.WORKER_PREFIX_HIT.labels(w.id).set(w.prefix_hit_tokens / max(w.prefix_query_tokens, 1))
            seen = self.labeled.get(w.id, 0)   # a restarted worker (new view) counts from 0 again
            metrics.WORKER_DISPATCHED.labels(w.id).inc(w.dispatched - seen if w.dispatched >= seen else w.dispatched)
            self.labeled[w.id] = w.dispatched
            query, hit = query + w.prefix_query_tokens, hit + w.prefix_hit_tokens
        metrics.CLUSTER_PREFIX_HIT.set(hit / max(query, 1))

    async def _membership_loop(self) -> None:
        period = max(self.cfg.heartbeat_ms / 2000, 0.05)
        beat, last_beat = self.cfg.heartbeat_ms / 1000, 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            try:
                await self._poll_workers()
                if loop.time() - last_beat >= beat:
                    last_beat = loop.time()
                    await self._poll_prefix_index()
                    await self.lease.renew({"queued": self.core.queue_depth, "inflight": self.core.num_inflight,
                                            "inherited": self.core.num_inherited})
            except Exception as exc:  # Redis hiccup: keep the last known set, retry
                log.warning("registry poll failed: %s", exc)


async def ask_index(prefix: PrefixClient, query: PrefixQuery) -> MatchResponse:
    """The index's longest-prefix match of the query's prompt; `available=False` when the index is
    slow or failing (PrefixClient's deadline and breaker: fail open)."""
    return await prefix.match(query.model_id, query.prompt_token_ids, tenant_salt=query.tenant_salt,
                              cache_salt=query.cache_salt)


def main(argv: list[str]) -> int:
    cfg = load_or_exit(SchedulerConfig, argv, "kvmesh scheduler")
    setup_logging("scheduler", cfg.log_level)
    plane = plane_or_exit(cfg, "scheduler")
    return run_async(SchedulerService(cfg, plane).run())
