"""Same-host KV hand-off by reading P's cache: D copies P's blocks straight into its own, device to
device through CUDA IPC (a CPU cache: through a shared-memory mapping of it, so that CI runs the
same protocol with two real processes). No frame, no host copy, no encryption on the way.

    P  source = export_cache(engine)    before the engine thread runs: every K and V cache
                                        tensor exported once (CacheSharing.export)
       Offer(cache_source=source)       to each decode worker, whose answer says whether it reads
    D  reader.open(source) -> ""|why    once per source_id (cached; dropped SOURCE_IDLE_S after
                                        its last use: a P that went away leaves no mapping behind)
       Accept(reads_cache=True)
    P  Done(src_block_ids, hold_until)  after the first token (the prompt's KV is final: the step
                                        that drew it was read back to the host) while P's export
                                        holds the blocks: until D's answer, at least to hold_until
    D  reader.read(done)                one gather + scatter per cache tensor on D's own stream,
                                        synchronized, then Ack (P frees or caches its blocks) | Fail

    P's cache tensor (num_blocks, bs, kv heads, head dim)     D's cache tensor
      [ .. src[0] .. src[2] .. src[1] .. ]   index_select ->  index_copy_ ->  [ dst[0] dst[1] dst[2] .. ]

P keeps a block from reuse until D's Ack or Fail, or hold_until: it never stops waiting for an
answer once Done went out (an abort waits for it too, a few ms), and D refuses to admit a copy
that ended after hold_until (its clock is P's: same host means the same kernel boot). A mismatch
(other host, other layout, a GPU D cannot see, unreadable handles) makes D accept without
`reads_cache`: P then sends frames as it would have anyway.
"""
from __future__ import annotations

import abc
import logging
import math
import os
import re
import secrets
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from gpu_worker.kv_transfer.connector import EngineKVConsumer
from gpu_worker.kv_transfer.layout import KVLayoutMismatch, check_compatible, handoff_caches, handoff_layout
from gpu_worker.kv_transfer.messages import MAX_CACHE_TENSORS, Ack, CacheSource, Done, Fail, SharedTensor
from gpu_worker.kv_transfer.rate_limit import RateLimitedLog
from gpu_worker.kv_transfer.shm import SHM_DIR, host_identity

log = logging.getLogger("kvmesh.kv_transfer")
SOURCE_IDLE_S = 120.0       # D drops a source mapping unused this long (P gone, or restarted)
MAX_SOURCES = 16            # source mappings D keeps (the least recently used goes first)
HOLD_MARGIN_S = 0.05        # D starts a read only with this much of P's hold left
_CPU_NAME = re.compile(r"/torch_\d+_\d+_\d+")                     # torch's shared-memory files
_CPU_MANAGER = re.compile(r"/[\w./-]*/torch-shm-dir-\w+/manager\.sock")


