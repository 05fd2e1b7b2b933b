"""GPU time in the device scripts of bench/: the median of CUDA-event-timed calls and of CUDA-graph
replays, and where one step's GPU time goes by kernel family (torch.profiler, CUPTI kernel records).

    ms = graph_median_ms(lambda: kernel(...), inner=20, reps=10)     # device time, no launch cost
    cats = profile_kernels(lambda: graph.replay(), reps=5)   # {family: (ms per call, kernels per call)}
    print(format_profile(cats))

Kernels replayed from a CUDA graph are recorded too (CUPTI reports graph kernel launches), so a
decode step can be profiled exactly as it serves. Families come from kernel names: cuBLAS/CUTLASS
GEMMs (nvjet, sm90_xmma, cutlass, gemv), and the project's Triton kernels by their function names.
"""
from __future__ import annotations

import contextlib
import re
import statistics
import subprocess
import threading
import time
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


# (family, pattern on the kernel name), first match wins.
FAMILIES: list[tuple[str, re.Pattern]] = [
    ("gemv (triton)", re.compile(r"^_gemv_kernel|_splitk_reduce|_quant_rows")),
    ("gemm (cublas)", re.compile(r"nvjet|xmma|cutlass|gemm|gemv|sm90_|sm80_|cublas", re.I)),
    ("decode attention", re.compile(r"_decode_stage", re.I)),
    ("prefill attention", re.compile(r"_prefill|_attn_fwd|flash", re.I)),
    ("rmsnorm", re.compile(r"rmsnorm|rms_norm", re.I)),
    ("rope + kv write", re.compile(r"rope|kv_write|kv_cache|_cache_write", re.I)),
    ("swiglu", re.compile(r"swiglu|silu", re.I)),
    ("sampling", re.compile(r"sampl|argmax|topk|softmax|_gumbel|_token_counts", re.I)),
    ("embedding", re.compile(r"embedding|index_select|indexSelect", re.I)),
    ("copy / fill", re.compile(r"memcpy|memset|copy|fill", re.I)),
]


def family(name: str, families: list[tuple[str, re.Pattern]] = FAMILIES) -> str:
    return next((fam for fam, pat in families if pat.search(name)), "other")


def kernel_sums(prof, key: Callable[[str], str]) -> dict[str, tuple[float, int]]:
    """{key(kernel name): (GPU ms, launches)} over a finished torch.profiler run's CUDA records."""
    sums: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            s = sums.setdefault(key(ev.name), [0.0, 0])
            s[0] += ev.time_range.elapsed_us() / 1e3     # a kernel record: its own duration
            s[1] += 1
    return {k: (ms, n) for k, (ms, n) in sums.items()}


def _per_call(fn: Callable[[], object], reps: int, key: Callable[[str], str]) -> dict[str, tuple[float, float]]:
    """{key(kernel name): (GPU ms per call of fn, launches per call)} over `reps` calls of fn,
    after one untimed call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {k: (ms / reps, n / reps) for k, (ms, n) in kernel_sums(prof, key).items()}


def profile_kernels(fn: Callable[[], object], reps: int = 5) -> dict[str, tuple[float, float]]:
    """{family: (GPU ms per call of fn, kernels per call)} over `reps` calls of fn (after one
    untimed call), plus "total"."""
    out = _per_call(fn, reps, family)
    out["total"] = (sum(v[0] for v in out.values()), sum(v[1] for v in out.values()))
    return out


def top_kernels(fn: Callable[[], object], n: int = 8, reps: int = 3) -> list[tuple[str, float, float]]:
    """The n kernels with the most GPU time per call: (name, ms per call, launches per call)."""
    per_kernel = _per_call(fn, reps, lambda name: name[:80])
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:n]
    return [(name, ms, k) for name, (ms, k) in top]


def format_profile(cats: dict[str, tuple[float, float]]) -> str:
    """'gemm (cublas) 3.61 ms 75% x129; ...' ordered by time, total last."""
    total = cats.get("total", (0.0, 0))[0] or 1.0
    parts = [f"{fam} {ms:.3f} ms {100 * ms / total:.0f}% x{k:.0f}"
             for fam, (ms, k) in sorted(cats.items(), key=lambda kv: -kv[1][0]) if fam != "total"]
    return "; ".join(parts) + f"; total {cats.get('total', (0.0, 0))[0]:.3f} ms"


class PowerSampler:
    """nvidia-smi every 0.2 s while `with` runs: SM clock (MHz) and board power (W)."""

    def __init__(self, enabled: bool):
        self.enabled, self.rows, self._stop = enabled, [], threading.Event()

    def _run(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-i", "0"]
        while not self._stop.wait(0.2):
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=2).stdout.split(",")
                self.rows.append((float(out[0]), float(out[1])))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return

    def __enter__(self):
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.enabled:
            self._thread.join()

    def median(self, last: float = 1 / 3) -> tuple[float, float]:
        rows = self.rows[int(len(self.rows) * (1 - last)):] or [(float("nan"), float("nan"))]
        return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def burst_and_sustained_tflops(fn, flop: float, seconds: float, cuda: bool) -> tuple[float, float]:
    """(burst, sustained) TFLOP/s of fn. Burst: the median of 10 calls after a pause, each between
    host syncs (calls of ~0.1 ms read up to ~10% low). Sustained: calls back to back for `seconds`
    (a host sync every ~20 ms of them), the rate over the last third, when a board that runs
    long enough has reached its power cap and lowered its clock."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    time.sleep(0.5 if cuda else 0)                   # let the clock recover between shapes
    times = []
    for _ in range(10):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    one = statistics.median(times)
    burst = flop / one / 1e12
    batch = max(1, int(0.02 / one))                  # ~20 ms of products between host syncs
    end = time.perf_counter() + seconds
    late, n_late = end - seconds / 3, 0
    t_late = None
    while time.perf_counter() < end or not n_late:   # at least one timed batch (a slow host's
        for _ in range(batch):                        # first batch can outlast the window)
            fn()
        sync()
        if t_late is not None:
            n_late += batch
        elif time.perf_counter() >= late:
            t_late = time.perf_counter()
    sustained = flop * n_late / (time.perf_counter() - t_late) / 1e12
    return burst, sustained
