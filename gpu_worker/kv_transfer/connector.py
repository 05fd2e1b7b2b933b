"""The connector interface of a KV hand-off and its engine-backed implementation.

A transport (zmq_transport.py; NIXL or Mooncake would be another) only carries the messages of
messages.py between a KVProducer on the prefill engine (P) and a KVConsumer on the decode
engine (D). Everything that decides which bytes move and where they land is here:

    P  engine.add_request(..., export_kv=True); step until its samples finish with HANDOFF
    P  producer.offer(rid)              -> Offer (layout, prompt, first tokens, block hashes)
    D  consumer.accept(offer)           -> Accept (D's block ids for the blocks D lacks) | Refuse
    P  producer.frames(accept)          -> BlockFrame + payload, block group by block group
    D  consumer.receive(frame, payload) -> None | Fail (the request is dropped, blocks freed)
    P  producer.done(rid)               -> Done
    D  consumer.complete(done)          -> Ack (D decodes the request from now on) | Fail
    P  producer.release(rid)            after Ack or Fail: P's blocks are freed (its full
                                        blocks stay in P's prefix cache)

Blocks are named by chained content hashes (services/prefix_hash.py): D reuses the prefix it
already caches and only the blocks after it move; the blocks D receives join its prefix cache.
A transport that reads P's memory directly (NIXL's RDMA/CUDA-IPC READ) uses the same Offer and
Accept: the block ids of both sides are exactly the descriptors it needs, and frames() is then
replaced by one read per block group into D's registered KV tensors.
"""
from __future__ import annotations

import abc
import logging
import warnings
from collections.abc import Iterator
import time
from dataclasses import dataclass, field

import torch

from gpu_worker.kv_transfer import group
from gpu_worker.kv_transfer.layout import (KVLayout, KVLayoutMismatch, check_compatible, handoff_caches,
                                           handoff_layout)
from gpu_worker.kv_transfer.messages import (Accept, Ack, BlockFrame, Done, Fail, LastHidden, MovedOutput, Offer,
                                             Refuse, SampleStart, checksum)
from gpu_worker.kv_transfer.rate_limit import RateLimitedLog
from gpu_worker.outputs import RequestError
from gpu_worker.sequence import HANDOFF
from services.prefix_hash import chain_hashes

log = logging.getLogger("kvmesh.kv_transfer")

DEFAULT_MAX_FRAME_BYTES = 64 << 20     # the largest frame a consumer takes
# The frames a producer makes. CURVE encrypts each ZMQ message in one piece on the sender's I/O
# thread and decrypts it in one piece on the receiver's: frames of a few MiB keep both threads
# busy at once (measured on loopback: 4 MiB frames move 128 MiB ~2x faster than 64 MiB ones).
DEFAULT_FRAME_BYTES = 4 << 20
NO_FREE_BLOCKS = "no free KV blocks"     # the Refuse of a consumer whose pool is full now


class KVProducer(abc.ABC):
    """P's side: describes an exported request and streams the blocks the consumer lacks."""

    @abc.abstractmethod
    def offer(self, request_id: str) -> Offer | None: ...

    @abc.abstractmethod
    def frames(self, accept: Accept, start_block: int = 0, seq_no: int = 0) -> Iterator[tuple[BlockFrame, memoryview]]: ...

    @abc.abstractmethod
    def done(self, request_id: str) -> Done: ...

    @abc.abstractmethod
    def release(self, request_id: str) -> bool: ...


class KVConsumer(abc.ABC):
    """D's side: reserves blocks, writes what arrives, admits the request when all is there."""

    @abc.abstractmethod
    def accept(self, offer: Offer) -> Accept | Refuse: ...

    @abc.abstractmethod
    def receive(self, frame: BlockFrame, payload: bytes | memoryview) -> Fail | None: ...

    @abc.abstractmethod
    def written_directly(self, request_id: str) -> bool:
        """A transport that wrote the missing blocks itself (NIXL's READ) says so here, in place of
        frames; complete(Done(request_id, 0)) then admits the request. False if unknown."""

    @abc.abstractmethod
    def complete(self, done: Done) -> Ack | Fail: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...


