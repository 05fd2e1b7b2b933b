"""`kvmesh worker`: the process shell around WorkerCore (sockets, engine thread, heartbeat, signals).

    engine thread:  recv_all(dispatches, aborts) -> core.run(inbox) -> send envelopes -> repeat
                    (blocks in the socket poll only when the engine has nothing to do)
    event loop:     heartbeat (Redis lease + load, WorkerStatus to the scheduler), gRPC health,
                    signals

The engine thread owns its sockets (plain zmq, no event loop between two steps), so a step never
waits for the loop and the loop keeps heartbeating while a step computes.

Lease fencing: the engine thread emits only while the lease is certainly alive (`Lease.held()`:
the last renewal started less than --lease-ms ago). After a pause (SIGSTOP, a stalled host) or
a Redis outage past the lease it holds its output until the heartbeat knows more: the same epoch
renewed (nothing was lost: it sends and goes on) or a new epoch taken because the record had
expired (the scheduler has failed the old epoch's requests: it drops them all, frees their KV
blocks, discards the held output and serves as the new incarnation; the KV-event stream restarts
in the new epoch and the prefix index resyncs it from a snapshot). SIGTERM drains: the
record says `draining` (no new work is routed here), running requests finish (up to
--drain-grace-s), those left are handed back (stopped, their KV freed, listed in a WorkerStatus's
`handed_back`: the scheduler moves each to another worker, where it continues from the tokens
already streamed; those held with their KV, `kv_held`, go there with it within the hand-off
lease, which the drain waits for), an engine with a disk KV tier writes its cached KV there (up to 5 s: the next
worker on the same directory starts warm), then the lease is released.

Roles (--role): a prefill worker queues each hand-off for its sender thread (handoff.PrefillSender)
right after the step output carrying the request's first token went to its socket, and frees the
request's blocks when the sender reports the end (the engine thread never waits for a decode
worker); a decode worker binds the KV-transfer socket (CURVE, worker role only; advertised as `kv` in its record) and serves it
between steps, waiting on it and on its inbox together when idle. A mixed or decode worker has
both ends (--drain-kv-to-peers): a drain sends its decoding requests' KV to the peers the
scheduler picks (MoveKV), and it takes theirs (WorkerCore, "Peer moves"). Every real engine advertises its
KV layout (`kv_layout` in the record's info): the scheduler pairs only workers whose layouts are equal.

SENDERS names the roles (CURVE keys) each inbox message may come from; the inbox drops the rest.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import zmq

from gpu_worker.service.core import WorkerCore
from gpu_worker.service.move_cost import MoveCosts
from services import metrics
from services.config import WorkerConfig, engine_error_text, load_or_exit
from services.engine_args import engine_args_of
from services.envelope import SCHEDULER, Envelope
from services.logging import setup as setup_logging
from services.model_names import path_aliases, served_names
from services.protocol.messages import Abort, AwaitKV, Dispatch, MoveKV, WorkerInbox
from services.protocol.kv_events import SHARED_TIER_INFO
from services.redis_client import RedisAuth
from services.registry import Lease, Membership, Registry
from services.security import bundle
from services.security.curve import Plane, plane_or_exit, with_role
from services.shell import arm_stop_deadline
from services.transport import SenderPool, SyncReceiver, add_health, grpc_server, run_async, set_serving, tcp_addr

# --drain-grace-s's default (the chart's terminationGracePeriodSeconds covers it with what follows)
DRAIN_TIMEOUT_S = next(f.default for f in dataclasses.fields(WorkerConfig) if f.name == "drain_grace_s")
FAIL_ALL_TIMEOUT_S = 5.0  # after the drain's grace: for the engine thread to hand back (or fail) what is left
FLUSH_S = 0.3             # after that: for the sockets to write the last messages (they close without linger)
DRAIN_TO_DISK_S = 5.0     # then writing the cached KV to a disk tier
STOP_DEADLINE_S = 20.0   # after the drain: engine join, lease release, freeing the device
log = logging.getLogger("kvmesh.worker")
# message -> the roles that may send it (a gateway that detokenizes stops a sample its stop string ended)
SENDERS = {Dispatch: ("scheduler",), AwaitKV: ("scheduler",), Abort: ("scheduler", "gateway"), MoveKV: ("scheduler",)}


def shared_tier_key(cfg: WorkerConfig, plane: Plane) -> bytes | None:
    """The MAC key of the shared KV tier's files, derived from the worker's trust material (every
    worker of the deployment holds the same); None without a shared tier. Raises ValueError naming
    the flags where there is no trust material: never a shared tier without authentication."""
    if not cfg.kv_offload_shared_dir:
        return None
    if plane.trust is None:
        raise ValueError("--kv-offload-shared-dir is refused with --insecure-internal-planes: the shared tier's "
                         "files are authenticated with a key derived from the worker's --trust-dir, and without "
                         "it any process that can write that directory could plant KV that other requests read")
    return bundle.shared_kv_key(plane.trust)


def build_engine(cfg: WorkerConfig, shared_key: bytes | None = None) -> Any:
    if cfg.null_model:
        from gpu_worker.service.null_engine import NullEngine
        vocab = cfg.null_vocab_size
        if cfg.model and (Path(cfg.model) / "config.json").is_file():
            vocab = int(json.loads((Path(cfg.model) / "config.json").read_text()).get("vocab_size", vocab))
        return NullEngine(vocab_size=vocab, max_num_seqs=cfg.max_num_seqs, block_size=cfg.block_size,
                          num_blocks=cfg.num_gpu_blocks or 65536, max_model_len=cfg.max_model_len or 4096,
                          step_ms=cfg.null_step_ms)
    from gpu_worker.engine import Engine
    return Engine(engine_config(cfg, shared_key))


def engine_config(cfg: WorkerConfig, shared_key: bytes | None = None) -> Any:
    """The EngineConfig of the worker's engine fields (all of EngineArgs'; tuning from the env)
    and the shared tier's key (shared_tier_key)."""
    from gpu_worker.config import EngineConfig
    args = engine_args_of(cfg)
    if cfg.role == "prefill" and args["speculative_config"] and _spec_method(args["speculative_config"]) != "mtp":
        # A prefill worker draws only each request's first token, so it never proposes: a draft
        # model there would only hold memory and run beside every prefill (the decode worker
        # catches its KV up itself). The MTP layer stays: its KV of the prompt needs the target's
        # hidden states, which only this worker computes, and moves with the hand-off
        # (spec_decode/mtp.py). Speculation runs on the decode workers (`kvmesh serve` gives every
        # pool the same flags).
        log.info("--speculative-config is ignored on a prefill worker: speculation runs on the decode workers")
        args["speculative_config"] = None
    return EngineConfig(**args, kv_offload_shared_key=shared_key)


