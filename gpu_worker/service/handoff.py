"""A worker's side of the prefill/decode hand-off between processes (gpu_worker/kv_transfer/).

    prefill worker (P)   PrefillSender: after the step that drew a request's first token has been
                         sent to its detokenizer (TTFT never waits for the transfer), send(rid, to)
                         runs the hand-off over the CURVE-wrapped ZMQ transport: Offer, frames,
                         Done, the decode worker's Ack; then P's blocks are released (its full
                         blocks stay in its prefix cache). The hand-off's lease (--handoff-lease-ms)
                         is renewed by every frame the decode worker takes; lapsed, P frees the
                         blocks and tells D to drop the request.
    decode worker (D)    AwaitedImports: the engine consumer, refusing offers of requests the
                         scheduler did not announce (AwaitKV). An announcement holds no KV block
                         (blocks are reserved when the Offer is accepted) and may wait as long as
                         P's queue and prefill take; one whose Offer never comes (its cancel was
                         lost) is forgotten after AWAIT_OFFER_MAX_S. It reports which requests it
                         admitted (they decode here now) and which it dropped.

Both run on the engine thread: the engine is touched by one thread only.
"""
from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

from gpu_worker.kv_transfer.connector import EngineKVConsumer, EngineKVProducer
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


class PrefillSender:
    """P's hand-offs, one after the other, each to the decode worker its Dispatch named."""

    def __init__(self, engine: Any, plane: Plane, lease_s: float) -> None:
        self.producer = EngineKVProducer(engine)
        self.plane, self.lease_s = plane, lease_s
        self._peers: dict[str, KVSenderEndpoint] = {}

    def _peer(self, addr: str) -> KVSenderEndpoint:
        peer = self._peers.pop(addr, None)
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self._peers.pop(next(iter(self._peers))).close()
            peer = KVSenderEndpoint(self.producer, addr, plane=self.plane)
        self._peers[addr] = peer       # most recently used last
        return peer

    def send(self, request_id: str, to: str) -> HandoffResult:
        t0 = time.perf_counter()
        peer = self._peer(to)
        answer = peer.send(request_id, timeout_s=self.lease_s)   # releases P's blocks in every case
        metrics.HANDOFF_SECONDS.observe(time.perf_counter() - t0)
        metrics.HANDOFF_BYTES.inc(peer.bytes_sent)
        if isinstance(answer, Ack):
            metrics.HANDOFFS.labels("ack").inc()
            return HandoffResult(request_id, True, "")
        if answer is None:
            metrics.HANDOFFS.labels("timeout").inc()
            metrics.HANDOFF_EXPIRIES.inc()
            reason = "the decode worker did not answer within the hand-off lease"
        else:
            metrics.HANDOFFS.labels("refused" if isinstance(answer, Refuse) else "fail").inc()
            reason = f"the decode worker refused the KV: {answer.reason}"
        log.warning("kv hand-off of %s to %s failed: %s", request_id, to, reason)
        return HandoffResult(request_id, False, reason)

    def cancel(self, request_id: str, to: str) -> None:
        """The request needs no hand-off after all (every sample ended on P): D stops awaiting it."""
        self._peer(to).abort(request_id)

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()


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