class CacheSharing(abc.ABC):
    """How one process exports a cache tensor and another on its host opens it."""
    kind: str

    @abc.abstractmethod
    def device_of(self, t: torch.Tensor) -> str: ...

    @abc.abstractmethod
    def export(self, t: torch.Tensor) -> SharedTensor: ...

    @abc.abstractmethod
    def open_storage(self, shared: SharedTensor, device: str) -> torch.UntypedStorage:
        """P's storage, mapped here. Raises ValueError when it cannot be."""

    def open(self, shared: SharedTensor, device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """P's (contiguous) cache tensor of this shape, mapped here; ValueError if it does not fit."""
        storage = self.open_storage(shared, device)
        numel = 1
        for d in shape:
            numel *= d
        if shared.offset < 0 or (shared.offset + numel) * dtype.itemsize > storage.nbytes():
            raise ValueError("a shared cache tensor is smaller than its layout says")
        t = torch.empty((0,), dtype=dtype, device=storage.device)
        return t.set_(storage, shared.offset, shape)


class CudaIpcSharing(CacheSharing):
    """CUDA IPC handles of the caching allocator's blocks (torch.multiprocessing's fields, carried
    in a msgspec struct instead of a pickle)."""
    kind = "cuda_ipc"

    def device_of(self, t: torch.Tensor) -> str:
        return str(torch.cuda.get_device_properties(t.device).uuid)

    def export(self, t: torch.Tensor) -> SharedTensor:
        (_, handle, size, offset_bytes, ref_counter, ref_counter_offset, event,
         event_sync) = t.untyped_storage()._share_cuda_()
        return SharedTensor(bytes(handle), int(size), int(offset_bytes), int(t.storage_offset()),
                            bytes(ref_counter), int(ref_counter_offset), bytes(event or b""), bool(event_sync))

    def open_storage(self, shared: SharedTensor, device: str) -> torch.UntypedStorage:
        index = next((i for i in range(torch.cuda.device_count())
                      if str(torch.cuda.get_device_properties(i).uuid) == device), None)
        if index is None:           # P's GPU is not visible to this process (CUDA_VISIBLE_DEVICES)
            raise ValueError(f"the prefill worker's GPU {device} is not visible here")
        torch.cuda._lazy_init()
        try:
            return torch.UntypedStorage._new_shared_cuda(
                index, shared.handle, shared.storage_bytes, shared.storage_offset_bytes, shared.ref_counter,
                shared.ref_counter_offset, shared.event or None, shared.event_sync)
        except RuntimeError as e:   # a stale or foreign handle
            raise ValueError(f"cannot open a CUDA IPC handle: {e}") from None


class CpuShmSharing(CacheSharing):
    """A CPU cache moved in place into torch's named shared memory (/dev/shm/torch_*, 0600, kept
    by torch_shm_manager until the last process using it lets go); D maps the same files."""
    kind = "cpu_shm"

    def device_of(self, t: torch.Tensor) -> str:
        return "cpu"

    def export(self, t: torch.Tensor) -> SharedTensor:
        # moves the storage's bytes into shared memory in place: every view of it follows
        manager, name, size = t.untyped_storage()._share_filename_cpu_()
        return SharedTensor(bytes(name), int(size), 0, int(t.storage_offset()), bytes(manager))

    def open_storage(self, shared: SharedTensor, device: str) -> torch.UntypedStorage:
        name, manager = shared.handle.decode(errors="replace"), shared.ref_counter.decode(errors="replace")
        if not _CPU_NAME.fullmatch(name) or not _CPU_MANAGER.fullmatch(manager) or ".." in manager:
            raise ValueError("not a shared cache file of ours")
        for path, kind in ((SHM_DIR + name, stat.S_ISREG), (manager, stat.S_ISSOCK)):
            try:
                st = os.lstat(path)
            except OSError as e:
                raise ValueError(f"shared cache file gone: {e.strerror}") from None
            if not kind(st.st_mode) or st.st_uid != os.getuid() or (kind is stat.S_ISREG and stat.S_IMODE(
                    st.st_mode) != 0o600):
                raise ValueError("shared cache file with an unexpected type, owner or mode")
        try:
            return torch.UntypedStorage._new_shared_filename_cpu(shared.ref_counter, shared.handle,
                                                                 shared.storage_bytes)
        except RuntimeError as e:
            raise ValueError(f"cannot map a shared cache file: {e}") from None


def sharing_for(t: torch.Tensor) -> CacheSharing:
    return CudaIpcSharing() if t.is_cuda else CpuShmSharing()


def export_cache(engine) -> CacheSource:
    """P's cache, exported (before the engine thread runs: a CPU export moves the storage)."""
    caches = [t for kv in handoff_caches(engine) for t in kv]           # K, V per layer (MTP's last)
    if len(caches) > MAX_CACHE_TENSORS:
        raise ValueError(f"{len(caches)} cache tensors: more than a source carries ({MAX_CACHE_TENSORS})")
    sharing = sharing_for(caches[0])
    return CacheSource(source_id=secrets.token_hex(16), kind=sharing.kind, host=host_identity(),
                       device=sharing.device_of(caches[0]), layout=handoff_layout(engine),
                       num_blocks=int(caches[0].shape[0]), tensors=[sharing.export(t) for t in caches])


@dataclass
class _Opened:
    tensors: list[torch.Tensor]         # P's K, V per layer, mapped here
    num_blocks: int
    last_used: float = field(default_factory=time.monotonic)


class CacheReader:
    """D's side: the sources it opened, and the reads of the requests it accepted from them."""

    def __init__(self, consumer: EngineKVConsumer, idle_s: float = SOURCE_IDLE_S) -> None:
        self.consumer = consumer
        self.caches = [t for kv in handoff_caches(consumer.engine) for t in kv]
        self.sharing = sharing_for(self.caches[0])
        self.host = host_identity()
        self.idle_s = idle_s
        self._sources: OrderedDict[str, _Opened] = OrderedDict()
        self._reads: dict[str, str] = {}          # request id -> source id, from Accept to Done
        self._stream = torch.cuda.Stream(self.caches[0].device) if self.caches[0].is_cuda else None
        self._refused = RateLimitedLog(log)
        self.blocks_read = 0
        self.sources_opened = 0

    def open(self, source: CacheSource) -> str:
        """"" when D can read from this source (opened now, or before); else why not (logged)."""
        if (known := self._sources.get(source.source_id)) is not None:
            self._sources.move_to_end(source.source_id)
            known.last_used = time.monotonic()
            return ""
        why = self._mismatch(source)
        if not why:
            shape = (source.num_blocks, *self.caches[0].shape[1:])
            try:
                tensors = [self.sharing.open(t, source.device, self.caches[0].dtype, shape) for t in source.tensors]
            except ValueError as e:
                why = str(e)
        if why:
            self._refused.warning("kv transfer: not reading the prefill worker's cache (%s); frames instead", why)
            return why
        self._sources[source.source_id] = _Opened(tensors, source.num_blocks)
        self.sources_opened += 1
        log.info("kv transfer: reading prefill worker cache %s directly (%s, %d blocks)", source.source_id,
                 type(self.sharing).__name__, source.num_blocks)
        while len(self._sources) > MAX_SOURCES:
            self._sources.popitem(last=False)
        return ""

    def _mismatch(self, source: CacheSource) -> str:
        if not self.host or source.host != self.host:
            return "the prefill worker runs on another host"
        if source.kind != self.sharing.kind:
            return f"its cache is shared as {source.kind!r}, this one as {self.sharing.kind!r}"
        try:
            check_compatible(self.consumer.layout, source.layout)
        except KVLayoutMismatch as e:
            return str(e)
        if len(source.tensors) != len(self.caches) or source.num_blocks <= 0:
            return "its cache tensors do not match this engine's"
        return ""

    def expect(self, request_id: str, source_id: str) -> None:
        """request_id was accepted with reads_cache: its Done names the blocks to read."""
        self._reads[request_id] = source_id

    def reading(self, request_id: str) -> bool:
        return request_id in self._reads

    def read(self, done: Done) -> Ack | Fail:
        """Copy the blocks Done names from P's cache into the ones D accepted, then admit the
        request (Ack), or fail it (its blocks freed)."""
        rid = done.request_id
        source = self._sources.get(self._reads.pop(rid, ""))
        dst = self.consumer.accepted_blocks(rid)
        if dst is None:
            return Fail(rid, "no transfer in progress for it")
        if source is None:
            return self.consumer.fail(rid, "its cache source is no longer open")
        src = done.src_block_ids
        if len(src) != len(dst) or not all(0 <= b < source.num_blocks for b in src):
            return self.consumer.fail(rid, "source blocks do not match the accepted ones")
        if not math.isfinite(done.hold_until):       # NaN would pass every lapse check below
            return self.consumer.fail(rid, "invalid hold_until: not a finite time")
        if time.monotonic() > done.hold_until - HOLD_MARGIN_S:
            return self.consumer.fail(rid, "the prefill worker's hold on its blocks lapsed")
        if src:
            self._copy(source.tensors, src, dst)
        if time.monotonic() > done.hold_until:      # P may have reused a block while we read it
            return self.consumer.fail(rid, "the read outlasted the prefill worker's hold")
        source.last_used = time.monotonic()
        self.blocks_read += len(src)
        if not self.consumer.written_directly(rid):
            return Fail(rid, "no transfer in progress for it")
        return self.consumer.complete(Done(rid, 0, done.samples, last_hidden=done.last_hidden))

    def _copy(self, sources: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        """One gather (P's cache) + scatter (D's) per cache tensor; on a GPU on D's own stream,
        after what D's compute stream queued (a block just freed there may still be written)."""
        device = self.caches[0].device
        if self._stream is None:
            self._gather_scatter(sources, src, dst, device)
            return
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            self._gather_scatter(sources, src, dst, device)
        self._stream.synchronize()

    def _gather_scatter(self, sources: list[torch.Tensor], src: list[int], dst: list[int], device) -> None:
        src_index = torch.tensor(src, device=sources[0].device)
        dst_index = torch.tensor(dst, device=device)
        for theirs, mine in zip(sources, self.caches):
            # (blocks, bs, kv heads, head dim); .to() is a no-op when P's GPU is D's
            mine.index_copy_(0, dst_index, theirs.index_select(0, src_index).to(device, non_blocking=True))

    def expire(self) -> None:
        """Drop reads whose request D no longer holds, then sources unused for idle_s (none that an
        accepted request will read from)."""
        for rid in [r for r in self._reads if self.consumer.accepted_blocks(r) is None]:
            del self._reads[rid]
        now, awaited = time.monotonic(), set(self._reads.values())
        for sid in [s for s, o in self._sources.items() if now - o.last_used > self.idle_s and s not in awaited]:
            del self._sources[sid]

    def sources(self) -> list[str]:
        return list(self._sources)

    def close(self) -> None:
        self._sources.clear()
        self._reads.clear()
