"""Where one step's GPU time goes, by kernel family (torch.profiler, CUPTI kernel records).

    cats = profile_kernels(lambda: graph.replay(), reps=5)   # {family: (ms per call, kernels per call)}
    print(format_profile(cats))

Kernels replayed from a CUDA graph are recorded too (CUPTI reports graph kernel launches), so a
decode step can be profiled exactly as it serves. Families come from kernel names: cuBLAS/CUTLASS
GEMMs (nvjet, sm90_xmma, cutlass, gemv), and the project's Triton kernels by their function names.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

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
