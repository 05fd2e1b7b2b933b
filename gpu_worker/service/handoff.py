"""A worker's side of the prefill/decode hand-off between processes (gpu_worker/kv_transfer/).

    prefill worker (P)   PrefillSender: while a request's prompt takes several chunks, stream()
                         sends the blocks each chunk completed (a streamed Offer first); after the
                         step that drew its first token has been sent to its detokenizer (TTFT
                         never waits for the transfer), submit(rid, to) sends the rest, Done (with
                         the first tokens) and waits for the decode worker's Ack, all on the
                         thread of that decode worker (handoff_peer.PeerSender) over the
                         CURVE-wrapped ZMQ transport; the engine thread then releases P's blocks
                         (its full blocks stay in its prefix cache). The hand-off's lease
                         (--handoff-lease-ms) is renewed by every frame the decode worker takes;
                         lapsed, P frees the blocks and tells D to drop the request.
    decode worker (D)    AwaitedImports: the engine consumer, refusing offers of requests the
                         scheduler did not announce (AwaitKV). An announcement holds no KV block
                         (blocks are reserved when the Offer is accepted) and may wait as long as
                         P's queue and prefill take; one whose Offer never comes (its cancel was
                         lost) is forgotten after AWAIT_OFFER_MAX_S. It reports which requests it
                         admitted (they decode here now) and which it dropped.

The engine is touched by the engine thread only: the peer threads read the KV bytes of blocks the
engine holds for them, or of copies made for them, and change nothing; D's receiver runs on D's
engine thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, NamedTuple

from gpu_worker.kv_transfer.connector import EngineKVConsumer, EngineKVProducer
from gpu_worker.kv_transfer.messages import Accept, Ack, CacheSource, Done, Fail, NixlSource, Offer, Refuse
from gpu_worker.kv_transfer.nixl_transport import encode_peer
from gpu_worker.kv_transfer.shm import host_identity
from gpu_worker.kv_transfer.streaming import streamed_offer, take_snapshot
from gpu_worker.kv_transfer.zmq_transport import KVReceiverEndpoint
from gpu_worker.service.handoff_peer import PeerSender
from gpu_worker.service.move_cost import TransferRates
from services import metrics
from services.security.curve import Plane

log = logging.getLogger("kvmesh.worker")
PEER_IDLE_S = 60.0  # a decode worker's sender thread (and its connection) ends after this long idle
# KV copied for streaming (blocks a prefill chunk completed) waiting for the sender threads: past
# this, a request streams no more and the rest of its blocks go after its first token
MAX_SNAPSHOT_BYTES = 1 << 30
# An announced request whose prefill worker neither offered nor cancelled it by then is forgotten:
# P died (the scheduler re-runs it here, which replaces the announcement) or its cancel was lost.
AWAIT_OFFER_MAX_S = 600.0


class HandoffResult(NamedTuple):
    request_id: str
    ok: bool          # the decode worker holds the request now
    reason: str       # why not (empty when ok): P decodes it itself (WorkerCore.handoff_done)


class PrefillSender:
    """P's hand-offs, each run on the thread of the decode worker its Dispatch named
    (handoff_peer.PeerSender: made on first use, ended when idle for peer_idle_s), so that P's
    engine thread never waits for a decode worker, and a silent one holds only its own hand-offs
    (each up to the lease).

    Between the threads: stream()/submit()/cancel()/stop_sending() queue work from the engine
    thread; take_results() hands back what ended. A request's blocks stay held in the engine
    (`engine.exported`) from submit() until the engine thread reads the result and releases them
    (WorkerCore.handoff_done): the peer threads only read the KV of blocks no one else frees or
    writes meanwhile (an exported request is out of the scheduler, so neither preemption nor a
    later step touches them, and its prompt's KV was complete when its first token was drawn),
    and never change the engine. Blocks streamed earlier, while the request still prefilled, are
    private copies (kv_transfer/streaming.py), at most max_snapshot_bytes of them waiting at once."""

    def __init__(self, engine: Any, plane: Plane, lease_s: float,
                 max_snapshot_bytes: int = MAX_SNAPSHOT_BYTES, nixl_agent: Any = None,
                 shm_ring_bytes: int = 0, cache_source: CacheSource | None = None) -> None:
        """nixl_agent: a nixl_transport.NixlKVAgent of the engine: decode workers read the blocks
        from it (its metadata goes to each over the authenticated ZMQ socket) and no frame moves.
        shm_ring_bytes: frames to a decode worker on this host carry their payload in a shared-memory
        ring of this size per decode worker (kv_transfer/shm.py) when it agrees; 0, or other
        decode workers: inline.
        cache_source: this engine's exported cache (cuda_ipc.export_cache), offered to every
        decode worker: one on this host reads the blocks itself (no frames, and nothing streams to
        it once it did); others get frames."""
        self.shm_ring_bytes = shm_ring_bytes
        self.cache_source = cache_source
        self.shm_host = host_identity() if shm_ring_bytes else ""
        self.producer = EngineKVProducer(engine)
        self.nixl_agent = nixl_agent
        self.nixl_name = nixl_agent.name if nixl_agent is not None else ""
        self.nixl_source = None if nixl_agent is None else NixlSource(encode_peer(nixl_agent.peer()))
        self.engine, self.plane, self.lease_s = engine, plane, lease_s
        itemsize = engine.runner.kv_caches[0][0].element_size()
        self.frame_plan = self.producer.frame_plan(itemsize)
        layout = self.producer.layout         # K and V of one block, all layers
        self.block_bytes = 2 * layout.layers * layout.block_size * layout.num_kv_heads * layout.head_dim * itemsize
        self.max_snapshot_bytes = max_snapshot_bytes
        self.peer_idle_s = PEER_IDLE_S
        # measured by the peer threads; a drain prices its moves with them (move_cost.py)
        self.rates = TransferRates("nixl" if nixl_agent is not None else "cache" if cache_source is not None
                                   else "shm" if shm_ring_bytes else "frames")
        self._results: queue.SimpleQueue[HandoffResult] = queue.SimpleQueue()
        self._streaming: dict[str, str] = {}    # engine thread: request -> D, streamed, not yet submitted
        # between the threads, under the lock: the peer threads; hand-offs submitted and not begun;
        # those of them aborted (the peer only tells D); running ones to end now (aborted on P);
        # the bytes of snapshots not yet sent
        self._lock = threading.Lock()
        self._peers: dict[str, PeerSender] = {}
        self._queued: set[str] = set()
        self._skipped: set[str] = set()
        self._stopped: set[str] = set()
        self._snapshot_bytes = 0
        self._readers: set[str] = set()       # decode workers whose last Accept read our cache
        self._closing = False                 # close(): every running hand-off ends now

    # ---- engine thread -------------------------------------------------------------------
    def stream(self, request_id: str, to: str, block_start: int, block_ids: list[int]) -> bool:
        """Send blocks [block_start, block_start + len(block_ids)) of a request still prefilling
        (right after the step that computed them). False when they are not sent (too many
        snapshot bytes wait already, or that D reads our cache): then stream nothing more of it;
        the rest goes with submit()."""
        layout, per_block = self.producer.layout, self.block_bytes
        with self._lock:          # a D that reads our cache reads it all at once, after the first token
            if to in self._readers or self._snapshot_bytes + per_block * len(block_ids) > self.max_snapshot_bytes:
                return False
        if request_id not in self._streaming:
            offer = streamed_offer(self.engine, layout, request_id)
            if offer is None:
                return False
            self._streaming[request_id] = to
            self._put(to, ("open", request_id, offer))
        snap = take_snapshot(self.engine, block_start, block_ids)
        with self._lock:
            self._snapshot_bytes += snap.nbytes
        self._put(to, ("blocks", request_id, snap))
        return True

    def submit(self, request_id: str, to: str) -> None:
        """Hand request_id's KV to the decode worker at `to`; its result comes from take_results()."""
        self._streaming.pop(request_id, None)
        with self._lock:
            self._queued.add(request_id)
        self._put(to, ("finish", request_id, None))

    def cancel(self, request_id: str, to: str) -> None:
        """The request needs no hand-off after all (every sample ended on P, or it was aborted
        while it prefilled): D stops awaiting it, or drops what was streamed."""
        if self._streaming.pop(request_id, None) is not None:
            with self._lock:                  # a peer thread waiting on its D for it stops now
                self._stopped.add(request_id)
        self._put(to, ("cancel", request_id, None))

    def stop_sending(self, request_id: str) -> bool:
        """End request_id's hand-off now (aborted on P); D is told to drop it. True when it had not
        begun: it never will, no result follows, and the caller frees the blocks now (a hand-off
        queued behind one that waits for a silent D must not wait too). False: it is running, its
        result (not ok) follows within WAIT_SLICE_S, then the engine thread frees the blocks."""
        with self._lock:
            self._stopped.add(request_id)     # its stream, if one waits for D, ends too
            if request_id in self._queued:
                self._queued.discard(request_id)
                self._skipped.add(request_id)
                return True
            return False

    def take_results(self) -> list[HandoffResult]:
        out: list[HandoffResult] = []
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return out
            with self._lock:        # a stop that came after its end
                self._stopped.discard(result.request_id)
            self._streaming.pop(result.request_id, None)   # its stream, if any, ended with it
            out.append(result)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.jobs.put(None)
        for peer in peers:
            peer.join(timeout=self.lease_s + 5)
        if self.nixl_agent is not None:
            self.nixl_agent.close()

    def _put(self, to: str, job: tuple[str, str, Any]) -> None:
        with self._lock:                      # under the lock: an idle peer ending now is not given it
            peer = self._peers.get(to)
            if peer is None:
                peer = self._peers[to] = PeerSender(self, to)
                peer.start()
            peer.jobs.put(job)

    # ---- peer threads --------------------------------------------------------------------
    def reap(self, peer: PeerSender) -> bool:
        """An idle peer thread ends unless a job came for it meanwhile."""
        with self._lock:
            if not peer.jobs.empty():
                return False
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
            return True

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def cancelled(self, request_id: str) -> bool:
        with self._lock:
            return self._closing or request_id in self._stopped

    def note_reader(self, to: str, reads_cache: bool) -> None:
        """The decode worker at `to` answered an Offer: does it read our cache?"""
        with self._lock:
            (self._readers.add if reads_cache else self._readers.discard)(to)

    def unstop(self, request_id: str) -> None:
        with self._lock:
            self._stopped.discard(request_id)

    def take_skipped(self, request_id: str) -> bool:
        """The finish job of request_id begins: True if it was aborted while queued."""
        with self._lock:
            self._queued.discard(request_id)
            if request_id in self._skipped:
                self._skipped.discard(request_id)
                return True
            return False

    def snapshot_done(self, snap: Any) -> None:
        with self._lock:
            self._snapshot_bytes -= snap.nbytes

    def report_failure(self, request_id: str, reason: str) -> None:
        self._results.put(HandoffResult(request_id, False, reason))

    def report(self, request_id: str, to: str, answer: Any, bytes_sent: int, started: float | None,
               reason: str = "") -> None:
        """The end of a hand-off (or of its streaming before the first token), for the engine thread."""
        metrics.HANDOFF_BYTES.inc(bytes_sent)
        if started is not None:
            metrics.HANDOFF_SECONDS.observe(time.perf_counter() - started)
        if isinstance(answer, Ack):
            metrics.HANDOFFS.labels("ack").inc()
            self._results.put(HandoffResult(request_id, True, ""))
            return
        if self.cancelled(request_id):
            metrics.HANDOFFS.labels("abort").inc()
            log.info("kv hand-off of %s to %s ended: the request was aborted", request_id, to)
            self._results.put(HandoffResult(request_id, False, "the request was aborted on the prefill worker"))
            return
        if reason:
            metrics.HANDOFFS.labels("fail").inc()
        elif answer is None:
            metrics.HANDOFFS.labels("timeout").inc()
            metrics.HANDOFF_EXPIRIES.inc()
            reason = "the decode worker did not answer within the hand-off lease"
        else:
            metrics.HANDOFFS.labels("refused" if isinstance(answer, Refuse) else "fail").inc()
            reason = f"the decode worker refused the KV: {answer.reason}"
        log.warning("kv hand-off of %s to %s failed: %s", request_id, to, reason)
        self._results.put(HandoffResult(request_id, False, reason))


class AwaitedImports(EngineKVConsumer):
    """D's consumer: takes offers only for requests announced by the scheduler."""

    def __init__(self, engine: Any, lease_s: float) -> None:
        super().__init__(engine)
        self.lease_s = lease_s
        self._awaited: dict[str, float] = {}     # request id -> monotonic() past which it is forgotten
        self._expected: dict[str, tuple[list[int], dict[int, list[int]]]] = {}   # a peer move's prompt, samples' tokens
        self._admitted: list[str] = []
        self._forgotten: list[str] = []

    def await_request(self, request_id: str, max_wait_s: float = AWAIT_OFFER_MAX_S,
                      expect: tuple[list[int], dict[int, list[int]]] | None = None) -> None:
        """expect: a peer move's (prompt, sample index -> the tokens its client has, for each
        sample not ended); an Offer of other tokens is refused (its KV would be of another stream)."""
        self._awaited[request_id] = time.monotonic() + max_wait_s
        if expect is not None:
            self._expected[request_id] = expect

    def accept(self, offer: Offer) -> Accept | Refuse:
        if offer.request_id not in self._awaited:
            return Refuse(offer.request_id, "this decode worker does not await the request")
        if (expect := self._expected.get(offer.request_id)) is not None and not _offers(offer, *expect):
            log.warning("kv hand-off of %s refused: the offered tokens are not the moved stream's", offer.request_id)
            self._forget(offer.request_id)
            return Refuse(offer.request_id, "the offered tokens are not the moved stream's")
        answer = super().accept(offer)
        if isinstance(answer, Refuse):
            log.warning("kv hand-off of %s refused: %s", offer.request_id, answer.reason)
            self._forget(offer.request_id)
        return answer

    def complete(self, done: Done) -> Ack | Fail:
        answer = super().complete(done)
        if isinstance(answer, Ack) and self._awaited.pop(done.request_id, None) is not None:
            self._expected.pop(done.request_id, None)
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
        for rid in [r for r, t in self._awaited.items() if now > t and not self.engine.is_importing(r)]:
            log.info("kv hand-off of %s: no offer in time; forgetting it", rid)
            self._forget(rid)

    def _forget(self, request_id: str) -> None:
        self._expected.pop(request_id, None)
        if self._awaited.pop(request_id, None) is not None:
            self._forgotten.append(request_id)

    def take_admitted(self) -> list[str]:
        out, self._admitted = self._admitted, []
        return out

    def take_dropped(self) -> list[str]:
        out, self._forgotten = self._forgotten, []
        return out


def _offers(offer: Offer, prompt: list[int], outputs: dict[int, list[int]]) -> bool:
    """Does a peer move's Offer carry exactly the moved stream: its prompt, and each sample still
    going at its output so far (one sample: prompt_token_ids ends with its output but the last
    token; n > 1: `moved` has each one's)?"""
    num_prompt = len(offer.prompt_token_ids) - offer.num_output_tokens
    if offer.prompt_token_ids[:num_prompt] != prompt:
        return False
    if offer.moved:
        computed = {m.index: m.token_ids for m in offer.moved}
    elif len(offer.samples) == 1:
        computed = {offer.samples[0].index: offer.prompt_token_ids[num_prompt:]}
    else:
        return False
    if len(computed) != len(offer.moved or offer.samples) or sorted(computed) != sorted(s.index for s in offer.samples):
        return False
    return {s.index: [*computed[s.index], s.token_id] for s in offer.samples} == outputs


class DecodeReceiver:
    """D's bound KV-transfer socket (CURVE, worker role only) and its consumer; with a NIXL agent
    (nixl_transport.NixlKVAgent of the engine) D reads the blocks of each accepted offer from the
    prefill worker's agent itself."""

    def __init__(self, engine: Any, plane: Plane, host: str, port: int, lease_s: float,
                 nixl_agent: Any = None, *, shm: bool = False, cache_reads: bool = False) -> None:
        """shm: a prefill worker on this host may put frames' payloads in shared memory.
        cache_reads: this worker reads the blocks of a prefill worker on this host out of its
        cache (kv_transfer/cuda_ipc.py) when it offers its cache."""
        self.imports = AwaitedImports(engine, lease_s)
        self.endpoint = KVReceiverEndpoint(self.imports, host, port, idle_timeout_s=lease_s,
                                           plane=plane if plane.secure else None)
        self.endpoint.shm_host = host_identity() if shm else ""
        if cache_reads:
            from gpu_worker.kv_transfer.cuda_ipc import CacheReader
            self.endpoint.cache_reader = CacheReader(self.imports)
        self.nixl_agent = nixl_agent
        if nixl_agent is not None:
            from gpu_worker.kv_transfer.nixl_transport import NixlKVReader
            self.endpoint.nixl_reader = NixlKVReader(self.imports, nixl_agent)

    def poll(self) -> int:
        handled = self.endpoint.poll(0)
        self.imports.expire_awaited()
        return handled

    def close(self) -> None:
        self.endpoint.close()
        if self.endpoint.cache_reader is not None:
            self.endpoint.cache_reader.close()
        if self.nixl_agent is not None:
            self.nixl_agent.close()
