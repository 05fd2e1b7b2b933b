"""Copies of whole KV blocks between the engine's device cache and host memory.

One block on the host is one uint8 tensor of shape (num_layers, 2, block_size, num_kv_heads,
head_dim * itemsize) (2: K then V): the cache's bytes, C-contiguous, so they are also the disk
tier's payload. Copies work on byte views of the cache, so every cache dtype (fp8 included) takes
the same gather and scatter kernels.

On CUDA the copies run on two streams of their own, and the step's stream never waits for an
offload:

    step stream     gather(evicted ids) -> staging   | forward may overwrite the blocks now
    offload stream            wait(step) -> staging D2H host slots (pinned) -> event per batch
    load stream     H2D host blocks -> staging -> event; step stream waits for that event, then
                    scatters staging into the destination blocks

The gather is a device-to-device snapshot of the evicted blocks (a few microseconds per block):
after it, the step may reuse them at once while the slow D2H drains in the background. A host
slot is not written again before the loads that read it are done (the offload stream waits
for the last load event), and is not read on the host (disk tier) before its D2H is done
(`wait_offloaded`).
"""
from __future__ import annotations

import math

import torch

from gpu_worker.sampler import to_device

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]     # per layer: K, V (num_blocks, bs, n_kv, hd)


class BlockMover:
    def __init__(self, kv_caches: KVCaches) -> None:
        self.kv_caches = [(k.view(torch.uint8), v.view(torch.uint8)) for k, v in kv_caches]
        k = self.kv_caches[0][0]                                # (num_blocks, bs, n_kv, hd * itemsize)
        self.device = k.device
        self.block_shape = (len(kv_caches), 2, *k.shape[1:])    # (L, 2, bs, n_kv, hd * itemsize)
        self.block_bytes = math.prod(self.block_shape)
        self.cuda = self.device.type == "cuda"
        self._offload_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._load_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._last_load: torch.cuda.Event | None = None     # the end of the newest stage()
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []   # CUDA: copies to time

    def _timing_start(self, stream) -> "torch.cuda.Event":
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start

    def _timing_end(self, start, stream, num_bytes: int) -> "torch.cuda.Event":
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        if len(self._timed) < 64:                  # bounded: polled at every flush
            self._timed.append((start, end, num_bytes))
        return end

    def finished_copies(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of the CUDA copies that completed since the last call, measured on the
        device (the tiers' bandwidth estimates follow them); never waits."""
        done = [(n, start.elapsed_time(end) / 1e3) for start, end, n in self._timed if end.query()]
        self._timed = [t for t in self._timed if not t[1].query()]
        return done

    def host_blocks(self, num_blocks: int) -> torch.Tensor:
        """Host memory for num_blocks blocks (pinned on CUDA, so copies are asynchronous DMA)."""
        return torch.empty((num_blocks, *self.block_shape), dtype=torch.uint8, pin_memory=self.cuda)

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        idx = to_device(block_ids, self.device)          # no host sync
        return torch.stack([torch.stack((k.index_select(0, idx), v.index_select(0, idx)), 1)
                            for k, v in self.kv_caches], 1)            # (n, L, 2, bs, n_kv, hd * itemsize)

    def offload(self, block_ids: list[int], host: torch.Tensor, slots: list[int]) -> "torch.cuda.Event | None":
        """Device blocks -> host[slots]. Returns the event that marks the end of the copy (CUDA),
        or None when the copy is already done (CPU)."""
        staged = self._gather(block_ids)
        if not self.cuda:            # row copies: CPU index_copy_ of bytes runs ~7x slower
            for i, slot in enumerate(slots):
                host[slot].copy_(staged[i])
            return None
        stream = self._offload_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))    # the gather is done first
        if self._last_load is not None:
            stream.wait_event(self._last_load)                        # slots being read are not overwritten
        with torch.cuda.stream(stream):
            start = self._timing_start(stream)
            for i, slot in enumerate(slots):
                host[slot].copy_(staged[i], non_blocking=True)
            staged.record_stream(stream)
            return self._timing_end(start, stream, len(slots) * self.block_bytes)

    def offload_to_memory(self, block_ids: list[int]) -> torch.Tensor:
        """Device blocks -> a new host tensor (n, L, 2, bs, n_kv, hd * itemsize), synchronously."""
        return self._gather(block_ids).cpu()

    @staticmethod
    def wait_offloaded(done: "torch.cuda.Event | None") -> None:
        """Block the host until an offload's copy is in host memory (before reading it there)."""
        if done is not None:
            done.synchronize()

    @property
    def last_load(self) -> "torch.cuda.Event | None":
        """The event that ends the newest stage() (CUDA), None off CUDA (its copies are done)."""
        return self._last_load

    def stage(self, sources: list[torch.Tensor], pending: list["torch.cuda.Event | None"]) -> torch.Tensor:
        """Host blocks -> one staging tensor on the device (n, L, 2, bs, n_kv, hd * itemsize): taken now, so
        the host copies may be dropped or overwritten afterwards. `pending`: the offload events
        the sources still wait for."""
        if not self.cuda:
            return torch.stack(sources)
        staged = torch.empty((len(sources), *self.block_shape), dtype=torch.uint8, device=self.device)
        stream = self._load_stream
        staged.record_stream(stream)    # a load dropped before its scatter frees it only after the copy
        stream.wait_stream(torch.cuda.current_stream(self.device))    # staging memory is free
        for event in pending:
            if event is not None:
                stream.wait_event(event)
        with torch.cuda.stream(stream):
            start = self._timing_start(stream)
            for i, src in enumerate(sources):
                # a pageable source (a file read) would make the copy sync the stream, and with
                # it the step queued before: pinned first, a host memcpy
                staged[i].copy_(src if src.is_pinned() else src.pin_memory(), non_blocking=True)
            self._last_load = self._timing_end(start, stream, len(sources) * self.block_bytes)
        return staged

    def scatter(self, staged: torch.Tensor, block_ids: list[int], copied: "torch.cuda.Event | None") -> None:
        """staging -> device blocks, after `copied` (the end of its stage()), ordered before
        whatever the step stream runs next."""
        if not self.cuda:            # row copies: CPU index_copy_ of bytes runs ~3x slower
            for layer, cache in enumerate(self.kv_caches):
                for kv, tensor in enumerate(cache):
                    rows = tensor.view(tensor.shape[0], -1)         # (num_blocks, a layer's block bytes)
                    src = staged[:, layer, kv].reshape(len(block_ids), -1)
                    for i, block_id in enumerate(block_ids):
                        rows[block_id].copy_(src[i])
            return
        torch.cuda.current_stream(self.device).wait_event(copied)
        idx = to_device(block_ids, self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, idx, staged[:, layer, 0])
            v.index_copy_(0, idx, staged[:, layer, 1])