def _engine_layout(engine) -> KVLayout:
    if engine.config.tensor_parallel_size > 1:   # each rank's cache lives in its own process
        raise ValueError("KV transfer does not support tensor_parallel_size > 1 yet")
    return handoff_layout(engine)


def _frame_plan(layout: KVLayout, itemsize: int, max_frame_bytes: int) -> tuple[int, int]:
    """(layers, blocks) per frame: all layers of as many blocks as fit, else fewer layers."""
    per_layer_block = 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * itemsize
    layers = min(layout.layers, max(1, max_frame_bytes // per_layer_block))
    return layers, max(1, max_frame_bytes // (layers * per_layer_block))


def block_frames(accept: Accept, layout: KVLayout, src_table: list[int], b_start: int, b_end: int,
                 gather, plan: tuple[int, int], seq_no: int) -> Iterator[tuple[BlockFrame, memoryview]]:
    """Frames of the table's blocks [b_start, b_end) as `accept` maps them to D's ids, numbered
    from seq_no; gather(b0, b1, l0, l1) gives the KV of blocks [b0, b1) and layers [l0, l1) as a
    (layers, 2, blocks, block_size, kv heads, head dim) tensor, or None to stop (aborted).

        table    | D's prefix hits | ... sent earlier ... | b_start ........ b_end |
                 0            first_block                           one frame: <= plan[1] blocks
    """
    layers_per, blocks_per = plan
    for b0 in range(b_start, b_end, blocks_per):
        b1 = min(b0 + blocks_per, b_end)
        dst = accept.dst_block_ids[b0 - accept.first_block:b1 - accept.first_block]
        for l0 in range(0, layout.layers, layers_per):
            l1 = min(l0 + layers_per, layout.layers)
            kv = gather(b0, b1, l0, l1)
            if kv is None:
                return
            payload = memoryview(kv.contiguous().view(torch.uint8).cpu().numpy()).cast("B")
            yield BlockFrame(request_id=accept.request_id, seq_no=seq_no, layer_start=l0, layer_end=l1,
                             block_start=b0, src_block_ids=src_table[b0:b1], dst_block_ids=dst,
                             dtype=layout.kv_dtype, shape=list(kv.shape), checksum=checksum(payload)), payload
            seq_no += 1


class EngineKVProducer(KVProducer):
    def __init__(self, engine, max_frame_bytes: int = DEFAULT_FRAME_BYTES) -> None:
        self.engine = engine
        self.layout = _engine_layout(engine)
        self.max_frame_bytes = max_frame_bytes
        self._sent: dict[str, int] = {}       # frames sent per request
        self.blocks_sent = 0                  # totals, for tests and measurements
        self.bytes_sent = 0

    def _handoff_seqs(self, request_id: str):
        request = self.engine.exported.get(request_id)
        return [] if request is None else [s for s in request.seqs if s.finish_reason == HANDOFF]

    def block_table(self, request_id: str) -> list[int] | None:
        """P's blocks of an exported request in transfer order (None unless it hands off
        samples): one table, or a moved group's (kv_transfer/group.py)."""
        seqs = self._handoff_seqs(request_id)
        if not seqs:
            return None
        if self._is_group(seqs):
            return group.flat_table(seqs, group.num_shared_blocks(seqs, self.layout.block_size))
        return list(seqs[0].block_table)

    @staticmethod
    def _is_group(seqs) -> bool:
        """A moved n > 1 request (hold_for_move): its samples wrote past the prompt, each its own
        blocks. A prefill's samples all hold the prompt's table only."""
        return seqs[0].request.n > 1 and not seqs[0].request.export_kv

    def first_tokens(self, request_id: str) -> list[SampleStart]:
        """The first token of each sample an exported request hands off ([] if none)."""
        return [SampleStart(s.index, s.token_ids[-1], s.cumulative_logprob) for s in self._handoff_seqs(request_id)]

    def last_hidden(self, request_id: str) -> LastHidden | None:
        """Method mtp: the target's hidden state at the last prompt position of an exported
        request, which D's MTP layer drafts from at once (None without mtp, or if unknown)."""
        request = self.engine.exported.get(request_id)
        hidden = None if request is None else request.handoff_hidden       # (H,)
        if hidden is None:
            return None
        data = hidden.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
        return LastHidden(str(hidden.dtype).removeprefix("torch."), data)

    def offer(self, request_id: str) -> Offer | None:
        """None unless the request finished its prefill here with samples to hand off."""
        seqs = self._handoff_seqs(request_id)
        if not seqs:
            return None
        seq, request, bs = seqs[0], seqs[0].request, self.layout.block_size
        if self._is_group(seqs):
            return self._group_offer(request_id, seqs)
        assert all(s.block_table == seq.block_table for s in seqs), "samples wrote past the prompt"
        # the tokens whose KV the blocks hold: a prefill's prompt, or a moved request's prompt and
        # output but its last token (hold_for_move), which is then the sample's "first" token
        tokens = seq.token_ids[:-1]
        hashes = chain_hashes(None, self.layout.model_id, request.cache_salt, tokens, bs)
        return Offer(request_id=request_id, layout=self.layout, prompt_token_ids=tokens,
                     num_output_tokens=len(tokens) - seq.num_prompt_tokens,
                     params=request.params, seed=request.seed, priority=request.priority,
                     cache_salt=request.cache_salt, num_cached_tokens=request.num_cached_tokens,
                     samples=self.first_tokens(request_id), last_hidden=self.last_hidden(request_id),
                     block_hashes=hashes, num_blocks=len(seq.block_table), src_block_ids=list(seq.block_table))

    def _group_offer(self, request_id: str, seqs) -> Offer:
        """The Offer of a moved n > 1 request: the prompt, each held sample's output (its last
        token as its "first"), and the group's transfer table."""
        request, bs = seqs[0].request, self.layout.block_size
        shared = group.num_shared_blocks(seqs, bs)
        table = group.flat_table(seqs, shared)
        prompt = request.prompt_token_ids
        return Offer(request_id=request_id, layout=self.layout, prompt_token_ids=list(prompt),
                     params=request.params, seed=request.seed, priority=request.priority,
                     cache_salt=request.cache_salt, num_cached_tokens=request.num_cached_tokens,
                     samples=self.first_tokens(request_id),
                     moved=[MovedOutput(s.index, s.output_token_ids[:-1]) for s in seqs],
                     block_hashes=chain_hashes(None, self.layout.model_id, request.cache_salt, prompt, bs),
                     num_blocks=len(table), src_block_ids=table, num_shared_blocks=shared)

    def frames(self, accept: Accept, start_block: int = 0, seq_no: int = 0) -> Iterator[tuple[BlockFrame, memoryview]]:
        """The frames of the blocks from max(start_block, accept.first_block) on, read in place from
        the held blocks of an exported request, numbered from seq_no. Raises KVLayoutMismatch
        before any frame when D's layout differs."""
        check_compatible(self.layout, accept.layout)
        table = self.block_table(accept.request_id)
        if not table:
            return
        if not 0 <= accept.first_block <= len(table) or len(accept.dst_block_ids) != len(table) - accept.first_block:
            raise ValueError(f"Accept for {accept.request_id!r} does not match its block table")
        caches = handoff_caches(self.engine)
        device = caches[0][0].device

        def gather(b0: int, b1: int, l0: int, l1: int) -> torch.Tensor | None:
            if accept.request_id not in self.engine.exported:   # aborted on P meanwhile: its
                return None                                     # blocks may hold others' KV now
            index = torch.tensor(table[b0:b1], device=device)
            # one copy, straight into the frame's tensor (stacking the selections copies twice more)
            kv = torch.empty((l1 - l0, 2, b1 - b0, *caches[0][0].shape[1:]), dtype=caches[0][0].dtype,
                             device=device)          # (layers, 2, blocks, bs, kv heads, head dim)
            for i, (k, v) in enumerate(caches[l0:l1]):
                torch.index_select(k, 0, index, out=kv[i, 0])
                torch.index_select(v, 0, index, out=kv[i, 1])
            return kv

        frames = block_frames(accept, self.layout, table, max(start_block, accept.first_block), len(table),
                              gather, self.frame_plan(caches[0][0].element_size()), seq_no)
        for frame, payload in frames:
            self.bytes_sent += len(payload)
            seq_no = frame.seq_no + 1
            yield frame, payload
        self.blocks_sent += len(table) - max(start_block, accept.first_block)
        self._sent[accept.request_id] = seq_no

    def frame_plan(self, itemsize: int) -> tuple[int, int]:
        """(layers, blocks) per frame for a cache of this item size."""
        return _frame_plan(self.layout, itemsize, self.max_frame_bytes)

    def done(self, request_id: str) -> Done:
        return Done(request_id, self._sent.pop(request_id, 0), last_hidden=self.last_hidden(request_id))

    def release(self, request_id: str) -> bool:
        """Free P's blocks of the request (after D's Ack or Fail, or an abort on P)."""
        self._sent.pop(request_id, None)
        return self.engine.release_export(request_id)


@dataclass
class _Receiving:
    table: list[int]            # D's block table of the request
    first_block: int            # blocks before it were prefix hits on D
    covered: torch.Tensor       # (layers, blocks) bool: which layer of which block arrived
    streamed: bool = False      # the Offer came while P prefilled: Done carries the first tokens
    last_hidden: LastHidden | None = None     # the Offer's (mtp; else Done's)
    seen: set[int] = field(default_factory=set)      # frames' seq_no (any order, no repeats)
    last_progress: float = field(default_factory=time.monotonic)


class EngineKVConsumer(KVConsumer):
    def __init__(self, engine, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.engine = engine
        self.layout = _engine_layout(engine)
        self.max_frame_bytes = max_frame_bytes
        self._dtype = engine.runner.kv_caches[0][0].dtype
        self._rx: dict[str, _Receiving] = {}
        self._dropped = RateLimitedLog(log)
        self.blocks_received = 0
        self.frames_dropped = 0

    def accept(self, offer: Offer) -> Accept | Refuse:
        try:
            check_compatible(self.layout, offer.layout)
        except KVLayoutMismatch as e:
            return Refuse(offer.request_id, str(e))
        bs = self.layout.block_size
        n = len(offer.prompt_token_ids)
        blocks = -(-n // bs)
        if offer.moved:         # a moved group: its transfer table (kv_transfer/group.py)
            blocks = offer.num_shared_blocks + sum(
                group.own_blocks(n + len(m.token_ids), offer.num_shared_blocks, bs) for m in offer.moved)
        try:
            hashes = chain_hashes(None, self.layout.model_id, offer.cache_salt, offer.prompt_token_ids, bs)
        except ValueError:      # ids no vocabulary has: import_prefilled would refuse them too
            return Refuse(offer.request_id, "invalid prompt_token_ids: token ids outside [0, 2**32)")
        if offer.num_blocks != blocks or offer.block_hashes != hashes:
            return Refuse(offer.request_id, "the offer's blocks do not match its prompt")
        try:
            reserved = self._reserve(offer)
        except RequestError as e:
            return Refuse(offer.request_id, str(e))
        if reserved is None:
            return Refuse(offer.request_id, NO_FREE_BLOCKS)
        table, first = reserved
        self._rx[offer.request_id] = _Receiving(
            table, first, torch.zeros((self.layout.layers, len(table) - first), dtype=torch.bool),
            streamed=not offer.samples, last_hidden=offer.last_hidden)
        return Accept(offer.request_id, self.layout, first, table[first:])

    def _reserve(self, offer: Offer) -> tuple[list[int], int] | None:
        """D's blocks for an Offer, in transfer order, and how many leading ones it had cached."""
        if offer.moved:
            return self.engine.import_moved(
                offer.request_id, offer.prompt_token_ids, offer.params, seed=offer.seed,
                samples=_samples(offer.samples), outputs={m.index: m.token_ids for m in offer.moved},
                num_shared_blocks=offer.num_shared_blocks, priority=offer.priority, cache_salt=offer.cache_salt)
        seq = self.engine.import_prefilled(
            offer.request_id, offer.prompt_token_ids, offer.params, seed=offer.seed,
            samples=_samples(offer.samples) if offer.samples else None,
            priority=offer.priority, cache_salt=offer.cache_salt, num_cached_tokens=offer.num_cached_tokens,
            num_output_tokens=offer.num_output_tokens)
        return None if seq is None else (list(seq.block_table), seq.num_computed_tokens // self.layout.block_size)

    def receive(self, frame: BlockFrame, payload: bytes | memoryview) -> Fail | None:
        """Writes a frame's KV into D's blocks; an invalid frame drops it with a (rate-limited)
        log line and fails its request (blocks freed). Frames of unknown requests are dropped."""
        rx = self._rx.get(frame.request_id)
        if rx is None or not self.engine.is_importing(frame.request_id):
            self._rx.pop(frame.request_id, None)
            return self._drop(frame.request_id, "no transfer in progress for it", fail=False)
        problem = self._check(frame, payload, rx)
        if problem:
            return self._drop(frame.request_id, problem, fail=True)
        with warnings.catch_warnings():        # read-only receive buffers: we only read them
            warnings.simplefilter("ignore", UserWarning)
            kv = torch.frombuffer(payload, dtype=torch.uint8)
        kv = kv.view(self._dtype).view(frame.shape)
        caches = handoff_caches(self.engine)
        dst = torch.tensor(frame.dst_block_ids, device=caches[0][0].device)
        kv = kv.to(caches[0][0].device)
        for i, (k, v) in enumerate(caches[frame.layer_start:frame.layer_end]):
            # copied as bytes: the CPU has no index_copy_ for float8 (kv_cache_dtype fp8)
            k.view(torch.uint8).index_copy_(0, dst, kv[i, 0].view(torch.uint8))
            v.view(torch.uint8).index_copy_(0, dst, kv[i, 1].view(torch.uint8))
        b0 = frame.block_start - rx.first_block
        rx.covered[frame.layer_start:frame.layer_end, b0:b0 + len(frame.dst_block_ids)] = True
        rx.seen.add(frame.seq_no)
        rx.last_progress = time.monotonic()
        if frame.layer_end == self.layout.layers:
            self.blocks_received += len(frame.dst_block_ids)
        return None

    def _check(self, frame: BlockFrame, payload: bytes | memoryview, rx: _Receiving) -> str:
        """'' when the frame is a new one of its request and fits it exactly, else why not."""
        lay, n = self.layout, len(frame.dst_block_ids)
        if frame.seq_no in rx.seen or not 0 <= frame.seq_no < rx.covered.numel():
            return f"frame {frame.seq_no} repeated or out of range"
        if not 0 <= frame.layer_start < frame.layer_end <= lay.layers:
            return f"layer range [{frame.layer_start}, {frame.layer_end}) out of bounds"
        if n == 0 or not rx.first_block <= frame.block_start or frame.block_start + n > len(rx.table):
            return "block range out of bounds"
        if frame.dst_block_ids != rx.table[frame.block_start:frame.block_start + n]:
            return "destination blocks differ from the accepted ones"
        expected_shape = [frame.layer_end - frame.layer_start, 2, n, lay.block_size, lay.num_kv_heads, lay.head_dim]
        if frame.dtype != lay.kv_dtype or list(frame.shape) != expected_shape:
            return f"dtype/shape {frame.dtype}{list(frame.shape)} != {lay.kv_dtype}{expected_shape}"
        size = len(payload) if isinstance(payload, bytes) else payload.nbytes
        want = expected_shape[0] * 2 * n * lay.block_size * lay.num_kv_heads * lay.head_dim * self._dtype.itemsize
        if size != want or size > self.max_frame_bytes:
            return f"payload of {size} bytes (expected {want}, at most {self.max_frame_bytes})"
        if checksum(payload) != frame.checksum:
            return "checksum mismatch"
        b0 = frame.block_start - rx.first_block
        if rx.covered[frame.layer_start:frame.layer_end, b0:b0 + n].any():
            return "frame repeats blocks already received"
        return ""

    def accepted_blocks(self, request_id: str) -> list[int] | None:
        """D's blocks an accepted request still awaits (its Accept's dst_block_ids); None if none."""
        rx = self._rx.get(request_id)
        if rx is None or not self.engine.is_importing(request_id):
            return None
        return rx.table[rx.first_block:]

    def written_directly(self, request_id: str) -> bool:
        """A transport that wrote the missing blocks itself (NIXL's READ) says so here, in place of
        frames; complete(Done(request_id, 0)) then admits the request. False if unknown."""
        rx = self._rx.get(request_id)
        if rx is None or not self.engine.is_importing(request_id):
            return False
        rx.covered[:] = True
        self.blocks_received += rx.covered.shape[1]
        return True

    def complete(self, done: Done) -> Ack | Fail:
        rx = self._rx.get(done.request_id)
        if rx is None or not self.engine.is_importing(done.request_id):
            self._rx.pop(done.request_id, None)
            return Fail(done.request_id, "no transfer in progress for it")
        if done.num_frames != len(rx.seen) or not bool(rx.covered.all()):
            return self._drop(done.request_id, f"incomplete: {len(rx.seen)} of {done.num_frames} frames", fail=True)
        try:
            # mtp without a last hidden state (an older P): drafts from its second step on
            hidden = _hidden(done.last_hidden or rx.last_hidden) if self.layout.mtp_layers else None
            self.engine.admit_imported(done.request_id, _samples(done.samples) if rx.streamed else None, hidden)
        except RequestError as e:        # a streamed request's first tokens, or mtp's state, missing or invalid
            return self._drop(done.request_id, str(e), fail=True)
        del self._rx[done.request_id]
        return Ack(done.request_id)

    def expire(self, idle_s: float) -> list[str]:
        """Fail the transfers that made no progress for idle_s seconds (P died or went silent):
        their blocks are freed. Returns their request ids."""
        now = time.monotonic()
        stale = [rid for rid, rx in self._rx.items() if now - rx.last_progress >= idle_s]
        for rid in stale:
            self._dropped.warning("kv transfer: request %r made no progress for %.1f s, dropped", rid[:64], idle_s)
            self.abort(rid)
        return stale

    def abort(self, request_id: str) -> None:
        """Stop receiving a request; its blocks are freed (also after admission: an abort)."""
        self._rx.pop(request_id, None)
        self.engine.abort_request(request_id)

    def fail(self, request_id: str, reason: str) -> Fail:
        """Drop a request whose KV cannot be received (its blocks freed) and say why."""
        return self._drop(request_id, reason, fail=True)

    def _drop(self, request_id: str, reason: str, *, fail: bool) -> Fail:
        self.frames_dropped += 1
        self._dropped.warning("kv transfer: dropped a frame of request %r: %s", request_id[:64], reason)
        if fail:
            self.abort(request_id)
        return Fail(request_id, reason)


def _hidden(state: LastHidden | None) -> torch.Tensor | None:
    """The (H,) host tensor of a LastHidden (its size and dtype checked by the engine's MTP)."""
    if state is None:
        return None
    dtype = getattr(torch, state.dtype, None)
    if not isinstance(dtype, torch.dtype) or dtype.is_complex or len(state.data) % dtype.itemsize:
        raise RequestError(f"invalid last_hidden: {len(state.data)} bytes of dtype {state.dtype[:32]!r}")
    return torch.frombuffer(bytearray(state.data), dtype=dtype)


def _samples(samples: list[SampleStart]) -> list[tuple[int, int, float]]:
    return [(s.index, s.token_id, s.cumulative_logprob) for s in samples]
