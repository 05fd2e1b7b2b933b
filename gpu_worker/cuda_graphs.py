"""CUDA graphs for decode steps: one graph per batch size of a ladder, replayed on static buffers.

A decode step is hundreds of small kernels (a few per layer); launching them from Python costs
more than running them at small batch sizes. Each captured graph replays ModelRunner.run_model
(the pure-device middle piece of a forward: ids -> final hidden states) for a fixed number of
rows, reading its inputs from persistent buffers that every replay refills in place:

    static buffers (max_batch_size rows)          a step of B = 5 sequences, bucket 8
    input_ids    [t0 t1 t2 t3 t4 | 0  0  0 ]       real rows first, then padding rows:
    positions    [p0 p1 p2 p3 p4 | 0  0  0 ]       slot -1  -> the KV write skips them
    slot_mapping [s0 s1 s2 s3 s4 | -1 -1 -1]       context 0 -> attention writes zeros
    context_lens [c0 c1 c2 c3 c4 | 0  0  0 ]       block row 0 -> never read (context 0)
    block_tables [rows of the 5  | 0 ...   ]

The attention grids depend only on host ints fixed at capture (rows, and max_context_len set to
the model's maximum, which pins the decode kernel's split count), so one graph serves every
context length. Replays copy the batch's tensors into the buffers (host->device or
device->device, non-blocking), reset the padding rows, replay, and return the first B rows of
the graph's output; that output is only valid until the next replay.

On the CPU there is nothing to capture: the same buffer logic runs eagerly (`EagerReplay`), so
the padding rules are tested without a GPU.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
from typing import Callable, Iterator

import torch

from gpu_worker.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

RunModel = Callable[[ForwardBatch], torch.Tensor]   # ForwardBatch on the device -> (T, H) hidden
Logits = Callable[[torch.Tensor], torch.Tensor]       # (B, H) hidden -> (B, V) float32 logits


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then every 8 up to 256, then every 16: a padded step wastes at most 15 rows."""
    ladder = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max(272, max_batch_size + 16), 16))
    sizes = [s for s in ladder if s < max_batch_size] + [max_batch_size]
    return sorted(set(sizes))


def capture_graph(fn: Callable[[ForwardBatch], torch.Tensor], batch: ForwardBatch, pool, device: torch.device,
                  before_call: Callable[[], None] = lambda: None,
                  pdl: bool = True) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn(batch) twice on a side stream (Triton compiles, lazy allocations stay out of the
    capture), then once captured into a CUDA graph in `pool` -> (graph, its output tensor).
    `before_call` runs before each of the three calls. All three launch the Triton kernels with
    programmatic dependent launch where `pdl` (KernelTuning.pdl) and the device allow it
    (gpu_worker/kernels/_pdl.py)."""
    from gpu_worker.kernels._pdl import for_cuda_graph
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with for_cuda_graph(pdl):
        with torch.cuda.stream(stream):
            for _ in range(2):
                before_call()
                fn(batch)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        before_call()
        graph = torch.cuda.CUDAGraph()
        with no_gc(), torch.cuda.graph(graph, pool=pool):
            output = fn(batch)
    return graph, output


@contextlib.contextmanager
def no_gc():
    """Python's cyclic GC off for a capture: a collection inside it can free an older engine's
    graphs or CUDA objects, whose destructors are illegal while a stream captures (on the H200 a
    process that built engines one after another aborted so, in a prefill graph's capture).
    Garbage waits for the next collection, after the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CaptureTimes:
    """Per-size capture seconds behind a progress bar on stderr. Capture takes tens of seconds of
    a GPU worker's start (each size: Triton compiles any variant it needs first, then three
    forwards), so the final log line names the slowest sizes: compile-bound sizes stand out."""

    def __init__(self, kind: str, sizes: list[int], device: torch.device):
        self.kind, self.sizes = kind, sizes
        # a bar on the GPU only, and from one rank only when tensor-parallel ranks all capture
        dist = torch.distributed
        self.progress = device.type == "cuda" and (not dist.is_available() or not dist.is_initialized()
                                                    or dist.get_rank() == 0)
        self.seconds: dict[int, float] = {}

    def __iter__(self) -> Iterator[int]:
        from tqdm import tqdm
        with tqdm(self.sizes, desc=f"capturing {self.kind} CUDA graphs", unit="graph", file=sys.stderr,
                  disable=not self.progress, leave=False) as bar:
            for size in bar:
                t = time.perf_counter()
                yield size
                self.seconds[size] = time.perf_counter() - t

    def summary(self, slowest: int = 3) -> str:
        """e.g. '51 decode (context 131072) CUDA graphs in 48.2 s (slowest: 1 3.1 s, 2 2.9 s, 4 2.5 s)'"""
        top = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:slowest]
        return (f"{len(self.seconds)} {self.kind} CUDA graphs in {sum(self.seconds.values()):.1f} s "
                f"(slowest: {', '.join(f'{size} {sec:.1f} s' for size, sec in top)})")


class EagerReplay:
    """Stands in for a torch.cuda.CUDAGraph where graphs do not exist (CPU): reruns the function."""

    def __init__(self, fn: RunModel, batch: ForwardBatch):
        self.fn, self.batch = fn, batch
        self.output = fn(batch)

    def replay(self) -> None:
        self.output.copy_(self.fn(self.batch))