def _spec_method(text: str) -> str | None:
    """The method of a --speculative-config value; None when malformed (dropped like the others)."""
    from services.speculative import parse_speculative_config
    try:
        return parse_speculative_config(text).method
    except ValueError:
        return None


def engine_info(cfg: WorkerConfig, engine: Any) -> dict[str, Any]:
    stats = engine.stats()
    names = served_names(cfg.served_model_name, cfg.model)
    name = names[0]
    return {"model": name, "served_model_names": names, "model_paths": path_aliases(cfg.model),
            "role": cfg.role, "max_model_len": int(stats.extra.get("max_model_len", 0)),
            "max_num_seqs": cfg.max_num_seqs, "block_size": cfg.block_size,
            "vocab_size": int(engine.vocab_size), "null_model": cfg.null_model, "draining": False,
            "model_id": getattr(getattr(engine, "setup", None), "model_id", name),
            "kv_layout": kv_layout(engine), "kv_transport": kv_wire(cfg.kv_transport), "pid": os.getpid(),
            # routes prompt_logprobs requests; the null engine refuses none (it answers without them)
            "prompt_logprobs": bool(getattr(engine, "computes_prompt_logprobs", True)),
            **shared_tier_info(engine)}


def shared_tier_info(engine: Any) -> dict[str, str]:
    """The shared KV tier's store id, announced so the prefix index credits that tier's blocks to
    every worker reading it (gpu_worker/kv_tiers/shared_store_id.py); none without one."""
    shared = getattr(getattr(engine, "kv_tiers", None), "shared", None)
    store_id = getattr(shared, "store_id", None)
    return {SHARED_TIER_INFO: store_id} if store_id else {}


