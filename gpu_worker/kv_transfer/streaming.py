"""Streaming a request's blocks while the prefill engine (P) still computes its later chunks.

    P engine thread, after the step that computed chunk k:
        ids = engine.prefilled_blocks(rid)              full prompt blocks whose KV is final
        offer = streamed_offer(engine, layout, rid)     once: no first tokens yet
        snap = take_snapshot(engine, b0, ids[b0:])      a private copy of those blocks' KV
    P sender thread:
        snapshot_frames(accept, layout, snap, seq_no)   its frames, as D's Accept maps them

    chunks on P      | chunk 0 | chunk 1 | chunk 2 (last: first token) |
    frames to D                | blocks of 0 | blocks of 1 | tail + Done(first tokens)

The snapshot is a copy because the request is still in P's scheduler: a preemption or an abort
frees its blocks while the sender reads, and the copy is what the step computed, whatever happens
to them later. On a GPU the copy is queued on the engine's stream right after the step (a device
gather, no host sync) and an event marks its end: the sender thread waits on that event from a
stream of its own, so the device-to-host copy overlaps the next chunk's forward. On the CPU the
copy is made at once. The blocks left after the last snapshot (the last chunk's, the partial last
block) are read in place once the request is exported (connector.EngineKVProducer.frames).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.kv_transfer.connector import block_frames
from gpu_worker.kv_transfer.layout import KVLayout, handoff_caches
from gpu_worker.kv_transfer.messages import Accept, BlockFrame, Offer
from gpu_worker.sampler import to_device
from services.prefix_hash import chain_hashes


@dataclass
class BlockSnapshot:
    block_start: int            # index in the request's block table of the first copied block
    src_block_ids: list[int]    # P's ids of the copied blocks
    kv: torch.Tensor            # (layers, 2, blocks, block_size, kv heads, head dim), a private copy
    ready: Any = None           # torch.cuda.Event recorded after the copy (None on the CPU)

    @property
    def block_end(self) -> int:
        return self.block_start + len(self.src_block_ids)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def streamed_offer(engine: Any, layout: KVLayout, request_id: str) -> Offer | None:
    """The Offer of an export_kv request still prefilling (engine thread): everything but the
    first tokens, which come with Done. None when the engine does not hold it."""
    request = engine.requests.get(request_id)
    if request is None or not request.seqs:
        return None
    seq, bs = request.seqs[0], layout.block_size
    hashes = chain_hashes(None, layout.model_id, request.cache_salt, request.prompt_token_ids, bs)
    return Offer(request_id=request_id, layout=layout, prompt_token_ids=request.prompt_token_ids,
                 params=request.params, seed=request.seed, priority=request.priority,
                 cache_salt=request.cache_salt, num_cached_tokens=request.num_cached_tokens,
                 samples=[], block_hashes=hashes, num_blocks=-(-seq.num_prompt_tokens // bs),
                 src_block_ids=[])


def take_snapshot(engine: Any, block_start: int, src_block_ids: list[int]) -> BlockSnapshot:
    """Copy the KV of blocks src_block_ids (engine thread, right after the step that computed
    them): queued on the engine's stream on a GPU, at once on the CPU."""
    caches = handoff_caches(engine)                # the target's layers, then the MTP layer's
    index = to_device(src_block_ids, caches[0][0].device)     # no host sync: the step may still run
    k0 = caches[0][0]                              # (num_blocks, block_size, kv heads, head dim)
    kv = torch.empty((len(caches), 2, len(src_block_ids), *k0.shape[1:]), dtype=k0.dtype, device=k0.device)
    for layer, (k, v) in enumerate(caches):        # gathered straight into the copy: no second one
        torch.index_select(k, 0, index, out=kv[layer, 0])
        torch.index_select(v, 0, index, out=kv[layer, 1])
    ready = None
    if kv.is_cuda:
        ready = torch.cuda.Event()
        ready.record()
    return BlockSnapshot(block_start, list(src_block_ids), kv, ready)


class SnapshotReader:
    """The sender thread's side: host copies of snapshots, off the engine's stream."""

    def __init__(self) -> None:
        self._stream: Any = None
        self._lock = threading.Lock()

    def host(self, snap: BlockSnapshot) -> torch.Tensor:
        if snap.ready is None:
            return snap.kv
        with self._lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=snap.kv.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(snap.ready)          # the step and the gather are done
            kv = snap.kv.to("cpu", non_blocking=True)
        self._stream.synchronize()
        return kv


def snapshot_frames(accept: Accept, layout: KVLayout, snap: BlockSnapshot, kv: torch.Tensor,
                    plan: tuple[int, int], seq_no: int) -> Iterator[tuple[BlockFrame, memoryview]]:
    """The frames of a snapshot's blocks that D lacks (those before accept.first_block are prefix
    hits on D), numbered from seq_no; `kv` is the snapshot's host copy (SnapshotReader.host)."""
    b_start = max(snap.block_start, accept.first_block)
    if b_start >= snap.block_end:
        return iter(())
    table = [0] * snap.block_start + snap.src_block_ids          # only these entries are read

    def gather(b0: int, b1: int, l0: int, l1: int) -> torch.Tensor:
        return kv[l0:l1, :, b0 - snap.block_start:b1 - snap.block_start]

    return block_frames(accept, layout, table, b_start, snap.block_end, gather, plan, seq_no)