class DecodeGraphs:
    def __init__(self, run_model: RunModel, *, device: torch.device, max_batch_size: int,
                 max_blocks_per_seq: int, max_context_len: int, sizes: list[int] | None = None,
                 logits_fn: Logits | None = None, logits_max_bs: int = 0, pdl: bool = True):
        """`logits_fn`: graphs of at most `logits_max_bs` rows also capture the lm_head (their
        output is (B, V) float32 logits, see `returns_logits`); larger ones stop at the hidden
        states, whose logits the caller computes (a (256, V) float32 output per graph would
        hold ~0.5 MB per row in the pool). `pdl`: capture_graph's."""
        self.run_model, self.pdl = run_model, pdl
        self.logits_fn = logits_fn
        self.logits_max_bs = logits_max_bs if logits_fn is not None else 0
        self.device = torch.device(device)
        self.sizes = sorted(sizes or capture_sizes(max_batch_size))
        self.max_batch_size = self.sizes[-1]
        self.max_context_len = max_context_len
        n, dev = self.max_batch_size, self.device
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        # Persistent inputs, sized for the largest graph; each graph reads a prefix of rows.
        # ids, positions and slots are the rows of one (3, N) tensor: the batch builder stages a
        # pure-decode step's three the same way (equal segments), so one copy refills them.
        self.ids_positions_slots = torch.zeros((3, n), **i64)
        self.input_ids, self.positions, self.slot_mapping = self.ids_positions_slots.unbind(0)  # (N,) each
        self.slot_mapping.fill_(-1)
        self.context_lens = torch.zeros(n, **i32)                       # (N,)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), **i32)  # (N, max_blocks)
        self.query_start_loc = torch.arange(n + 1, **i32)               # (N+1,) one row per sequence
        self.query_lens = torch.ones(n, **i32)                          # (N,)
        self.logits_indices = torch.arange(n, **i64)                    # (N,)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_times = CaptureTimes(f"decode (context {max_context_len})", list(reversed(self.sizes)),
                                          self.device)

    # ---- capture -----------------------------------------------------------------------------
    def returns_logits(self, size: int) -> bool:
        """Whether the graph of `size` rows (a captured size) ends with the lm_head."""
        return size <= self.logits_max_bs

    def _captured_fn(self, size: int) -> RunModel:
        if not self.returns_logits(size):
            return self.run_model
        return lambda batch: self.logits_fn(self.run_model(batch))

    def static_batch(self, size: int) -> ForwardBatch:
        """The ForwardBatch a graph of `size` rows is captured with: views of the buffers."""
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            query_lens=self.query_lens[:size], context_lens=self.context_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1], block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size], logits_indices=self.logits_indices[:size],
            max_query_len=1, max_context_len=self.max_context_len)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (smaller graphs reuse it)."""
        self._reset_padding(0)
        if self.device.type != "cuda":
            for size in self.capture_times:
                self.graphs[size] = EagerReplay(self._captured_fn(size), self.static_batch(size))
                self.outputs[size] = self.graphs[size].output
            return
        pool = torch.cuda.graph_pool_handle()
        for size in self.capture_times:
            self.graphs[size], self.outputs[size] = capture_graph(
                self._captured_fn(size), self.static_batch(size), pool, self.device, pdl=self.pdl)
        torch.cuda.synchronize(self.device)
        log.info("captured %s; batch sizes %s", self.capture_times.summary(), self.sizes)

    # ---- replay ------------------------------------------------------------------------------
    def bucket(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure-decode batch (one row per sequence) that fits a captured size."""
        return (bool(self.graphs) and batch.is_pure_decode and batch.num_tokens == batch.num_seqs
                and batch.max_context_len <= self.max_context_len
                and batch.block_tables.shape[1] <= self.block_tables.shape[1]
                and self.bucket(batch.num_seqs) is not None)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """(B, H) final hidden states of the batch's rows, or (B, V) float32 logits where
        `returns_logits(bucket(B))`; valid until the next run."""
        B = batch.num_seqs
        size = self.bucket(B)
        nb = batch.block_tables.shape[1]
        stacked = _stacked_rows(batch.input_ids, batch.positions, batch.slot_mapping)
        if stacked is not None:                       # each copy is a GPU op between two replays
            self.ids_positions_slots[:, :B].copy_(stacked, non_blocking=True)
        else:
            self.input_ids[:B].copy_(batch.input_ids, non_blocking=True)
            self.positions[:B].copy_(batch.positions, non_blocking=True)
            self.slot_mapping[:B].copy_(batch.slot_mapping, non_blocking=True)
        self.context_lens[:B].copy_(batch.context_lens, non_blocking=True)
        self.block_tables[:B, :nb].copy_(batch.block_tables, non_blocking=True)
        self._reset_padding(B, size)
        self.graphs[size].replay()
        return self.outputs[size][:B]

    def _reset_padding(self, start: int, stop: int | None = None) -> None:
        """Rows [start, stop) become harmless padding (see the module docstring)."""
        stop = self.max_batch_size if stop is None else stop
        if stop > start:
            self.slot_mapping[start:stop].fill_(-1)
            self.context_lens[start:stop].zero_()


def _stacked_rows(*rows: torch.Tensor) -> torch.Tensor | None:
    """(len(rows), n) view of equally long 1-D tensors that lie at equal distances in one storage
    (the batch builder's staging layout), so that one copy moves them all; None otherwise."""
    first = rows[0]
    n, size = first.shape[0], first.element_size()
    if any(r.dim() != 1 or r.shape[0] != n or r.dtype != first.dtype or r.stride(0) != 1 for r in rows):
        return None
    if len({r.untyped_storage().data_ptr() for r in rows}) != 1:
        return None
    gaps = {b.data_ptr() - a.data_ptr() for a, b in zip(rows, rows[1:])}
    if len(gaps) != 1 or (gap := gaps.pop()) < n * size or gap % size:
        return None
    return first.as_strided((len(rows), n), (gap // size, 1))
