"""Timing shared by the device scripts in bench/: the median of CUDA-event-timed calls."""
from __future__ import annotations

import contextlib
import statistics
from typing import Callable

import torch


def event_median_ms(fn: Callable[[], object], reps: int, warmup: int = 0) -> float:
    """Median milliseconds of fn() measured with CUDA events around each call (after `warmup`
    untimed calls). Includes the host's launch cost when fn is shorter than it: replay a CUDA
    graph inside fn to see device time alone."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_median_ms(fn: Callable[[], object], inner: int, reps: int, warmup: int = 2, pdl: bool = False) -> float:
    """Median milliseconds of one fn() replayed from a CUDA graph of `inner` back-to-back calls:
    device time without the host's launch cost (what a CUDA-graph decode step sees). fn runs
    once on a side stream first (allocations and lazy initialisation stay out of the capture).
    pdl: kvmesh's kernels launch with programmatic dependent launch where on, as in the engine's
    graphs (kernels/_pdl.py: each call's kernels start while the call before finishes)."""
    from gpu_worker.kernels._pdl import for_cuda_graph
    launch = for_cuda_graph() if pdl else contextlib.nullcontext()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), launch:
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    launch = for_cuda_graph() if pdl else contextlib.nullcontext()
    with torch.cuda.graph(graph), launch:
        for _ in range(inner):
            fn()
    ms = event_median_ms(graph.replay, reps, warmup) / inner
    del graph
    return ms
