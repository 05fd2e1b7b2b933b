"""`kvmesh scheduler`: the shell around SchedulerCore (ZMQ inbox, Redis discovery, health, metrics).

Handlers (everything this process accepts):

    Submit        -> core.submit          (from gateways; with several workers, first a prefix
                                           Match at the prefix-cache index, 50 ms deadline, as the
                                           routing hint; no index or no answer: least-loaded)
    Abort         -> core.abort           (from gateways: disconnect; detokenizers: stop string)
    WorkerStatus  -> core.worker_status   (from workers, per finished step and per heartbeat)
    (Redis poll)  -> core.set_workers     (every heartbeat/2: joins, deaths, restarts, draining)
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid

from scheduler_svc.core import Envelope, Limits, SchedulerCore
from scheduler_svc.routing import WorkerView, cache_aware
from services import metrics
from services.config import SchedulerConfig, load_or_exit
from services.logging import setup as setup_logging
from services.protocol.messages import Abort, SchedulerInbox, Submit, WorkerStatus
from services.registry import Membership, Registry, ServiceRecord
from services.protocol.kv_events import PREFIX_GRPC_SERVICE, MatchRequest, MatchResponse, pack_token_ids
from services.transport import (
    Receiver, SenderPool, add_health, grpc_channel, grpc_server, run_async, set_serving, tcp_addr, unary_stub)

MATCH_TIMEOUT_S = 0.05

log = logging.getLogger("kvmesh.scheduler")


def view_of(r: ServiceRecord) -> WorkerView:
    info, load = r.info, r.load
    return WorkerView(id=r.id, epoch=r.epoch, addr=r.addrs.get("zmq", ""), role=info.get("role", "mixed"),
                      max_num_seqs=int(info.get("max_num_seqs", 128)),
                      max_model_len=int(info.get("max_model_len", 0)), draining=bool(info.get("draining")),
                      running=int(load.get("running", 0)), waiting=int(load.get("waiting", 0)),
                      free_blocks=int(load.get("free_blocks", 0)), cached_blocks=int(load.get("cached_blocks", 0)),
                      total_blocks=int(load.get("total_blocks", 0)), model_id=str(info.get("model_id", "")))


class SchedulerService:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.core = SchedulerCore(Limits(cfg.max_queue, cfg.max_tenant_inflight, cfg.worker_capacity_factor,
                                         cfg.retry_after_s), scorer=cache_aware)
        self.prefix_target = ""                 # gRPC address of the prefix-cache index, if any
        self.prefix_stub = None
        self.matching: dict[str, bool] = {}     # submissions waiting for their Match (id -> aborted?)
        self.senders: SenderPool = SenderPool()
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # a vanished record is kept for two heartbeats (Redis restart), then its worker is dead
        self.membership = Membership(2 * cfg.heartbeat_ms / 1000)
        self.labeled: set[str] = set()      # worker ids with metric labels
        self.handlers = {Submit: self.core.submit, Abort: self.core.abort, WorkerStatus: self.core.worker_status}

    async def run(self) -> int:
        cfg = self.cfg
        server, grpc_port = grpc_server(cfg.host, cfg.port)
        health = await add_health(server)
        await server.start()
        metrics_port = metrics.serve_metrics(cfg.host, cfg.metrics_port)
        self.receiver: Receiver = Receiver(SchedulerInbox, cfg.host, cfg.zmq_port, name="scheduler")
        host = cfg.reachable_host()
        addrs = {"zmq": tcp_addr(host, self.receiver.port), "grpc": f"{host}:{grpc_port}"}
        if metrics_port > 0:
            addrs["metrics"] = f"http://{host}:{metrics_port}/metrics"
        self.registry = Registry(cfg.redis_url)
        self.lease = await self.registry.register("scheduler", self.id, addrs=addrs, info={}, lease_ms=cfg.lease_ms)
        await self._poll_workers()
        await set_serving(health, True)
        log.info("scheduler ready: zmq %s", addrs["zmq"])
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._membership_loop())]
        waiter = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        code = 0
        for t in done:
            if t is not waiter and t.exception() is not None:
                log.error("scheduler loop died: %r", t.exception())
                code = 1
        for t in tasks:
            t.cancel()
        await set_serving(health, False)
        await self.lease.release()
        await self.registry.close()
        await server.stop(0.5)
        self.receiver.close()
        self.senders.close()
        return code

    def _send(self, out: list[Envelope]) -> None:
        for env in out:
            self.senders.send(env.dest, env.msg)

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.receiver.recv()
            if isinstance(msg, Submit) and self.prefix_stub is not None and len(self.core.workers) > 1:
                self.matching[msg.request_id] = False
                asyncio.create_task(self._submit_with_match(msg))
                continue
            if isinstance(msg, Abort) and msg.request_id in self.matching:
                self.matching[msg.request_id] = True
                continue
            self._send(self.handlers[type(msg)](msg))
            metrics.QUEUE_DEPTH.set(self.core.queue_depth)
            metrics.SCHED_RUNNING.set(self.core.num_inflight)

    async def _submit_with_match(self, msg: Submit) -> None:
        match = await self._match(msg)
        if self.matching.pop(msg.request_id, False):
            return  # aborted while we asked
        self._send(self.core.submit(msg, hint=match))
        metrics.QUEUE_DEPTH.set(self.core.queue_depth)

    async def _match(self, msg: Submit) -> MatchResponse | None:
        """The index's longest-prefix match, or None (no index, slow, or failing: fail open)."""
        model_id = next((str(w.model_id) for w in self.core.workers.values() if w.model_id), "")
        tenant_salt, cache_salt = split_salt(msg.cache_salt)
        try:
            return await self.prefix_stub(MatchRequest(  # type: ignore[misc]
                model_id=model_id, tokens=pack_token_ids(msg.prompt_token_ids), tenant_salt=tenant_salt,
                cache_salt=cache_salt), timeout=MATCH_TIMEOUT_S)
        except Exception as exc:
            log.debug("prefix match failed: %s", exc)
            return None

    async def _poll_prefix_index(self) -> None:
        records = await self.registry.list("prefix-cache")
        target = next((r.addrs["grpc"] for r in records if "grpc" in r.addrs), "")
        if target != self.prefix_target:
            self.prefix_target = target
            self.prefix_stub = unary_stub(grpc_channel(target), PREFIX_GRPC_SERVICE, "Match",
                                          MatchResponse) if target else None
            log.info("prefix-cache index %s", target or "gone: routing by load only")

    async def _poll_workers(self) -> None:
        records = self.membership.update(await self.registry.list("worker"), time.monotonic())
        views = [view_of(r) for r in records]
        before = self.core.worker_failures
        self._send(self.core.set_workers(views))
        metrics.WORKER_FAILURES.inc(self.core.worker_failures - before)
        metrics.WORKERS.set(len(self.core.workers))
        for gone in self.labeled - set(self.core.workers):
            for gauge in (metrics.WORKER_RUNNING, metrics.WORKER_WAITING, metrics.WORKER_KV_USAGE):
                gauge.remove(gone)
        self.labeled = set(self.core.workers)
        for w in self.core.workers.values():
            metrics.WORKER_RUNNING.labels(w.id).set(w.running)
            metrics.WORKER_WAITING.labels(w.id).set(w.waiting)
            metrics.WORKER_KV_USAGE.labels(w.id).set(w.kv_usage)

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
                    await self.lease.renew({"queued": self.core.queue_depth, "inflight": self.core.num_inflight})
            except Exception as exc:  # Redis hiccup: keep the last known set, retry
                log.warning("registry poll failed: %s", exc)


def split_salt(salt: str) -> tuple[str, str]:
    """Invert services.protocol.kv_events.cache_salt_for: "N:<tenant N chars><request salt>"."""
    head, sep, rest = salt.partition(":")
    if not sep or not head.isdigit() or int(head) > len(rest):
        return "", salt
    n = int(head)
    return rest[:n], rest[n:]


def main(argv: list[str]) -> int:
    cfg = load_or_exit(SchedulerConfig, argv, "kvmesh scheduler")
    setup_logging("scheduler", cfg.log_level)
    return run_async(SchedulerService(cfg).run())
