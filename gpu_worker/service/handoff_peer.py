"""One decode worker's hand-offs on a prefill worker: a thread per decode worker (D), so a D that
stops answering holds only its own hand-offs, each up to the lease.

Jobs come from the engine thread (handoff.PrefillSender), in order per D:

    open(rid, offer)      a streamed Offer while P still prefills; D's Accept maps every block
    blocks(rid, snapshot) frames of blocks a prefill chunk completed (streaming.BlockSnapshot)
    finish(rid)           the first tokens are drawn: the blocks not sent yet (read in place from
                          the exported request), Done, D's Ack; a request never opened gets the
                          whole hand-off here (Offer with its first tokens, frames, Done)
    cancel(rid)           no hand-off after all (aborted, or every sample ended on P): D drops it

Exactly one result is reported per hand-off that began (ok, or why not); a streamed one that ends
before its finish (D refused, failed or went silent) reports then, and its finish is skipped.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from gpu_worker.kv_transfer.layout import KVLayoutMismatch, check_compatible
from gpu_worker.kv_transfer.messages import Accept, Ack, BlockFrame, Done, Offer, Refuse, encode
from gpu_worker.kv_transfer.shm import SegmentRing
from gpu_worker.kv_transfer.streaming import BlockSnapshot, SnapshotReader, snapshot_frames
from gpu_worker.kv_transfer.zmq_peer import Answer, KVPeerChannel
from services import metrics

if TYPE_CHECKING:
    from gpu_worker.service.handoff import PrefillSender

log = logging.getLogger("kvmesh.worker")


@dataclass
class _Stream:
    offer: Offer
    accept: Accept | None = None
    sent_upto: int = 0          # blocks [0, sent_upto) of the table are sent (or D's prefix hits)
    seq_no: int = 0             # frames sent
    bytes_sent: int = 0
    finishing: bool = False     # the finish job runs: its result is the hand-off's
    whole: bool = False         # opened by the finish job: nothing streamed before its clock began


class PeerSender(threading.Thread):
    def __init__(self, owner: "PrefillSender", address: str) -> None:
        super().__init__(name=f"kv-handoff-{address[-24:]}", daemon=True)
        self.owner, self.address = owner, address
        self.jobs: queue.SimpleQueue[tuple[str, str, Any] | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ended: set[str] = set()            # streamed, reported before their finish came
        self._reader = SnapshotReader()
        self._channel: KVPeerChannel | None = None
        self.ring: SegmentRing | None = None     # frames' payloads to a D on this host
        self._no_ring = False                    # making the ring failed: frames go inline

    # ---- the thread ----------------------------------------------------------------------
    def run(self) -> None:
        self._channel = KVPeerChannel(self.address, self.owner.plane if self.owner.plane.secure else None)
        try:
            while True:
                try:
                    job = self.jobs.get(timeout=self.owner.peer_idle_s)
                except queue.Empty:
                    if not self._streams and self.owner.reap(self):
                        return
                    continue
                if job is None:
                    return
                self._do(*job)
        finally:
            for rid in list(self._streams):
                self._channel.abort(rid)
            self._channel.close()
            if self.ring is not None:
                self.ring.close()

    def _do(self, kind: str, rid: str, arg: Any) -> None:
        try:
            if kind == "open":
                self._open(rid, arg, finishing=False)
            elif kind == "blocks":
                self._blocks(rid, arg)
            elif kind == "finish":
                self._finish(rid)
            else:
                self._cancel(rid)
        except Exception as exc:   # a bug here must not strand the request's blocks
            log.exception("kv hand-off of %s to %s failed", rid, self.address)
            if rid in self._streams:
                self._end(rid, None, reason=f"the hand-off failed: {exc}")
            elif kind == "finish" and rid not in self._ended:
                self.owner.report_failure(rid, f"the hand-off failed: {exc}")
        finally:
            if isinstance(arg, BlockSnapshot):
                self.owner.snapshot_done(arg)
            # every stop also queues a job for rid (its cancel, or its skipped finish) that ends
            # what this job left open
            self.owner.unstop(rid)

    def _cancelled(self, rid: str) -> bool:
        return self.owner.cancelled(rid)

    # ---- the jobs ------------------------------------------------------------------------
    def _open(self, rid: str, offer: Offer | None, *, finishing: bool) -> bool:
        """Offer, D's Accept (checked); False when the hand-off ended (reported). finishing: the
        whole hand-off runs now (not streamed)."""
        if offer is None:          # nothing to hand off (aborted meanwhile)
            self._report(rid, None, None)
            return False
        if not finishing and self._cancelled(rid):    # aborted before its stream began: nothing
            self._ended.add(rid)                      # to report; its finish or cancel follows
            return False
        channel = self._channel
        self._streams[rid] = stream = _Stream(offer, finishing=finishing, whole=finishing)
        channel.open(rid)
        deadline = time.monotonic() + self.owner.lease_s
        cancelled = lambda: self._cancelled(rid)                       # noqa: E731
        if self.owner.shm_ring_bytes:             # D answers whether it shares our host
            offer = msgspec.structs.replace(offer, shm_host=self.owner.shm_host)
        if self.owner.cache_source is not None:   # D answers whether it reads our cache itself
            offer = msgspec.structs.replace(offer, cache_source=self.owner.cache_source)
        parts = [encode(offer)]
        if self.owner.nixl_source is not None:    # D reads from our agent: it connects first (once)
            parts = [encode(self.owner.nixl_source)]
            offer = msgspec.structs.replace(offer, nixl_source=self.owner.nixl_name)
            sent = channel.send(parts, deadline, cancelled)
            parts = [encode(offer)] if sent else []
        answer = channel.answer(rid, deadline, cancelled) if parts and channel.send(parts, deadline, cancelled) else None
        if not isinstance(answer, Accept):
            return self._end(rid, answer)
        try:
            check_compatible(self.owner.producer.layout, answer.layout)
        except KVLayoutMismatch as e:          # D's layout differs: nothing was sent
            return self._end(rid, Refuse(rid, str(e)))
        if not 0 <= answer.first_block <= offer.num_blocks or len(answer.dst_block_ids) != offer.num_blocks - answer.first_block:
            return self._end(rid, Refuse(rid, "the decode worker's Accept does not match the offer"))
        stream.accept, stream.sent_upto = answer, answer.first_block
        if self.owner.cache_source is not None:
            self.owner.note_reader(self.address, answer.reads_cache)
        return True

    def _blocks(self, rid: str, snap: BlockSnapshot) -> None:
        stream = self._streams.get(rid)
        if stream is None or stream.accept is None:    # ended: D refused or went silent
            return
        if stream.accept.reads_cache:                  # D reads every block after the first token
            return
        kv = self._reader.host(snap)
        for frame, payload in snapshot_frames(stream.accept, self.owner.producer.layout, snap, kv,
                                              self.owner.frame_plan, stream.seq_no):
            if not self._send_frame(rid, stream, frame, payload):
                return
        metrics.HANDOFF_STREAMED_BLOCKS.inc(max(0, snap.block_end - max(stream.sent_upto, snap.block_start)))
        stream.sent_upto = max(stream.sent_upto, snap.block_end)

    def _finish(self, rid: str) -> None:
        if self.owner.take_skipped(rid):       # aborted before it began: D stops awaiting it
            self._cancel(rid)
            return
        if rid in self._ended:                 # its stream ended and was reported already
            self._ended.discard(rid)
            return
        t0 = time.perf_counter()
        producer = self.owner.producer
        stream = self._streams.get(rid)
        samples = []
        if stream is None:
            if not self._open(rid, producer.offer(rid), finishing=True):
                return
            stream = self._streams[rid]
        else:
            samples = producer.first_tokens(rid)
        stream.finishing = True
        deadline = time.monotonic() + self.owner.lease_s
        cancelled = lambda: self._cancelled(rid)                       # noqa: E731
        if self.owner.nixl_source is not None:    # D reads the blocks itself, then answers
            self._end(rid, self._channel.answer(rid, deadline, cancelled), started=t0)
            return
        if stream.accept.reads_cache:
            self._end(rid, self._read_by_d(rid, stream, samples, deadline), started=t0)
            return
        for frame, payload in producer.frames(stream.accept, stream.sent_upto, stream.seq_no):
            if not self._send_frame(rid, stream, frame, payload):
                return
        deadline = time.monotonic() + self.owner.lease_s
        done = Done(rid, stream.seq_no, samples, last_hidden=producer.last_hidden(rid))
        answer = self._channel.answer(rid, deadline, cancelled) if self._channel.send(
            [encode(done)], deadline, cancelled) else None
        self._end(rid, answer, started=t0)

    def _read_by_d(self, rid: str, stream: _Stream, samples: list, deadline: float) -> Answer | None:
        """Done naming our blocks D reads from our cache (held by the export until this returns).
        Once Done is out D may be copying them at any moment up to `deadline`: no cancel stops
        the wait for its answer (a few ms), or the blocks could be reused under its read."""
        table = self.owner.producer.block_table(rid)
        if table is None or len(table) != stream.offer.num_blocks:
            return None
        done = Done(rid, 0, samples, src_block_ids=table[stream.accept.first_block:], hold_until=deadline,
                    last_hidden=self.owner.producer.last_hidden(rid))
        cancelled = lambda: self._cancelled(rid)                       # noqa: E731
        if not self._channel.send([encode(done)], deadline, cancelled):
            return None
        stream.bytes_sent = (len(table) - stream.accept.first_block) * self.owner.block_bytes
        return self._channel.answer(rid, deadline, _never)

    def _cancel(self, rid: str) -> None:
        self._ended.discard(rid)
        self._streams.pop(rid, None)
        self._channel.close_request(rid)
        self._channel.abort(rid)

    # ---- helpers -------------------------------------------------------------------------
    def _send_frame(self, rid: str, stream: _Stream, frame: BlockFrame, payload: memoryview) -> bool:
        """One frame; the lease is renewed by every frame D takes. False: the hand-off ended."""
        cancelled = lambda: self._cancelled(rid)                       # noqa: E731
        parts = self._frame_parts(rid, stream, frame, payload)
        if cancelled() or not self._channel.send(parts, time.monotonic() + self.owner.lease_s, cancelled):
            return self._end(rid, None)
        stream.seq_no = frame.seq_no + 1
        stream.bytes_sent += len(payload)
        failed = self._channel.failed(rid)          # D gave up on it mid-stream?
        return True if failed is None else self._end(rid, failed)

    def _frame_parts(self, rid: str, stream: _Stream, frame: BlockFrame, payload: memoryview) -> list:
        """[header, payload], or [header naming the shared-memory ring that holds the payload]
        when D shares our host (its Accept said so) and the payload fits the ring now."""
        if self.owner.shm_ring_bytes and stream.accept is not None and stream.accept.shm and not self._no_ring:
            if self.ring is None:
                try:
                    self.ring = SegmentRing(self.owner.shm_ring_bytes)
                except OSError as e:             # /dev/shm too small or absent: frames inline
                    self._no_ring = True
                    log.warning("kv transfer: no shared-memory ring of %d MiB for %s (%s); sending KV over "
                                "the socket", self.owner.shm_ring_bytes >> 20, self.address, e)
                    return [encode(frame), payload]
            placed = self.ring.place(payload)
            if placed is not None:
                metrics.HANDOFF_SHM_FRAMES.inc()
                return [encode(msgspec.structs.replace(frame, segment=self.ring.name, segment_offset=placed.offset,
                                                       segment_end=placed.end))]
        return [encode(frame), payload]

    def _end(self, rid: str, answer: Answer | None, *, started: float | None = None, reason: str = "") -> bool:
        """The hand-off of rid ends with D's answer (None: no answer, cancelled, or our failure);
        D is told to drop it unless it acknowledged. Reports it; returns False."""
        stream = self._streams.pop(rid, None)
        self._channel.close_request(rid)
        if not isinstance(answer, Ack):
            self._channel.abort(rid)
        if stream is not None and not stream.finishing:
            self._ended.add(rid)
        if isinstance(answer, Ack) and stream is not None and stream.whole and started is not None:
            # a whole send, Offer to Ack: the rate a drain prices its next peer move with
            self.owner.rates.observe(self._path(stream), stream.bytes_sent, time.perf_counter() - started)
        self._report(rid, answer, stream, started, reason)
        return False

    def _path(self, stream: _Stream) -> str:
        """How the KV of an accepted stream went (move_cost.py's paths)."""
        if self.owner.nixl_source is not None:
            return "nixl"
        if stream.accept is not None and stream.accept.reads_cache:
            return "cache"
        if self.ring is not None and stream.accept is not None and stream.accept.shm:
            return "shm"
        return "frames"

    def _report(self, rid: str, answer: Any, stream: _Stream | None, started: float | None = None,
                reason: str = "") -> None:
        self.owner.report(rid, self.address, answer, stream.bytes_sent if stream else 0, started, reason)


def _never() -> bool:
    return False
