"""Copies of whole KV blocks between the engine's device cache and host memory.

One block on the host is one uint8 tensor of shape (num_layers, 2, block_size, num_kv_heads,
head_dim * itemsize) (2: K then V): the cache's bytes, C-contiguous, so they are also the disk
tier's payload. Copies work on byte views of the cache, so every cache dtype (fp8 included) takes
the same gather and scatter kernels.

On CUDA the copies run on two streams of their own, and the step's stream never waits for an
offload:

    step stream     gather(evicted ids) -> staging   | forward may overwrite the blocks now
    offload stream            wait(step) -> staging D2H host slots (pinned) -> event per batch
    load stream     H2D host blocks -> staging, layer group by layer group -> an event per group;
                    the step stream waits for a group's event, then scatters its layers into the
                    destination blocks (all at once, or layer by layer inside a forward)

The gather is a device-to-device snapshot of the evicted blocks (a few microseconds per block):
after it, the step may reuse them at once while the slow D2H drains in the background. A host
slot is not written again before the loads that read it are done (the offload stream waits
for the last load event), and is not read on the host (disk tier) before its D2H is done
(`wait_offloaded`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from gpu_worker.sampler import to_device

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]     # per layer: K, V (num_blocks, bs, n_kv, hd)
_MIN_GROUP_COPY = 256 << 10     # bytes of one block's share of a layer group: smaller PCIe copies lose bandwidth
_MAX_LOAD_COPIES = 4096         # host-to-device copies one load may launch (n blocks x groups)


def block_bytes_of(kv_caches: KVCaches) -> int:
    """Bytes of one block's K and V over every layer: what a tier slot holds."""
    k = kv_caches[0][0]                                     # (num_blocks, bs, n_kv, hd)
    return 2 * len(kv_caches) * k[0].numel() * k.element_size()


class BlockMover:
    def __init__(self, kv_caches: KVCaches) -> None:
        self.kv_caches = [(k.view(torch.uint8), v.view(torch.uint8)) for k, v in kv_caches]
        k = self.kv_caches[0][0]                                # (num_blocks, bs, n_kv, hd * itemsize)
        self.device = k.device
        self.block_shape = (len(kv_caches), 2, *k.shape[1:])    # (L, 2, bs, n_kv, hd * itemsize)
        self.block_bytes = block_bytes_of(kv_caches)
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
        try:
            return torch.empty((num_blocks, *self.block_shape), dtype=torch.uint8, pin_memory=self.cuda)
        except RuntimeError as e:       # the allocator's (or the CUDA driver's) refusal, as a setting
            raise ValueError(f"invalid engine argument kv_offload_cpu_gb: cannot allocate "
                             f"{num_blocks * self.block_bytes / (1 << 30):.3g} GiB of host memory for the host "
                             f"tier ({str(e).splitlines()[0][:200]}); give a smaller size") from None

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

    def layer_groups(self, num_blocks: int) -> int:
        """Into how many groups of layers a load of num_blocks blocks is copied, each with an event
        of its own (the forward's layer i waits for its group only): as many as there are layers,
        but no copy under _MIN_GROUP_COPY bytes (small PCIe copies lose bandwidth) and at most
        _MAX_LOAD_COPIES copies a load (each is a host-side launch)."""
        num_layers = self.block_shape[0]
        return max(1, min(num_layers, self.block_bytes // _MIN_GROUP_COPY, _MAX_LOAD_COPIES // max(1, num_blocks)))

    def stage(self, sources: list[torch.Tensor], pending: list["torch.cuda.Event | None"],
              groups: int = 1) -> "Staged":
        """Host blocks -> one staging tensor on the device (n, L, 2, bs, n_kv, hd * itemsize): taken now, so
        the host copies may be dropped or overwritten afterwards. `pending`: the offload events
        the sources still wait for. The copy runs layer group by layer group, each group's end an
        event (CUDA), so a forward may start on the first layers while the last ones still copy:

            load stream   [group 0: layers 0..g-1 of every block] ev0 [group 1] ev1 ...
            step stream             wait ev0, scatter + attend layers 0..g-1 | wait ev1 ...
        """
        num_layers = self.block_shape[0]
        per_group = -(-num_layers // groups)                  # layers per group, the last may hold fewer
        if not self.cuda:
            return Staged(torch.stack(sources), [None] * groups, per_group)
        staged = torch.empty((len(sources), *self.block_shape), dtype=torch.uint8, device=self.device)
        stream = self._load_stream
        staged.record_stream(stream)    # a load dropped before its scatter frees it only after the copy
        stream.wait_stream(torch.cuda.current_stream(self.device))    # staging memory is free
        for event in pending:
            if event is not None:
                stream.wait_event(event)
        # a pageable source (a file read) would make the copy sync the stream, and with it the
        # step queued before: pinned first, a host memcpy
        sources = [src if src.is_pinned() else src.pin_memory() for src in sources]
        ready = []
        with torch.cuda.stream(stream):
            start = self._timing_start(stream)
            for first in range(0, num_layers, per_group):
                layers = slice(first, first + per_group)      # a block's layers are its outer dim:
                for i, src in enumerate(sources):             # one contiguous copy per block
                    staged[i, layers].copy_(src[layers], non_blocking=True)
                if first + per_group < num_layers:
                    ready.append(torch.cuda.Event())
                    ready[-1].record(stream)
            self._last_load = self._timing_end(start, stream, len(sources) * self.block_bytes)
            ready.append(self._last_load)
        return Staged(staged, ready, per_group)

    def scatter(self, staged: "Staged", block_ids: list[int]) -> None:
        """staging -> device blocks, every layer, ordered before whatever the step stream runs next."""
        ids = self.block_index(block_ids)
        for layer in range(self.block_shape[0]):
            self.scatter_layer(staged, ids, layer)

    def block_index(self, block_ids: list[int]) -> "list[int] | torch.Tensor":
        """What scatter_layer takes for block_ids: on CUDA, the ids on the device (no host sync)."""
        return to_device(block_ids, self.device) if self.cuda else block_ids

    def scatter_layer(self, staged: "Staged", block_ids: "list[int] | torch.Tensor", layer: int) -> None:
        """One layer of the staging -> its device blocks, after that layer's copy (the step stream
        waits for its group's event on the device; the host never waits). block_ids: a list, or
        on CUDA the ids already on the device (block_index), uploaded once for every layer."""
        k, v = self.kv_caches[layer]
        src = staged.data[:, layer]                           # (n, 2, bs, n_kv, hd * itemsize)
        if not self.cuda:            # row copies: CPU index_copy_ of bytes runs ~3x slower
            for kv, tensor in enumerate((k, v)):
                for i, block_id in enumerate(block_ids):
                    tensor[block_id].copy_(src[i, kv])
            return
        torch.cuda.current_stream(self.device).wait_event(staged.event(layer))
        idx = block_ids if isinstance(block_ids, torch.Tensor) else to_device(block_ids, self.device)
        k.index_copy_(0, idx, src[:, 0])
        v.index_copy_(0, idx, src[:, 1])


class Staged(NamedTuple):
    """Blocks on their way to the device: a staging tensor filled layer group by layer group."""
    data: torch.Tensor                       # (n, L, 2, bs, n_kv, hd * itemsize) on the device
    ready: list["torch.cuda.Event | None"]   # per layer group: its copy is done (None: done already)
    per_group: int                           # layers per group

    def event(self, layer: int) -> "torch.cuda.Event | None":
        return self.ready[layer // self.per_group]

    @property
    def copied(self) -> "torch.cuda.Event | None":
        """The end of the whole copy."""
        return self.ready[-1]