def kv_wire(kv_transport: str) -> str:
    """What the scheduler pairs workers by: nixl reads, or frames (zmq, shm, cuda_ipc and auto agree
    on shared memory and cache reads per hand-off, so they mix)."""
    return "nixl" if kv_transport == "nixl" else "zmq"


def kv_layout(engine: Any) -> dict[str, Any] | None:
    """The engine's KV layout (gpu_worker/kv_transfer/layout.py) as plain fields; None for the null
    engine, which holds no KV to move."""
    if not hasattr(engine, "runner"):
        return None
    import msgspec
    from gpu_worker.kv_transfer.layout import handoff_layout
    return msgspec.structs.asdict(handoff_layout(engine))


class EngineThread(threading.Thread):
    """Runs WorkerCore: receive, step, send; nothing else touches the engine or these sockets."""

    IDLE_POLL_MS = 50   # also the idle period of KV-event heartbeats and snapshot answers

    def __init__(self, core: WorkerCore, receiver: SyncReceiver, scheduler_addrs: list[str], lease: Lease,
                 plane: Plane, kv_publisher: Any = None, handoff_sender: Any = None,
                 kv_receiver: Any = None) -> None:
        super().__init__(name="engine", daemon=True)
        self.core, self.receiver, self.kv_publisher = core, receiver, kv_publisher
        self.handoff_sender = handoff_sender        # prefill role: handoff.PrefillSender
        self.kv_receiver = kv_receiver              # decode role: handoff.DecodeReceiver
        self.poller: zmq.Poller | None = None
        if kv_receiver is not None:                 # idle: wake for a dispatch or a KV message
            self.poller = zmq.Poller()
            self.poller.register(receiver.socket, zmq.POLLIN)
            self.poller.register(kv_receiver.endpoint.socket, zmq.POLLIN)
        self.lease = lease                          # renewed by the loop thread; read here
        self.scheduler_addrs = scheduler_addrs      # replaced (not mutated) by the heartbeat
        self.senders: SenderPool = SenderPool(plane)
        self.stop = threading.Event()
        self.fail_message: str | None = None        # set by the loop thread: fail all, then idle
        self.handing_back = False                   # set by the loop thread (drain): hand back all, then idle
        self.handed_back = 0                        # requests handed back so far
        self.error: BaseException | None = None
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()   # run between two steps

    def call_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Run fn on this thread before its next step (the engine is not thread-safe); the future
        holds its result."""
        future: Future = Future()
        self._calls.append((fn, future))
        return future

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            try:
                future.set_result(fn())
            except Exception as exc:    # the caller decides; the engine goes on
                future.set_exception(exc)

    def run(self) -> None:
        held: list[Envelope] = []    # output of steps that ended while the lease was in doubt
        try:
            while not self.stop.is_set():
                if self._calls:
                    self._run_calls()
                if self.lease.epoch != self.core.epoch:
                    held = []        # the old incarnation's: its requests were failed
                    self._rejoin(self.lease.epoch)
                if not self.lease.held():
                    self.stop.wait(self.IDLE_POLL_MS / 1000)   # until renewed or rejoined
                    continue
                inbox = self._recv(0 if self.core.has_work() else self.IDLE_POLL_MS)
                held += self.core.run(inbox, self.receiver.read_at if inbox else None)
                if self.kv_receiver is not None:
                    self.kv_receiver.poll()
                    self.core.adopt_imports(held)
                if self.fail_message is not None:
                    self.core.fail_all(self.fail_message, held)
                    self.fail_message = None
                if self.handing_back and (self.core.requests or self.core.awaiting):
                    self.core.settle(held)             # a launched step's tokens go out first
                    status = self.core.hand_back()     # (and any dispatched here since: they move too)
                    held.append(Envelope(SCHEDULER, status))
                    self.handed_back += len(status.handed_back)
                # checked again after the step: a pause may have begun during it
                if self.lease.held() and self.lease.epoch == self.core.epoch:
                    self._send(held)
                    held = []
                    self.core.note_sent(time.perf_counter())
                    if self.handoff_sender is not None:   # first tokens are out: now move the KV
                        self._hand_off(held)
                    if self.kv_publisher is not None:
                        self.kv_publisher.flush()   # this step's cache changes; snapshots; heartbeats
                if self.core.last_step_s:
                    metrics.STEP_SECONDS.observe(self.core.last_step_s)
                    self.core.last_step_s = 0.0
        except BaseException as exc:  # surfaced by the loop thread, which exits nonzero
            self.error = exc
            log.exception("engine thread died")
        finally:
            self.senders.close()
            for endpoint in (self.handoff_sender, self.kv_receiver):
                if endpoint is not None:
                    endpoint.close()
            if self.kv_publisher is not None:
                self.kv_publisher.close()
            close = getattr(self.core.engine, "close", None)   # the null engine has none
            if close is not None:
                close()

    def _recv(self, timeout_ms: int) -> list[Any]:
        if self.poller is not None and timeout_ms:
            self.poller.poll(timeout_ms)
            timeout_ms = 0
        return self.receiver.recv_all(timeout_ms)

    def _hand_off(self, out: list[Envelope]) -> None:
        """Queue the hand-offs the last step made ready for the sender thread, tell it which were
        aborted, and free the blocks of those that ended; failures go out with the next step's
        output. Never waits for a decode worker."""
        sender = self.handoff_sender
        for rid, to, first, ids in self.core.take_stream_blocks():   # before their finish, per D
            if not sender.stream(rid, to, first, ids):
                self.core.stop_streaming(rid)
        todo, cancel = self.core.take_handoffs()
        for rid, to in cancel:
            sender.cancel(rid, to)
        for rid, to in todo:
            sender.submit(rid, to)
        for rid in self.core.take_stops():
            if sender.stop_sending(rid):          # had not begun: never will
                self.core.handoff_done(rid, False, "aborted", out)
        for result in sender.take_results():
            self.core.handoff_done(result.request_id, result.ok, result.reason, out)

    def _rejoin(self, epoch: int) -> None:
        old = self.core.epoch
        dropped = self.core.rejoin(epoch)
        if self.kv_publisher is not None:
            self.kv_publisher.begin_epoch(epoch)
        metrics.WORKER_REJOINS.inc()
        log.warning("worker %s: the lease of epoch %d lapsed; serving as epoch %d, dropped its %d requests",
                    self.core.worker_id, old, epoch, dropped)

    def _send(self, out: list[Envelope]) -> None:
        for env in out:
            if env.dest == SCHEDULER:
                for addr in self.scheduler_addrs:
                    self.senders.send(addr, env.msg)
            else:
                self.senders.send(env.dest, env.msg)


class WorkerService:
    def __init__(self, cfg: WorkerConfig, plane: Plane) -> None:
        self.cfg = cfg
        self.plane = plane
        self.worker_id = cfg.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.stopping = asyncio.Event()
        self.senders: SenderPool = SenderPool(plane)   # loop thread only (heartbeat status)
        self.scheduler_addrs: list[str] = []
        # kept through a Redis restart, so a step's finished reports still reach the schedulers
        self.schedulers = Membership(2 * cfg.heartbeat_ms / 1000, rejoin_s=cfg.lease_ms / 1000)
        self._spec_metrics = metrics.SpecDecodePublisher()

    async def run(self) -> int:
        cfg, loop = self.cfg, asyncio.get_running_loop()
        trust = self.plane.trust     # gRPC and Redis use the same trust material as ZeroMQ
        server, grpc_port = grpc_server(cfg.host, cfg.port, trust)
        health = await add_health(server, cfg.host, cfg.health_port)
        await server.start()
        metrics_port = metrics.serve_metrics(cfg.host, cfg.metrics_port, "worker")
        try:
            engine = await asyncio.to_thread(build_engine, cfg, shared_tier_key(cfg, self.plane))
        except (ValueError, FileNotFoundError) as exc:   # settings the model or this machine refuses
            log.error("cannot start the engine: %s", engine_error_text(str(exc)))   # names the flag
            log.debug("engine start-up", exc_info=True)
            await server.stop(0)
            await health.stop()
            return 2
        freeze = getattr(engine, "freeze_gc", None)      # the null engine has none
        if freeze is not None:
            freeze()        # this process serves with it until it exits: no full-heap GC pauses
        receiver: SyncReceiver = SyncReceiver(WorkerInbox, cfg.host, cfg.zmq_port, name="worker",
                                              plane=self.plane, senders=SENDERS)
        host = cfg.reachable_host()
        self.registry = Registry(cfg.redis_url, RedisAuth.of(trust))
        self.info = engine_info(cfg, engine)
        addrs = {"zmq": with_role(tcp_addr(host, receiver.port), "worker"), "grpc": f"{host}:{grpc_port}"}
        if metrics_port > 0:
            addrs["metrics"] = f"http://{host}:{metrics_port}/metrics"
        publisher = self._kv_publisher(engine)
        if publisher is not None:
            addrs["kv_events"], addrs["kv_snapshot"] = publisher.events_addr, publisher.snapshot_addr
        try:
            sender, kv_receiver = self._handoff_endpoints(engine)
        except ValueError as exc:          # an engine the KV transfer cannot serve (tensor parallel)
            log.error("cannot serve --role %s: %s", cfg.role, exc)
            receiver.close()
            await server.stop(0)
            await health.stop()
            return 2
        if kv_receiver is not None:
            addrs["kv"] = with_role(tcp_addr(host, kv_receiver.endpoint.port), "worker")
        self.lease = await self.registry.register("worker", self.worker_id, addrs=addrs, info=self.info,
                                                  lease_ms=cfg.lease_ms)
        if publisher is not None:
            publisher.set_epoch(self.lease.epoch)
        self.core = WorkerCore(engine, self.worker_id, self.lease.epoch, inbox_addr=addrs["zmq"])
        self.core.hands_off = sender is not None and cfg.role == "prefill"
        # with both ends of the KV transfer, a drain moves running requests to peers with their KV
        self.core.moves_kv = sender is not None and kv_receiver is not None and cfg.drain_kv_to_peers
        self.core.move_lease_s = cfg.handoff_lease_ms / 1000
        if self.core.moves_kv:     # each move priced against a recompute (gpu_worker/service/move_cost.py)
            self.core.move_costs = MoveCosts(sender.rates, engine.scheduler.prefill_rate, sender.block_bytes,
                                             sender.producer.layout.block_size)
        # NIXL reads the blocks in one READ once the prompt is done: nothing streams before it
        self.core.streams_kv = self.core.hands_off and self.cfg.kv_transport != "nixl"
        if kv_receiver is not None:
            self.core.imports = kv_receiver.imports
        await self._refresh_schedulers()
        self.engine = EngineThread(self.core, receiver, self.scheduler_addrs, self.lease, self.plane, publisher,
                                   sender, kv_receiver)
        self.engine.start()
        await set_serving(health, True)
        log.info("worker %s epoch %d ready: %s (%s), zmq %s", self.worker_id, self.lease.epoch,
                 self.info["model"], cfg.role, addrs["zmq"])
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        beat = asyncio.create_task(self._heartbeat_loop())
        stop = asyncio.create_task(self.stopping.wait())
        await asyncio.wait([stop, beat], return_when=asyncio.FIRST_COMPLETED)
        code = 1 if self.engine.error is not None or self.lease.fenced else 0
        if beat.done() and not beat.cancelled() and beat.exception() is not None:
            log.error("heartbeat loop died: %r", beat.exception())
            code = 1
        if code == 0:
            await self._drain()
        # the drain has its own timeout; the rest (engine join up to 5 s, freeing the device) must not hang
        arm_stop_deadline(STOP_DEADLINE_S)
        beat.cancel()
        self.engine.stop.set()
        await asyncio.to_thread(self.engine.join, 5)
        await set_serving(health, False)
        await self.lease.release()
        await self.registry.close()
        await server.stop(0.5)
        await health.stop()
        receiver.close()
        self.senders.close()
        return code

    def _kv_publisher(self, engine: Any) -> Any:
        """The KV-event publisher of a real engine (the prefix-cache index subscribes to it)."""
        if not self.cfg.kv_events or not hasattr(engine, "block_manager"):
            return None
        try:
            from gpu_worker.kv_events import KVEventPublisher
        except ImportError:
            return None
        return KVEventPublisher(engine.block_manager, self.worker_id, plane=self.plane, host=self.cfg.host,
                                advertise_host=self.cfg.reachable_host(), events_port=self.cfg.kv_events_port,
                                snapshot_port=self.cfg.kv_snapshot_port)

    def _handoff_endpoints(self, engine: Any) -> tuple[Any, Any]:
        """(PrefillSender, DecodeReceiver) of this worker's role; None where the role has none. A
        mixed worker has both (a drain moves its requests to peers with their KV, and it takes
        theirs); so does a decode worker (a decode pod that leaves hands its sequences to another).
        The null engine holds no KV: it serves every role as a mixed worker."""
        cfg = self.cfg
        if not hasattr(engine, "runner"):
            return None, None
        from gpu_worker.service.handoff import DecodeReceiver, PrefillSender
        lease_s = cfg.handoff_lease_ms / 1000
        if cfg.role == "mixed" and (cfg.kv_transport == "nixl" or engine.config.tensor_parallel_size > 1
                                    or not cfg.drain_kv_to_peers):
            return None, None      # peer moves go as frames, one cache per process: recomputed instead
        nixl = self._nixl_agent(engine) if cfg.kv_transport == "nixl" else None
        shm = cfg.kv_transport in ("auto", "shm", "cuda_ipc")      # the frames' path where D reads no cache
        from gpu_worker.kv_transfer.shm import DEFAULT_RING_BYTES
        if cfg.role == "prefill":
            return PrefillSender(engine, self.plane, lease_s, nixl_agent=nixl,
                                 shm_ring_bytes=DEFAULT_RING_BYTES if shm else 0,
                                 cache_source=self._cache_source(engine)), None
        receiver = DecodeReceiver(engine, self.plane, cfg.host, cfg.kv_transfer_port, lease_s, nixl_agent=nixl,
                                  shm=shm, cache_reads=cfg.kv_transport in ("auto", "cuda_ipc"))
        if nixl is not None:       # a drained decode worker's KV would need a NIXL source: recomputed
            return None, receiver
        # a drain's peer moves go as a hand-off does: a peer on this host reads this cache itself
        # under cuda_ipc; frames otherwise (through the shm ring on one host)
        return PrefillSender(engine, self.plane, lease_s, shm_ring_bytes=DEFAULT_RING_BYTES if shm else 0,
                             cache_source=self._cache_source(engine)), receiver

    def _cache_source(self, engine: Any) -> Any:
        """This engine's cache exported for workers on this host to read (kv_transfer/cuda_ipc.py):
        a decode worker after a prefill worker's hand-off, a peer after a drain's move. With
        cuda_ipc only: the CUDA path has not run on a GPU yet, so
        auto keeps to the frames (a decode worker under auto still reads a cuda_ipc prefill
        worker's cache). A CPU cache is moved into shared memory for it. None: frames only."""
        if self.cfg.kv_transport != "cuda_ipc":
            return None
        from gpu_worker.kv_transfer.cuda_ipc import export_cache
        from gpu_worker.kv_transfer.shm import host_identity
        if not host_identity():
            log.warning("--kv-transport %s: no host identity (boot id, /dev/shm) here; KV goes as frames",
                        self.cfg.kv_transport)
            return None
        try:
            return export_cache(engine)
        except (RuntimeError, ValueError, OSError) as exc:
            log.warning("--kv-transport %s: cannot share the KV cache (%s); KV goes as frames",
                        self.cfg.kv_transport, exc)
            return None

    def _nixl_agent(self, engine: Any) -> Any:
        """This engine's NIXL agent (its KV cache registered with NIXL's UCX backend)."""
        from gpu_worker.kv_transfer.nixl_transport import NixlKVAgent
        return NixlKVAgent(engine, f"{self.worker_id}-{uuid.uuid4().hex[:8]}")

    async def _drain(self) -> None:
        self.info["draining"] = True
        self.lease.record.info = self.info
        try:
            await self.lease.renew(self.core.load())
        except Exception:
            pass
        deadline = time.monotonic() + self.cfg.drain_grace_s
        while (self.core.requests or self.core.awaiting) and time.monotonic() < deadline and self.engine.is_alive():
            await asyncio.sleep(0.05)
        if (self.core.requests or self.core.awaiting) and self.engine.is_alive():
            await self._hand_back_or_fail()
        await self._drain_kv_to_disk()

    async def _hand_back_or_fail(self) -> None:
        """What the drain's grace did not finish goes back to the scheduler (which moves it), or,
        with no scheduler known, ends with an error."""
        # bounded: an engine thread holding its output for a lapsed lease never takes it up
        deadline = time.monotonic() + FAIL_ALL_TIMEOUT_S
        if self.scheduler_addrs:
            log.info("drain grace over; handing %d requests back to the scheduler", len(self.core.requests))
            self.engine.handing_back = True
            while self.engine.handed_back == 0 and self.engine.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            # KV held for peers goes out (or is freed) within the hand-off lease; the sends end then
            moves_end = time.monotonic() + 2 * self.cfg.handoff_lease_ms / 1000 + 1
            while self.core.has_moves() and self.engine.is_alive() and time.monotonic() < moves_end:
                await asyncio.sleep(0.01)
        else:                              # nobody to hand them to: their clients get an error
            log.warning("drain grace over and no scheduler known; failing %d requests", len(self.core.requests))
            self.engine.fail_message = "the worker shut down"
            while self.engine.fail_message is not None and self.engine.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        await asyncio.sleep(FLUSH_S)

    async def _drain_kv_to_disk(self) -> None:
        """The engine's cached KV (device and host tier, newest first) goes to the shared tier, or
        its disk tier, before the worker leaves (gpu_worker/kv_tiers/drain_to_disk.py), on the engine thread, bounded."""
        tiers = getattr(self.core.engine, "kv_tiers", None)
        if tiers is None or (tiers.disk is None and tiers.shared is None) or not self.engine.is_alive():
            return
        from gpu_worker.kv_tiers.drain_to_disk import drain_to_disk
        deadline = time.monotonic() + DRAIN_TO_DISK_S
        publisher = self.engine.kv_publisher

        def drain_and_announce() -> None:
            drain_to_disk(tiers, deadline)
            if publisher is not None:   # the shared tier's new blocks reach the index before the engine stops
                publisher.flush()

        future = self.engine.call_between_steps(drain_and_announce)
        try:   # past the deadline only the writes already queued (at most 64 blocks) are waited for
            await asyncio.wait_for(asyncio.wrap_future(future), DRAIN_TO_DISK_S + 5)
        except Exception as exc:  # a slow or failing disk costs the next worker a warm start, no more
            log.warning("draining the KV cache to disk failed: %r", exc)

    async def _refresh_schedulers(self) -> None:
        fresh = await self.registry.list("scheduler")
        records = self.schedulers.update(fresh, time.monotonic(), self.registry.incarnation)
        addrs = sorted(r.addrs["zmq"] for r in records if "zmq" in r.addrs)
        if addrs != self.scheduler_addrs:
            self.scheduler_addrs = addrs
            if hasattr(self, "engine"):
                self.engine.scheduler_addrs = addrs

    async def _heartbeat_loop(self) -> None:
        period = self.cfg.heartbeat_ms / 1000
        while True:
            await asyncio.sleep(period)
            if not self.engine.is_alive():
                self.stopping.set()
                return
            try:
                load = self.core.load()   # read while the engine thread runs: counters only
            except RuntimeError:          # a container changed size under us: next beat
                continue
            self._publish_metrics(load)
            self._publish_tier_metrics()
            try:
                if not await self.lease.renew(load):
                    self.stopping.set()  # fenced: a newer incarnation owns this id
                    return
                await self._refresh_schedulers()
            except Exception as exc:  # Redis hiccup: keep serving, retry next beat
                log.warning("heartbeat failed: %s", exc)
            try:
                status = self.core.status(with_active=True)
            except RuntimeError:          # the request table changed size while copied: next beat
                continue
            for addr in self.scheduler_addrs:
                self.senders.send(addr, status)

    def _publish_metrics(self, load: dict[str, int]) -> None:
        metrics.ENGINE_RUNNING.set(load["running"])
        metrics.ENGINE_WAITING.set(load["waiting"])
        metrics.KV_FREE_BLOCKS.set(load["free_blocks"])
        total = max(load["total_blocks"], 1)
        metrics.KV_USAGE.set(1 - (load["free_blocks"] + load["cached_blocks"]) / total)
        metrics.PENDING_PROMPT_TOKENS.set(load["pending_prompt_tokens"])
        metrics.PREFIX_QUERY_TOKENS.set(load["prefix_query_tokens"])
        metrics.PREFIX_HIT_TOKENS.set(load["prefix_hit_tokens"])

    def _publish_tier_metrics(self) -> None:
        """The KV tiers' gauges, for an engine that has tiers; the speculation counters, for an
        engine that speculates."""
        try:
            stats = self.core.engine.stats()
            tiers = stats.extra.get("kv_tiers")   # an engine with KV tiers
        except RuntimeError:      # read while the engine thread runs: a dict changed size, next beat
            return
        if tiers is not None:
            metrics.publish_kv_tiers(tiers)
        spec = stats.extra.get("spec_decode")
        if spec is not None:
            self._spec_metrics.publish(spec)


def main(argv: list[str]) -> int:
    cfg = load_or_exit(WorkerConfig, argv, "kvmesh worker")
    setup_logging("worker", cfg.log_level)
    if not cfg.model and not cfg.null_model:
        log.error("--model (or KVMESH_MODEL) is required")
        return 2
    if cfg.kv_transport == "nixl" and cfg.role != "mixed" and (missing := nixl_missing()):
        log.error("--kv-transport nixl needs the `nixl` package (pip install nixl, or the kvmesh[nixl] extra), "
                  "which this environment lacks (%s)", missing)
        return 2
    plane = plane_or_exit(cfg, "worker")
    return run_async(WorkerService(cfg, plane).run())


def nixl_missing() -> str:
    """Why the optional `nixl` package cannot be used here ('' when it can), checked before the
    model loads."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return ""
