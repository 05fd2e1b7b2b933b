"""A worker's side of the prefill/decode hand-off between processes (gpu_worker/kv_transfer/).

    prefill worker (P)   PrefillSender: after the step that drew a request's first token has been
                         sent to its detokenizer (TTFT never waits for the transfer), submit(rid,
                         to) queues the hand-off for the sender thread, which runs it over the
                         CURVE-wrapped ZMQ transport: Offer, frames, Done, the decode worker's
                         Ack; the engine thread then releases P's blocks (its full blocks stay in
                         its prefix cache). The hand-off's lease (--handoff-lease-ms)
                         is renewed by every frame the decode worker takes; lapsed, P frees the
                         blocks and tells D to drop the request.
    decode worker (D)    AwaitedImports: the engine consumer, refusing offers of requests the
                         scheduler did not announce (AwaitKV). An announcement holds no KV block
                         (blocks are reserved when the Offer is accepted) and may wait as long as
                         P's queue and prefill take; one whose Offer never comes (its cancel was
                         lost) is forgotten after AWAIT_OFFER_MAX_S. It reports which requests it
                         admitted (they decode here now) and which it dropped.

The engine is touched by the engine thread only: PrefillSender's thread reads the KV bytes of
blocks the engine holds for it and changes nothing; D's receiver runs on D's engine thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, NamedTuple

from gpu_worker.kv_transfer.connector import NO_FREE_BLOCKS, EngineKVConsumer, EngineKVProducer
from gpu_worker.kv_transfer.messages import Accept, Ack, Done, Fail, Offer, Refuse
from gpu_worker.kv_transfer.zmq_transport import KVReceiverEndpoint, KVSenderEndpoint
from services import metrics
from services.security.curve import Plane

log = logging.getLogger("kvmesh.worker")
MAX_PEERS = 256     # decode workers a prefill worker keeps a connection to (least recently used go)
# An announced request whose prefill worker neither offered nor cancelled it by then is forgotten:
# P died (the scheduler re-runs it here, which replaces the announcement) or its cancel was lost.
AWAIT_OFFER_MAX_S = 600.0


class HandoffResult(NamedTuple):
    request_id: str
    ok: bool          # the decode worker holds the request now
    reason: str       # why not (empty when ok)
    refused_for_room: bool = False   # D had no free KV blocks for it: P may decode it itself


class PrefillSender:
    """P's hand-offs, run one after the other on a thread of their own, each to the decode worker
    its Dispatch named, so that P's engine thread never waits for a decode worker (a silent one
    holds a hand-off up to the whole lease).

    Between the threads: submit()/cancel()/stop_sending() queue work from the engine thread;
    take_results() hands back what ended. The request's blocks stay held in the engine
    (`engine.exported`) from submit() until the engine thread reads the result and releases them
    (WorkerCore.handoff_done): the sender thread only reads the KV of blocks no one else frees or
    writes meanwhile (an exported request is out of the scheduler, so neither preemption nor a
    later step touches them, and its prompt's KV was complete when its first token was drawn),
    and never changes the engine. The peers' sockets belong to the sender thread alone."""

    def __init__(self, engine: Any, plane: Plane, lease_s: float) -> None:
        self.producer = EngineKVProducer(engine)
        self.plane, self.lease_s = plane, lease_s
        self._peers: dict[str, KVSenderEndpoint] = {}
        self._jobs: queue.SimpleQueue[tuple[str, str, str] | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[HandoffResult] = queue.SimpleQueue()
        # between the threads, under the lock: hand-offs submitted and not begun; those of them
        # aborted (the sender only tells D); running ones to end now (aborted on P)
        self._stopped_lock = threading.Lock()
        self._queued: set[str] = set()
        self._skipped: set[str] = set()
        self._stopped: set[str] = set()
        self._closing = False                 # close(): every running hand-off ends now
        self._thread = threading.Thread(target=self._run, name="kv-handoff", daemon=True)
        self._thread.start()

    # ---- engine thread -------------------------------------------------------------------
    def submit(self, request_id: str, to: str) -> None:
        """Hand request_id's KV to the decode worker at `to`; its result comes from take_results()."""
        with self._stopped_lock:
            self._queued.add(request_id)
        self._jobs.put(("send", request_id, to))

    def cancel(self, request_id: str, to: str) -> None:
        """The request needs no hand-off after all (every sample ended on P): D stops awaiting it."""
        self._jobs.put(("cancel", request_id, to))

    def stop_sending(self, request_id: str) -> bool:
        """End request_id's hand-off now (aborted on P); D is told to drop it. True when it had not
        begun: it never will, no result follows, and the caller frees the blocks now (a hand-off
        queued behind one that waits for a silent D must not wait too). False: it is running, its
        result (not ok) follows within WAIT_SLICE_S, then the engine thread frees the blocks."""
        with self._stopped_lock:
            if request_id in self._queued:
                self._queued.discard(request_id)
                self._skipped.add(request_id)
                return True
            self._stopped.add(request_id)
            return False

    def take_results(self) -> list[HandoffResult]:
        out: list[HandoffResult] = []
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return out
            with self._stopped_lock:        # a stop that came after its end
                self._stopped.discard(result.request_id)
            out.append(result)

    def close(self) -> None:
        self._jobs.put(None)
        with self._stopped_lock:
            self._closing = True
        self._thread.join(timeout=self.lease_s + 5)

    # ---- sender thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                kind, rid, to = job
                if kind == "send":
                    with self._stopped_lock:
                        skipped = rid in self._skipped
                        self._skipped.discard(rid)
                        self._queued.discard(rid)
                    kind = "cancel" if skipped else kind    # aborted before it began
                try:
                    if kind == "cancel":
                        self._peer(to).abort(rid)
                    else:
                        self._results.put(self._send(rid, to))
                except Exception as exc:   # a bug here must not strand the request's blocks
                    log.exception("kv hand-off of %s to %s failed", rid, to)
                    if kind == "send":
                        self._results.put(HandoffResult(rid, False, f"the hand-off failed: {exc}"))
                finally:
                    with self._stopped_lock:
                        self._stopped.discard(rid)
        finally:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()

    def _cancelled(self, request_id: str) -> bool:
        with self._stopped_lock:
            return self._closing or request_id in self._stopped

    def _peer(self, addr: str) -> KVSenderEndpoint:
        peer = self._peers.pop(addr, None)
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self._peers.pop(next(iter(self._peers))).close()
            peer = KVSenderEndpoint(self.producer, addr, plane=self.plane)
        self._peers[addr] = peer       # most recently used last
        return peer

    def _send(self, request_id: str, to: str) -> HandoffResult:
        t0 = time.perf_counter()
        peer = self._peer(to)
        answer = peer.send(request_id, timeout_s=self.lease_s, release=False,
                           cancelled=lambda: self._cancelled(request_id))
        metrics.HANDOFF_SECONDS.observe(time.perf_counter() - t0)
        metrics.HANDOFF_BYTES.inc(peer.bytes_sent)
        if isinstance(answer, Ack):
            metrics.HANDOFFS.labels("ack").inc()
            return HandoffResult(request_id, True, "")
        if self._cancelled(request_id):
            metrics.HANDOFFS.labels("abort").inc()
            log.info("kv hand-off of %s to %s ended: the request was aborted", request_id, to)
            return HandoffResult(request_id, False, "the request was aborted on the prefill worker")
        if answer is None:
            metrics.HANDOFFS.labels("timeout").inc()
            metrics.HANDOFF_EXPIRIES.inc()
            reason = "the decode worker did not answer within the hand-off lease"
        else:
            metrics.HANDOFFS.labels("refused" if isinstance(answer, Refuse) else "fail").inc()
            reason = f"the decode worker refused the KV: {answer.reason}"
        log.warning("kv hand-off of %s to %s failed: %s", request_id, to, reason)
        return HandoffResult(request_id, False, reason,
                             refused_for_room=isinstance(answer, Refuse) and answer.reason == NO_FREE_BLOCKS)


class AwaitedImports(EngineKVConsumer):
    """D's consumer: takes offers only for requests announced by the scheduler."""

    def __init__(self, engine: Any, lease_s: float) -> None:
        super().__init__(engine)
        self.lease_s = lease_s
        self._awaited: dict[str, float] = {}     # request id -> monotonic() when announced
        self._admitted: list[str] = []
        self._forgotten: list[str] = []

    def await_request(self, request_id: str) -> None:
        self._awaited[request_id] = time.monotonic()

    def accept(self, offer: Offer) -> Accept | Refuse:
        if offer.request_id not in self._awaited:
            return Refuse(offer.request_id, "this decode worker does not await the request")
        answer = super().accept(offer)
        if isinstance(answer, Refuse):
            log.warning("kv hand-off of %s refused: %s", offer.request_id, answer.reason)
            self._forget(offer.request_id)
        return answer

    def complete(self, done: Done) -> Ack | Fail:
        answer = super().complete(done)
        if isinstance(answer, Ack) and self._awaited.pop(done.request_id, None) is not None:
            self._admitted.append(done.request_id)
        elif not isinstance(answer, Ack):
            self._forget(done.request_id)
        return answer

    def abort(self, request_id: str) -> None:
        """P gave up, a frame was bad, or the request was aborted: free what D holds for it."""
        if request_id in self._awaited:
            super().abort(request_id)
            self._forget(request_id)

    def expire_awaited(self) -> None:
        """Announced requests whose offer never came (module docstring)."""
        now = time.monotonic()
        for rid in [r for r, t in self._awaited.items()
                    if now - t > AWAIT_OFFER_MAX_S and not self.engine.is_importing(r)]:
            log.info("kv hand-off of %s: no offer in %.0f s; forgetting it", rid, AWAIT_OFFER_MAX_S)
            self._forget(rid)

    def _forget(self, request_id: str) -> None:
        if self._awaited.pop(request_id, None) is not None:
            self._forgotten.append(request_id)

    def take_admitted(self) -> list[str]:
        out, self._admitted = self._admitted, []
        return out

    def take_dropped(self) -> list[str]:
        out, self._forgotten = self._forgotten, []
        return out


class DecodeReceiver:
    """D's bound KV-transfer socket (CURVE, worker role only) and its consumer."""

    def __init__(self, engine: Any, plane: Plane, host: str, port: int, lease_s: float) -> None:
        self.imports = AwaitedImports(engine, lease_s)
        self.endpoint = KVReceiverEndpoint(self.imports, host, port, idle_timeout_s=lease_s,
                                           plane=plane if plane.secure else None)

    def poll(self) -> int:
        handled = self.endpoint.poll(0)
        self.imports.expire_awaited()
        return handled

    def close(self) -> None:
        self.endpoint.close()
