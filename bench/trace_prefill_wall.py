"""Where a prefill line's wall time goes beyond its GPU time (the seventeenth session found ~11 ms
at 2k against 3-4 ms at 512 and 8k): engine_perf's vLLM-workload lines (16,384 prompt tokens of
512 / 2k / 8k, one token out each), scheduled sync (as engine_perf runs them) and async (as
gpu_bench and the worker do), each timed plain (best of 3), then once under torch.profiler: the span from the drain's start to its first
kernel, the GPU's busy time, its idle gaps >= 0.2 ms (where they fall), and the span from the last
kernel to the drain's end; the profiled run's CPU ops by self time go to $OUT.

    python bench/trace_prefill_wall.py --model-dir /tmp/kvmesh-llama-8b
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import engine_perf as ep  # noqa: E402  (its Bench: prompts, add, drain)
from gpu_worker.config import EngineConfig  # noqa: E402
from gpu_worker.engine import Engine  # noqa: E402

TOKENS = 16384


def add_line(b, L: int) -> None:
    """One line's prompts (16,384 tokens of L-token prompts, one token out each), queued."""
    for _ in range(TOKENS // L):
        b.add(b.prompt(L), 1)
    torch.cuda.synchronize()


def line(b, L: int) -> float:
    add_line(b, L)
    t = time.perf_counter()
    b.drain()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t)


def traced(b, L: int, out: Path) -> str:
    add_line(b, L)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        b.drain()
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t0)
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    cpu = [e.time_range for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    origin = min(r.start for r in cpu)                         # the profiler's clock at the drain's start
    end = max(r.end for r in cpu)
    busy, gaps, last = 0.0, [], kernels[0][0]
    for s, e in kernels:
        if s > last + 200:
            gaps.append(f"{(s - last) / 1e3:.1f} ms at {(last - kernels[0][0]) / 1e3:.0f} ms")
        busy += max(0.0, e - max(s, last))
        last = max(last, e)
    (out / f"trace_prefill_wall_{L}_cpu_ops.txt").write_text(
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    return (f"profiled wall {wall:.1f} ms: {(kernels[0][0] - origin) / 1e3:.1f} ms to the first kernel, "
            f"GPU busy {busy / 1e3:.1f} ms over a {(last - kernels[0][0]) / 1e3:.1f} ms span, "
            f"{(end - last) / 1e3:.1f} ms after the last; gaps >= 0.2 ms: {', '.join(gaps) or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default="/tmp/kvmesh-llama-8b")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp"))
    eng = Engine(EngineConfig(model=args.model_dir, max_num_seqs=256, max_num_batched_tokens=TOKENS,
                              max_model_len=TOKENS))
    b = ep.Bench(eng)
    for L in (512, 2048, 8192):                               # warm-up: every kernel variant compiled
        line(b, L)
    rows = []
    for mode in (False, True):        # engine_perf's prefill lines run sync, gpu_bench's async (the worker's)
        eng.async_scheduling = mode
        for L in (512, 2048, 8192):
            plain = min(line(b, L) for _ in range(3))
            rows.append(f"{'async' if mode else 'sync '} {L:5d} x {TOKENS // L:2d}: plain best {plain:.1f} ms "
                        f"({TOKENS / plain * 1e3:,.0f} tok/s); " + traced(b, L, out))
            print(rows[-1], flush=True)
    print("\n".join(["", "prefill wall vs GPU, 16,384 prompt tokens a line"] + rows))


if __name__ == "__main__":
    main()
