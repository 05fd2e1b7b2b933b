"""`kvmesh prefix-cache`: the thin shell around PrefixCore.

    workers (registry in Redis) --KV event batches, ZMQ SUB--> core.on_batch --changes--> Redis
                               <--SnapshotRequest, DEALER--  on a gap, a new epoch, or a check
    scheduler --gRPC Match (msgspec)--> core.match            grpc.health.v1 for the probes

Tasks: one reads event batches, one writes the core's ownership changes to Redis in order (the
only writer), one follows the registry (joins; expired leases purge the worker), one asks again
for overdue snapshots and runs the periodic consistency checks, one renews this service's lease.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import time
import uuid
from typing import NamedTuple

import grpc
from prometheus_client import REGISTRY

from prefix_cache_svc.channels import EventSubscriber, fetch_snapshot
from prefix_cache_svc.config import PrefixCacheConfig
from prefix_cache_svc.core import Outcome, PrefixCore
from prefix_cache_svc.metrics import MATCH_SECONDS, CoreCollector
from prefix_cache_svc.store import OwnershipStore
from services import metrics, redis_client
from services.config import load_or_exit
from services.logging import setup as setup_logging
from services.protocol.kv_events import (
    PREFIX_GRPC_SERVICE, SHARED_TIER_INFO, KVEventBatch, MatchRequest, MatchResponse, Snapshot, shared_tier_id,
)
from services.redis_client import RedisAuth
from services.registry import Membership, Registry
from services.security.curve import Plane, plane_or_exit
from services.shell import run_until_signal
from services.transport import Method, add_health, grpc_server, run_async, set_serving, unary_handler

log = logging.getLogger("kvmesh.prefix-cache")
SCHEDULER_ONLY = frozenset({"scheduler"})   # Match answers which workers hold a prompt: schedulers route on it

_MAX_UNWRITTEN = 1_000_000   # changes kept for Redis while it is unreachable
_TICK_S = 0.25
# a shared KV store no live worker announced this long is purged: long past a rolling restart or a
# node's drain (its next worker announces the store again within seconds), so only a store whose
# node or directory is gone for good loses its blocks
SHARED_UNREAD_S = 3600.0


class WorkerAddrs(NamedTuple):
    events: str
    snapshot: str


class PrefixCacheService:
    def __init__(self, cfg: PrefixCacheConfig, plane: Plane) -> None:
        self.cfg = cfg
        self.plane = plane
        self.core = PrefixCore(cfg.block_size, cfg.max_blocks or None)
        self.sub = EventSubscriber(plane)
        self.workers: dict[str, WorkerAddrs] = {}
        # an expired record purges its worker at once; after Redis lost its data, each worker has a
        # lease to register again before its blocks go (the index keeps what their snapshots said)
        self.registered = Membership(0.0, rejoin_s=cfg.lease_ms / 1000)
        self.grpc_addr = ""
        self._fetching: set[str] = set()
        self._changed = asyncio.Event()
        self._unwritten: list = []
        self._tasks: list[asyncio.Task] = []          # the service's loops
        self._fetch_tasks: set[asyncio.Task] = set()  # snapshot requests in flight
        self._next_check = 0.0
        self._unread_since: dict[str, float] = {}     # shared store id -> when no live worker announced it
        self._next_resync = 0.0
        self._check_store = False
        self._redis_ok = True
        self._check_order: list[str] = []
        # message -> handler: everything this process accepts
        self.handlers = {
            KVEventBatch: self._on_batch,     # workers, ZMQ SUB
            Snapshot: self._on_snapshot,      # workers, DEALER replies
            MatchRequest: self._match,        # schedulers, gRPC /kvmesh.PrefixCache/Match
        }

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        trust = self.plane.trust     # gRPC and Redis use the same trust material as ZeroMQ
        self.redis = redis_client.connect(cfg.redis_url, RedisAuth.of(trust))
        self.store = OwnershipStore(self.redis, cfg.block_size)
        loaded = await self.store.load(self.core)
        gc.freeze()  # the reloaded index is long-lived: keep it out of every full collection
        log.info("reloaded %d block copies of %d workers from Redis", loaded, len(self.core.index.workers()))
        self.server, port = grpc_server(cfg.host, cfg.port, trust)
        self.server.add_generic_rpc_handlers([unary_handler(
            PREFIX_GRPC_SERVICE, {"Match": Method(self._match, MatchRequest, SCHEDULER_ONLY)}, trust)])
        self.health = await add_health(self.server, cfg.host, cfg.health_port)
        await self.server.start()
        host = cfg.reachable_host()
        self.grpc_addr = f"{host}:{port}"
        addrs = {"grpc": self.grpc_addr}
        metrics_port = metrics.serve_metrics(cfg.host, cfg.metrics_port, "prefix-cache")
        if metrics_port > 0:
            addrs["metrics"] = f"http://{host}:{metrics_port}/metrics"
        self._collector = CoreCollector(self.core)
        REGISTRY.register(self._collector)
        self.registry = Registry(cfg.redis_url, RedisAuth.of(trust))
        self.lease = await self.registry.register("prefix-cache", f"{socket.gethostname()}-{os.getpid()}",
                                                  addrs=addrs, info={"block_size": cfg.block_size},
                                                  lease_ms=cfg.lease_ms)
        await self._discover()
        self._tasks = [asyncio.create_task(coro) for coro in (
            self._events_loop(), self._writer_loop(), self._discovery_loop(), self._maintenance_loop(),
            self._heartbeat_loop())]
        await set_serving(self.health, True)
        log.info("prefix-cache ready: grpc %s, %d workers", self.grpc_addr, len(self.workers))

    async def stop(self) -> None:
        await set_serving(self.health, False)
        for task in (*self._tasks, *self._fetch_tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._fetch_tasks, return_exceptions=True)
        await self._write(self.core.drain_changes())
        await self.lease.release()
        await self.registry.close()
        await self.server.stop(0.5)
        await self.health.stop()
        REGISTRY.unregister(self._collector)
        self.sub.close()
        await self.redis.aclose()

    async def run(self) -> int:
        await self.start()
        code = await run_until_signal(self._tasks, "prefix-cache", log)
        await self.stop()
        return code

    # ---- gRPC ------------------------------------------------------------------------------
    async def _match(self, req: MatchRequest, context) -> MatchResponse:
        if len(req.tokens) % 4:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "tokens must be packed uint32 (a multiple of 4 bytes)")
        t0 = time.perf_counter()
        resp = self.core.match(req)
        MATCH_SECONDS.observe(time.perf_counter() - t0)
        return resp

    # ---- events and writes -------------------------------------------------------------------
    async def _events_loop(self) -> None:
        while True:
            batch = await self.sub.recv()
            try:
                self.handlers[KVEventBatch](batch)
            except Exception:  # one bad batch must not stop the index
                log.exception("applying a KV event batch from %s failed", batch.worker_id)

    def _on_batch(self, batch: KVEventBatch) -> None:
        if batch.worker_id not in self.workers:
            return  # not (or no longer) a live worker: its lease decides, not its packets
        if self.core.on_batch(batch, time.monotonic()) is Outcome.NEED_SNAPSHOT:
            self._request_snapshot(batch.worker_id)
        self._changed.set()

    async def _writer_loop(self) -> None:
        """The only Redis writer: changes go out in the order the core made them."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            if self._check_store:
                self._check_store = False
                await self._resync_store()
            await self._write(self.core.drain_changes())

    async def _write(self, changes: list) -> None:
        self._unwritten.extend(changes)
        if not self._unwritten:
            return
        try:
            await self.store.apply(self._unwritten)
            self._unwritten = []
            self._redis_ok = True
        except Exception as exc:  # Redis down: keep the changes and retry on the next tick
            if len(self._unwritten) > _MAX_UNWRITTEN:
                log.error("Redis unreachable; dropping %d ownership changes (rewritten when it is back)",
                          len(self._unwritten))
                self._unwritten = []
            if self._redis_ok:
                log.warning("writing ownership to Redis failed: %s", exc)
            self._redis_ok = False

    async def _resync_store(self) -> None:
        """Redis restarted empty (or was flushed): write the whole index back."""
        try:
            if not await self.store.lost_records():
                return
            self._unwritten = []  # the rewrite covers them (later changes are still queued in the core)
            written = await self.store.rewrite(self.core)
            log.warning("Redis lost the ownership records: rewrote %d block copies", written)
        except Exception as exc:
            log.debug("store resync skipped: %s", exc)

    # ---- snapshots ---------------------------------------------------------------------------
    def _request_snapshot(self, worker_id: str) -> None:
        if worker_id in self._fetching or worker_id not in self.workers:
            return
        self.core.mark_requested(worker_id, time.monotonic())
        self._start_fetch(worker_id)

    def _start_fetch(self, worker_id: str) -> None:
        self._fetching.add(worker_id)
        task = asyncio.get_running_loop().create_task(self._fetch(worker_id, self.workers[worker_id].snapshot))
        self._fetch_tasks.add(task)
        task.add_done_callback(self._fetch_tasks.discard)

    async def _fetch(self, worker_id: str, addr: str) -> None:
        try:
            snap = await fetch_snapshot(addr, uuid.uuid4().hex, self.cfg.snapshot_timeout_s, self.plane)
        finally:
            self._fetching.discard(worker_id)
        if snap is None or snap.worker_id != worker_id or worker_id not in self.workers:
            return  # the overdue check asks again
        try:
            self.handlers[Snapshot](snap)
        except Exception:
            log.exception("applying a snapshot of %s failed", worker_id)

    def _on_snapshot(self, snap: Snapshot) -> None:
        if self.core.on_snapshot(snap) is Outcome.NEED_SNAPSHOT:
            self._request_snapshot(snap.worker_id)
        self._changed.set()

    async def _maintenance_loop(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            now = time.monotonic()
            for worker_id in self.core.snapshot_overdue(now, self.cfg.snapshot_timeout_s):
                self._request_snapshot(worker_id)
            self._consistency_check(now)
            if now >= self._next_resync:  # the writer checks, so Redis writes stay in order
                self._next_resync = now + self.cfg.store_check_s
                self._check_store = True
            if self._unwritten or self._check_store:
                self._changed.set()

    def _consistency_check(self, now: float) -> None:
        """One worker per period / number of workers, round robin."""
        if self.cfg.consistency_check_s <= 0 or not self.workers or now < self._next_check:
            return
        self._next_check = now + self.cfg.consistency_check_s / len(self.workers)
        if not self._check_order:
            self._check_order = sorted(self.workers)
        worker_id = self._check_order.pop()
        stream = self.core.streams.get(worker_id)
        if (worker_id in self.workers and stream is not None and stream.awaiting_since is None
                and worker_id not in self._fetching):
            self._start_fetch(worker_id)

    # ---- registry ----------------------------------------------------------------------------
    async def _discovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.discovery_interval_s)
            try:
                await self._discover()
            except Exception as exc:
                log.warning("reading the worker registry failed: %s", exc)

    async def _discover(self) -> None:
        live: dict[str, WorkerAddrs] = {}
        readers: dict[str, str] = {}
        fresh = await self.registry.list("worker")
        for rec in self.registered.update(fresh, time.monotonic(), self.registry.incarnation):
            events, snapshot = rec.addrs.get("kv_events"), rec.addrs.get("kv_snapshot")
            if not events or not snapshot:
                continue  # prefix caching off on that worker
            if rec.info.get("block_size", self.cfg.block_size) != self.cfg.block_size:
                log.warning("worker %s uses block size %s, this index %d: ignoring it",
                            rec.id, rec.info.get("block_size"), self.cfg.block_size)
                continue
            live[rec.id] = WorkerAddrs(events, snapshot)
            shared = shared_tier_id(rec.info.get(SHARED_TIER_INFO))
            if shared is not None:
                readers[rec.id] = shared
        self.core.set_readers(readers)
        await self._forget_unread_stores(set(readers.values()), time.monotonic())
        for worker_id, addrs in live.items():
            old = self.workers.get(worker_id)
            if old != addrs:
                if old is not None:
                    self.sub.disconnect(old.events)
                self.sub.connect(addrs.events)
                self.workers[worker_id] = addrs
                log.info("following worker %s at %s", worker_id, addrs.events)
        known = set(self.workers) | set(self.core.index.workers()) | await self.store.known_workers()
        for worker_id in known - set(live):
            self._forget(worker_id)

    async def _forget_unread_stores(self, announced: set[str], now: float) -> None:
        """A shared store's blocks outlive its workers (the files stay for the next one on the node),
        but not a store nobody announced for SHARED_UNREAD_S: its node or directory is gone."""
        stores = set(self.core.index.shared_tiers()) | await self.store.known_shared_tiers()
        for shared_id in stores - announced:
            since = self._unread_since.setdefault(shared_id, now)
            if now - since >= SHARED_UNREAD_S:
                held = self.core.remove_shared_tier(shared_id)
                del self._unread_since[shared_id]
                log.info("shared KV store %s: no worker announced it for %.0f s; purged %d blocks",
                         shared_id, SHARED_UNREAD_S, held)
                self._changed.set()
        for shared_id in announced:
            self._unread_since.pop(shared_id, None)

    def _forget(self, worker_id: str) -> None:
        addrs = self.workers.pop(worker_id, None)
        if addrs is not None:
            self.sub.disconnect(addrs.events)
        held = self.core.remove_worker(worker_id)
        log.info("worker %s is gone (lease expired): purged %d blocks", worker_id, held)
        self._changed.set()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_ms / 1000)
            try:
                await self.lease.renew({"blocks": len(self.core.index), "workers": len(self.workers)})
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)


def main(argv: list[str]) -> int:
    global log
    cfg = load_or_exit(PrefixCacheConfig, argv, "kvmesh prefix-cache")
    log = setup_logging("prefix-cache", cfg.log_level)
    if not cfg.redis_url:
        log.error("--redis-url (or KVMESH_REDIS_URL) is required: Redis holds the registry and block ownership")
        return 2
    plane = plane_or_exit(cfg, "prefix-cache")
    return run_async(PrefixCacheService(cfg, plane).run())
