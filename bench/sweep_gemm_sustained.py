#!/usr/bin/env python3
"""bf16 GEMM rates in a burst and sustained, per cuBLAS backend, with the SM clock and board power.

The matmul ceiling of bench/gpu_bench.py times ten 8192^3 products (~15 ms): the board runs at
its boost clock. Prefill runs GEMMs for hundreds of milliseconds and more, long enough to reach
the board's power cap, where the SM clock drops. This times each shape both ways: `burst`, the
median of 10 products after a pause, each timed between host syncs (so products of ~0.1 ms, the
M = 2,048 shapes, read up to ~10% low); `sustained`, products back to back for `--seconds`
(a host sync every ~20 ms of them), the rate over the last third, with nvidia-smi sampling clock
and power meanwhile. Shapes: the square ceiling and Llama-3.1-8B's four layer GEMMs at the
prefill step sizes (M tokens); backends: torch's default (cuBLAS) and cuBLASLt
(torch.backends.cuda.preferred_blas_library).

    python3 bench/sweep_gemm_sustained.py                 # the H200, ~1 min
    python3 bench/sweep_gemm_sustained.py --smoke         # CPU: the flow, tiny shapes

Prints a table last and writes $OUT/sweep_gemm_sustained.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

# name -> (M, N, K): y (M, N) = x (M, K) @ w (N, K).T, as nn.Linear runs them
LAYERS = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def shapes(smoke: bool) -> dict[str, tuple[int, int, int]]:
    if smoke:
        return {"square 64": (64, 64, 64), "qkv M=32": (32, 48, 64)}
    out = {"square 8192": (8192, 8192, 8192)}
    for m in (16384, 2048):
        out |= {f"{name} M={m}": (m, n, k) for name, (n, k) in LAYERS.items()}
    return out


class Sampler:
    """nvidia-smi every 0.2 s while `with` runs: SM clock (MHz) and power (W)."""

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


def rate(fn, flop: float, seconds: float, cuda: bool) -> tuple[float, float]:
    """(burst TFLOP/s, sustained TFLOP/s) of fn."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    ap.add_argument("--seconds", type=float, default=2.0, help="of back-to-back products per shape and backend")
    args = ap.parse_args()
    cuda = not args.smoke
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    backends = ["cublas", "cublaslt"] if cuda else ["default"]
    rows = []
    if cuda:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for name, (m, n, k) in shapes(args.smoke).items():
        x = torch.randn(m, k, device=dev, dtype=dt)
        w = torch.randn(n, k, device=dev, dtype=dt)
        for backend in backends:
            if cuda:
                torch.backends.cuda.preferred_blas_library(backend)
            with Sampler(cuda) as smi:
                burst, sustained = rate(lambda: x @ w.t(), 2 * m * n * k, args.seconds if cuda else 0.05, cuda)
            clock, power = smi.median()
            rows.append(dict(shape=name, m=m, n=n, k=k, backend=backend, burst_tflops=burst,
                             sustained_tflops=sustained, sm_clock_mhz=clock, power_w=power))
            print(f"{name:16s} {backend:8s} burst {burst:6.0f}  sustained {sustained:6.0f} TFLOP/s  "
                  f"{clock:5.0f} MHz {power:4.0f} W", flush=True)
        del x, w
    if cuda:
        torch.backends.cuda.preferred_blas_library("default")
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_gemm_sustained.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'shape':16s} {'backend':8s} {'burst':>7s} {'sustained':>9s} {'MHz':>6s} {'W':>5s}")
    for r in rows:
        print(f"{r['shape']:16s} {r['backend']:8s} {r['burst_tflops']:7.0f} {r['sustained_tflops']:9.0f} "
              f"{r['sm_clock_mhz']:6.0f} {r['power_w']:5.0f}")


if __name__ == "__main__":
    main()
