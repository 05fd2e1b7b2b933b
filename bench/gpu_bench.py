"""GPU benchmark: ceilings, kernel checks + timings, the engine, and a Hugging Face peer.

One device call builds, checks and times everything (see bench/README.md for the command):

    python bench/gpu_bench.py                         # all sections
    python bench/gpu_bench.py --sections ceilings,kernels

Sections (each guarded: one failure is recorded and the next section runs):
  ceilings  device-to-device copy bandwidth (bytes read + written) and bf16 8192^3 matmul TFLOP/s
  sustained (not in the default run, ~1 min) bf16 GEMMs in a burst and back to back for 2 s, per
            cuBLAS backend, with the SM clock and board power: the rate a long prefill step gets
            at the board's power cap (the square ceiling and Llama-3.1-8B's layer GEMMs at 16,384
            and 2,048 rows)
  kernels   every Triton kernel vs its torch reference in bf16 (rel err ||out-ref||/||ref|| < 1e-2),
            then timed (median of CUDA-event timings) with GB/s or TFLOP/s against the ceilings
  engine    a random-weight Llama-3.1-8B (kvmesh make-model) through gpu_worker.Engine, configured
            as a GPU worker serves (async scheduling, CUDA graphs, the GC heap frozen after load):
            batch-1 decode ms/token, batched decode tok/s, prefill tok/s (~32k prompt tokens per
            length, and vLLM's peer run's 16,384), offline throughput on the
            1,000 ShareGPT-like requests of vLLM's peer run (bench/offline_bench.py: the same
            lengths, greedy by default)
  kv_transfer (not in the default run) a prefill worker's core and a decode worker's core on one
            device (half the engine's memory each, each on its own thread) joined by the services'
            hand-off over loopback: at 2k/8k/32k prompt tokens (the 8B shape), per path (zmq
            frames after the first token, zmq frames streamed during the prefill, the same two
            with the payloads in shared memory (shm, shm_streamed), NIXL's READ when nixl is
            installed): P's prefill, the transfer after its first token (bytes,
            GB/s), and the overlap (P's first token -> D's first decode token)
  kv_tiers  (not in the default run) KV tiers (gpu_worker/kv_tiers): D2H and H2D bandwidth of the tier
            path against a pinned copy of the same bytes in the same run; time to first token
            per turn of a multi-turn chat whose users' histories exceed the device pool, with
            kv_load_policy never (recompute) / always (load) / auto; drain to disk (GB/s) and
            the restart's disk index scan (files/s); the next turn's TTFT after a 2k / 8k-token
            history loaded against recomputed, and the decode step of a batch while a history
            loads beside it (overlapped); decode step time while every new block evicts (and
            offloads) a cached one, against an engine without tiers
  structured (not in the default run) constrained decoding (gpu_worker/structured): decode TPOT at
            batch 1 and 64 with every sequence under a JSON schema (an array of 40 objects: long
            instances) against the same batch unconstrained (ignore_eos, same prompts), and grammar
            compile time p50/p99 over the tests' schema corpus, cold then cached
  peers     Hugging Face transformers on the same weights, time-boxed: eager (sdpa), then batch-1
            decode with a static cache and torch.compile (transformers' own fast path)

Progress goes to stdout as it happens; the summary table is printed last; everything is also
written to $OUT/gpu_bench.json (rewritten after every section, so a timeout keeps what ran).
Imports only torch + triton for ceilings/kernels; the engine needs gpu_worker's own imports.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from anywhere in the repo

import torch  # noqa: E402

from gpu_timing import (PowerSampler, burst_and_sustained_tflops, event_median_ms,  # noqa: E402  (bench/)
                        graph_median_ms)
from offline_bench import PREFILL_TOKENS as PEER_PREFILL_TOKENS, vllm_peer_sharegpt_lengths  # noqa: E402

from gpu_worker.config import tuning_from_env  # noqa: E402
from gpu_worker.tuning import KernelTuning  # noqa: E402

T0 = time.time()
DEV = "cuda"           # "cpu" only with --smoke (TRITON_INTERPRET=1, tiny sizes: checks this script's code)
SMOKE = False
# The kernels' choices for every direct kernel call below (the engine sections take theirs from
# EngineConfig): KernelTuning's defaults with the KVMESH_* overrides, set in main.
TUNING = KernelTuning()
ROWS: list[tuple[str, str, str, str]] = []      # (section, metric, value, note) for the final table
RESULTS: dict = {"sections": {}, "errors": {}}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def row(section: str, metric: str, value: float | str, unit: str = "", note: str = "") -> None:
    text = value if isinstance(value, str) else (f"{value:.4g} {unit}".strip())
    ROWS.append((section, metric, text, note))
    RESULTS["sections"].setdefault(section, {})[metric] = {"value": value, "unit": unit, "note": note}
    log(f"{section:8s} {metric:48s} {text}  {note}")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def time_cuda(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of fn() by CUDA events (after warm-up); wall clock in --smoke on CPU.
    Includes the host's launch cost when fn is shorter than it (see time_graph)."""
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return event_median_ms(fn, reps, warmup)


def time_graph(fn, inner: int = 20, reps: int = 10, pdl: bool = False) -> float:
    """Median milliseconds of one fn() replayed from a CUDA graph of `inner` back-to-back calls:
    the device time without Python/launch overhead (what a CUDA-graph decode step sees); pdl:
    launched with PDL as the engine's graphs launch kvmesh's kernels."""
    if DEV == "cpu":
        return time_cuda(fn)
    pdl = pdl and TUNING.pdl
    fn()
    torch.cuda.synchronize()
    return graph_median_ms(fn, inner, reps, pdl=pdl)


def attn_dtype() -> torch.dtype:
    """bf16 on the GPU; fp32 in --smoke (the interpreter's bf16 dot is not trustworthy)."""
    return torch.float32 if SMOKE else torch.bfloat16


def empty_cache() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


class Deadline:
    def __init__(self, seconds: float):
        self.end = T0 + seconds

    def left(self) -> float:
        return self.end - time.time()


# ============================================================================ ceilings
def section_ceilings(args, deadline) -> None:
    n = 2 * 1024**3 // 2 if not SMOKE else 1 << 16              # 2 GiB of bf16
    src = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), reps=10)
    bw = 2 * src.numel() * 2 / (ms * 1e-3) / 1e9
    RESULTS["copy_gbps"] = bw
    row("ceiling", "D2D copy bandwidth (read+write)", bw, "GB/s")
    del src, dst
    N = 8192 if not SMOKE else 128
    a = torch.randn(N, N, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(N, N, device=DEV, dtype=torch.bfloat16)
    ms = time_cuda(lambda: a @ b, warmup=3, reps=10)
    tf = 2 * N**3 / (ms * 1e-3) / 1e12
    RESULTS["matmul_tflops"] = tf
    row("ceiling", "bf16 8192^3 matmul", tf, "TFLOP/s")
    del a, b
    empty_cache()


def _ceil_bw() -> float:
    return RESULTS.get("copy_gbps") or 4300.0


def _ceil_tf() -> float:
    return RESULTS.get("matmul_tflops") or 790.0


# ============================================================================ kernels
def _paged_cache(ctx_lens, n_kv, head_dim, page, dtype, seed=0):
    """A cache holding exactly the blocks the sequences need, in a random (fragmented) order."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    need = [(c + page - 1) // page for c in ctx_lens]
    total = sum(need)
    perm = torch.randperm(total, device=DEV, generator=g).int()
    tables = torch.zeros((len(ctx_lens), max(need)), dtype=torch.int32, device=DEV)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used: used + nb]
        used += nb
    k = torch.randn((total, page, n_kv, head_dim), device=DEV, dtype=dtype, generator=g)
    v = torch.randn((total, page, n_kv, head_dim), device=DEV, dtype=dtype, generator=g)
    return k, v, tables


def kernel_decode_attention(args, deadline) -> None:
    from gpu_worker.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
    H, KVH, D, page = 32, 8, 128, 16
    for B in ((1, 3) if SMOKE else (1, 64)):
        for ctx in ((17, 300) if SMOKE else (128, 8192, 32768)):
            if deadline.left() < 30:
                row("kernel", f"decode attn B={B} ctx={ctx}", "skipped (time)")
                continue
            lens = [ctx] * B
            k, v, tables = _paged_cache(lens, KVH, D, page, attn_dtype(), seed=B + ctx)
            q = torch.randn(B, H, D, device=DEV, dtype=attn_dtype())
            cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
            out = torch.full_like(q, float("nan"))
            call = dict(max_context_len=ctx, out=out, tuning=TUNING.decode_attention)
            paged_decode_attention(q, k, v, tables, cl, D ** -0.5, **call)
            nchk = min(B, 4)
            ref = paged_decode_attention_ref(q[:nchk], k, v, tables[:nchk], cl[:nchk], D ** -0.5)
            err = rel_err(out[:nchk], ref)
            ok = err < 1e-2 and not torch.isnan(out).any().item()
            ms_eager = time_cuda(lambda: paged_decode_attention(q, k, v, tables, cl, D ** -0.5, **call))
            ms = time_graph(lambda: paged_decode_attention(q, k, v, tables, cl, D ** -0.5, **call))
            ms_pdl = time_graph(lambda: paged_decode_attention(q, k, v, tables, cl, D ** -0.5, **call), pdl=True)
            nbytes = 2 * B * ctx * KVH * D * 2 + 2 * q.numel() * 2
            gbps, gbps_pdl = nbytes / (ms * 1e-3) / 1e9, nbytes / (ms_pdl * 1e-3) / 1e9
            row("kernel", f"decode attn B={B} ctx={ctx} (err {err:.1e} {'ok' if ok else 'FAIL'})",
                ms * 1e3, "us", f"{gbps:.0f} GB/s = {100 * gbps / _ceil_bw():.0f}% of copy (graph); "
                f"with PDL {ms_pdl * 1e3:.1f} us = {100 * gbps_pdl / _ceil_bw():.0f}%; eager {ms_eager * 1e3:.0f} us")
            if args.sweep and ctx >= 8192:
                best = None
                for bn in (32, 64, 128):
                    for nw in (4, 8):
                        for ns in (2, 3):
                            if deadline.left() < 40:
                                break
                            cfg = dict(block_n=bn, num_warps=nw, num_stages=ns, max_context_len=ctx,
                                       tuning=TUNING.decode_attention)
                            try:
                                o2 = paged_decode_attention(q, k, v, tables, cl, D ** -0.5, **cfg)
                                if rel_err(o2, out) > 1e-2:
                                    log(f"  sweep {bn, nw, ns}: WRONG")
                                    continue
                                t = time_graph(lambda: paged_decode_attention(q, k, v, tables, cl, D ** -0.5, **cfg),
                                               inner=5, reps=5)
                            except Exception as exc:   # e.g. out of shared memory
                                log(f"  sweep bn={bn} nw={nw} ns={ns}: {type(exc).__name__}")
                                continue
                            if best is None or t < best[0]:
                                best = (t, bn, nw, ns)
                if best:
                    row("sweep", f"decode B={B} ctx={ctx} best (block_n, warps, stages)",
                        f"{best[0] * 1e3:.1f} us @ {best[1:]}", "", f"{nbytes / (best[0] * 1e-3) / 1e9:.0f} GB/s")
            del k, v
            empty_cache()


def _fp8_decode_row(kc, vc, tables, B: int, ctx: int, H: int, ks: float, vs: float) -> None:
    """Decode attention over an fp8 cache of B sequences of ctx keys (stored = value / scale):
    checked against the reference, timed in a graph; bytes are the fp8 cache's."""
    from gpu_worker.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
    KVH, D = kc.shape[2], kc.shape[3]
    q = torch.randn(B, H, D, device=DEV, dtype=attn_dtype())
    cl = torch.tensor([ctx] * B, dtype=torch.int32, device=DEV)
    call = dict(max_context_len=ctx, k_scale=ks, v_scale=vs, tuning=TUNING.decode_attention)
    out = paged_decode_attention(q, kc, vc, tables, cl, D ** -0.5, **call)
    n = min(B, 4)
    ref = paged_decode_attention_ref(q[:n], kc, vc, tables[:n], cl[:n], D ** -0.5, k_scale=ks, v_scale=vs)
    err = rel_err(out[:n], ref)
    ms = time_graph(lambda: paged_decode_attention(q, kc, vc, tables, cl, D ** -0.5, **call))
    gbps = 2 * B * ctx * KVH * D / (ms * 1e-3) / 1e9
    row("kernel", f"fp8 decode attn B={B} ctx={ctx} (err {err:.1e} {'ok' if err < 1e-2 else 'FAIL'})", ms * 1e3, "us",
        f"{gbps:.0f} GB/s (fp8 bytes) = {100 * gbps / _ceil_bw():.0f}% of copy (graph)")


def kernel_prefill_attention(args, deadline) -> None:
    from gpu_worker.kernels.paged_decode_attention import gather_context
    from gpu_worker.kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
    H, KVH, D, page = 32, 8, 128, 16
    # (query_lens, context_lens): fresh prompts, and chunks behind cached prefixes + decode rows
    cases = {"4 x 2k fresh": ([2048] * 4, [2048] * 4),
             "1 x 8k fresh": ([8192], [8192]),
             "2k chunk behind 6k + 64 decodes": ([2048] + [1] * 64, [8192] + [1000] * 64)}
    if SMOKE:
        cases = {"smoke": ([70, 1, 1], [100, 30, 5])}
    for name, (qlens, clens) in cases.items():
        if deadline.left() < 30:
            row("kernel", f"prefill attn {name}", "skipped (time)")
            continue
        k, v, tables = _paged_cache(clens, KVH, D, page, attn_dtype(), seed=len(qlens))
        T = sum(qlens)
        q = torch.randn(T, H, D, device=DEV, dtype=attn_dtype())
        qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32, device=DEV)
        cl = torch.tensor(clens, dtype=torch.int32, device=DEV)
        out = torch.full_like(q, float("nan"))
        # as the engine calls it: this step's K/V rows passed, its default config, the same
        # values as the cache holds, so the reference reads them from the cache
        k_new = torch.cat([gather_context(k, tables[b], c)[c - n:] for b, (n, c) in enumerate(zip(qlens, clens))])
        v_new = torch.cat([gather_context(v, tables[b], c)[c - n:] for b, (n, c) in enumerate(zip(qlens, clens))])
        kw = dict(max_query_len=max(qlens), out=out, k_new=k_new, v_new=v_new)
        paged_prefill_attention(q, k, v, tables, cl, qsl, D ** -0.5, **kw)
        ref = paged_prefill_attention_ref(q, k, v, tables, cl, qsl, D ** -0.5)
        err = rel_err(out, ref)
        ok = err < 1e-2 and not torch.isnan(out).any().item()
        ms = time_cuda(lambda: paged_prefill_attention(q, k, v, tables, cl, qsl, D ** -0.5, **kw), reps=10)
        # causal FLOPs: 4 * H * D * (sum over query rows of the keys they see)
        seen = sum(q_ * (c - q_) + q_ * (q_ + 1) / 2 for q_, c in zip(qlens, clens))
        tf = 4 * H * D * seen / (ms * 1e-3) / 1e12
        row("kernel", f"prefill attn {name} (err {err:.1e} {'ok' if ok else 'FAIL'})", ms * 1e3, "us",
            f"{tf:.0f} TFLOP/s = {100 * tf / _ceil_tf():.0f}% of matmul")
        if args.sweep and name == "1 x 8k fresh":
            best = None
            for bm, bn, nw, ns in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                                   (128, 32, 4, 2), (64, 128, 8, 2), (128, 128, 8, 2)]:
                if deadline.left() < 40:
                    break
                cfg = dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, max_query_len=max(qlens),
                           k_new=k_new, v_new=v_new)
                try:
                    o2 = paged_prefill_attention(q, k, v, tables, cl, qsl, D ** -0.5, **cfg)
                    if rel_err(o2, out) > 1e-2:
                        log(f"  sweep {bm, bn, nw, ns}: WRONG")
                        continue
                    t = time_cuda(lambda: paged_prefill_attention(q, k, v, tables, cl, qsl, D ** -0.5, **cfg), reps=5)
                except Exception as exc:
                    log(f"  sweep {bm, bn, nw, ns}: {type(exc).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, bm, bn, nw, ns)
            if best:
                row("sweep", "prefill 8k best (block_m, block_n, warps, stages)", f"{best[0] * 1e3:.0f} us @ {best[1:]}",
                    "", f"{4 * H * D * seen / (best[0] * 1e-3) / 1e12:.0f} TFLOP/s")
        del k, v
        empty_cache()


def kernel_small_ops(args, deadline) -> None:
    from gpu_worker.kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref
    from gpu_worker.kernels.rmsnorm import rmsnorm, rmsnorm_ref
    from gpu_worker.kernels.rope import build_cos_sin_cache, rope_, rope_inv_freq, rope_ref
    from gpu_worker.kernels.swiglu import swiglu, swiglu_ref
    bf = dict(device=DEV, dtype=torch.bfloat16)
    T, Hd, I, H, KVH, D = (8192, 4096, 14336, 32, 8, 128) if not SMOKE else (5, 256, 300, 4, 2, 64)

    def report(name, err, fn, nbytes, tol=1e-2):
        ms = time_graph(fn)
        gbps = nbytes / (ms * 1e-3) / 1e9
        row("kernel", f"{name} (err {err:.1e} {'ok' if err < tol else 'FAIL'})", ms * 1e3, "us",
            f"{gbps:.0f} GB/s = {100 * gbps / _ceil_bw():.0f}% of copy (graph); eager {time_cuda(fn) * 1e3:.0f} us")

    x, r, w = torch.randn(T, Hd, **bf), torch.randn(T, Hd, **bf), torch.randn(Hd, **bf)
    out, res = rmsnorm(x, w, 1e-5, r)
    ref_out, ref_res = rmsnorm_ref(x, w, 1e-5, r)
    err = max(rel_err(out, ref_out), rel_err(res, ref_res))
    report(f"rmsnorm+residual T={T} H={Hd}", err, lambda: rmsnorm(x, w, 1e-5, r), 5 * T * Hd * 2)

    gu = torch.randn(T, 2 * I, **bf)
    report(f"swiglu T={T} I={I}", rel_err(swiglu(gu), swiglu_ref(gu)), lambda: swiglu(gu), 3 * T * I * 2)

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cache = build_cos_sin_cache(rope_inv_freq(D, 500000.0, scaling), 131072).to(DEV)
    pos = torch.randint(0, 131072, (T,), device=DEV)
    qkv = torch.randn(T, (H + 2 * KVH) * D, **bf)
    q, k = qkv[:, : H * D].view(T, H, D), qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    q_ref, k_ref = rope_ref(pos, q, k, cache)
    rope_(pos, q, k, cache)
    err = max(rel_err(q, q_ref), rel_err(k, k_ref))
    report(f"rope q+k T={T}", err, lambda: rope_(pos, q, k, cache), 2 * T * (H + KVH) * D * 2)

    from gpu_worker.kernels.rope_kv_write import rope_kv_write, rope_kv_write_ref
    page, nblk = 16, T // 16 + 64
    qkv = torch.randn(T, (H + 2 * KVH) * D, **bf)
    kcf, vcf = torch.zeros(nblk, page, KVH, D, **bf), torch.zeros(nblk, page, KVH, D, **bf)
    qkv2, kcf2, vcf2 = qkv.clone(), kcf.clone(), vcf.clone()
    fslots = torch.randperm(nblk * page, device=DEV)[:T]

    def qkv_views(x):
        return (x[:, : H * D].view(T, H, D), x[:, H * D:(H + KVH) * D].view(T, KVH, D),
                x[:, (H + KVH) * D:].view(T, KVH, D))

    rope_kv_write(pos, *qkv_views(qkv), cache, kcf, vcf, fslots)
    rope_kv_write_ref(pos, *qkv_views(qkv2), cache, kcf2, vcf2, fslots)
    err = max(rel_err(qkv, qkv2), rel_err(kcf, kcf2), rel_err(vcf, vcf2))
    report(f"rope+kv write fused T={T}", err, lambda: rope_kv_write(pos, *qkv_views(qkv), cache, kcf, vcf, fslots),
           (2 * T * (H + KVH) * D + 4 * T * KVH * D) * 2)

    kk, vv = torch.randn(T, KVH, D, **bf), torch.randn(T, KVH, D, **bf)
    kc, vc = torch.zeros(nblk, page, KVH, D, **bf), torch.zeros(nblk, page, KVH, D, **bf)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.randperm(nblk * page, device=DEV)[:T]
    kv_cache_write(kk, vv, kc, vc, slots)
    kv_cache_write_ref(kk, vv, kc2, vc2, slots)
    err = 0.0 if (torch.equal(kc, kc2) and torch.equal(vc, vc2)) else 1.0
    report(f"kv write T={T}", err, lambda: kv_cache_write(kk, vv, kc, vc, slots), 4 * T * KVH * D * 2)


def kernel_sampling(args, deadline) -> None:
    from gpu_worker.kernels.sampling import SamplingTensors, allowed_tokens_ref, apply_filters, sample
    dev = torch.device(DEV)
    # correctness on a small vocabulary (the reference is row-by-row Python)
    S, V = 8, 1000
    x = torch.randn(S, V, device=dev) * 3
    tk, tp, mp = [-1, 5, 50, -1, 20, 1, -1, 100], [1.0, 1.0, 0.9, 0.7, 0.95, 1.0, 1.0, 0.5], [0.0] * 6 + [0.05, 0.02]
    st = SamplingTensors.from_lists([1.0] * S, tk, tp, mp, list(range(S)), dev)
    f = apply_filters(x.clone(), st)
    bad = sum(set(torch.nonzero(f[i] > float("-inf")).flatten().tolist()) != allowed_tokens_ref(x[i].cpu(), tk[i], tp[i], mp[i])
              for i in range(S))
    greedy_ok = torch.equal(sample(x, SamplingTensors.from_lists([0.0] * S, [-1] * S, [1.0] * S, [0.0] * S, [0] * S, dev)),
                            x.argmax(-1))
    row("kernel", "sampling filters/greedy vs reference", "ok" if bad == 0 and greedy_ok else f"FAIL ({bad} rows)")
    # timings at Llama-3's vocabulary
    V = 128256 if not SMOKE else 3000
    for S in ((1, 64, 256) if not SMOKE else (2,)):
        logits = torch.randn(S, V, device=dev) * 3
        plain = SamplingTensors.from_lists([0.8] * S, [-1] * S, [1.0] * S, [0.0] * S, list(range(S)), dev)
        full = SamplingTensors.from_lists([0.8] * S, [50] * S, [0.9] * S, [0.05] * S, list(range(S)), dev)
        greedy = SamplingTensors.from_lists([0.0] * S, [-1] * S, [1.0] * S, [0.0] * S, [0] * S, dev)
        t_g = time_graph(lambda: sample(logits, greedy))
        t_p = time_graph(lambda: sample(logits, plain))
        t_f = time_graph(lambda: sample(logits, full), inner=5)
        row("kernel", f"sampling S={S} V={V}: greedy / temp / temp+topk+topp+minp",
            f"{t_g * 1e3:.0f} / {t_p * 1e3:.0f} / {t_f * 1e3:.0f} us", "", "graph")


def kernel_cuda_graphs(args, deadline) -> None:
    """DecodeGraphs + TritonAttentionBackend on a one-layer stand-in model: replay == eager."""
    from gpu_worker.attention.triton_backend import TritonAttentionBackend
    from gpu_worker.cuda_graphs import DecodeGraphs
    from gpu_worker.forward_batch import ForwardBatch
    H, KVH, D, page, n_blocks = 32, 8, 128, 16, 16384
    dt = attn_dtype()
    g = torch.Generator(device=DEV).manual_seed(0)
    kc = torch.randn(n_blocks, page, KVH, D, device=DEV, dtype=dt, generator=g)
    vc = torch.randn(n_blocks, page, KVH, D, device=DEV, dtype=dt, generator=g)
    wq = torch.randn(64, H * D, device=DEV, dtype=dt, generator=g)
    wkv = torch.randn(64, 2 * KVH * D, device=DEV, dtype=dt, generator=g)
    backend = TritonAttentionBackend(tuning=TUNING)

    def run_model(batch):
        x = torch.nn.functional.one_hot(batch.input_ids % 64, 64).to(dt)
        q = (x @ wq).view(-1, H, D)
        k, v = (x @ wkv).view(-1, 2, KVH, D).unbind(1)
        return backend.forward(q, k, v, kc, vc, batch, D ** -0.5).reshape(x.shape[0], -1)

    sizes = [1, 2, 4, 8] if SMOKE else [1, 8, 64]
    graphs = DecodeGraphs(run_model, device=torch.device(DEV), max_batch_size=sizes[-1], max_blocks_per_seq=256,
                          max_context_len=4096, sizes=sizes)
    graphs.capture()
    B = 3 if SMOKE else 37
    ctx = torch.randint(1, 4000 if not SMOKE else 200, (B,))
    perm = torch.randperm(n_blocks - 1)[: B * 250] + 1
    tables = perm.view(B, 250).int()
    pos = ctx.long() - 1
    slots = tables[torch.arange(B), (pos // page)].long() * page + pos % page
    i32 = dict(dtype=torch.int32, device=DEV)
    batch = ForwardBatch(
        input_ids=torch.randint(0, 1000, (B,), device=DEV), positions=pos.to(DEV),
        query_lens=torch.ones(B, **i32), context_lens=ctx.to(**i32),
        query_start_loc=torch.arange(B + 1, **i32), block_tables=tables.to(DEV), slot_mapping=slots.to(DEV),
        logits_indices=torch.arange(B, device=DEV), max_query_len=1, max_context_len=int(ctx.max()))
    kc0, vc0 = kc.clone(), vc.clone()
    out = graphs.run(batch).clone()
    kg, vg = kc.clone(), vc.clone()
    kc.copy_(kc0), vc.copy_(vc0)
    ref = run_model(batch)
    err = rel_err(out, ref)
    same_cache = torch.equal(kg, kc) and torch.equal(vg, vc)
    ok = err < 1e-2 and same_cache
    ms = time_cuda(lambda: graphs.run(batch)) if not SMOKE else 0.0     # incl. the input copies
    ms_eager = time_cuda(lambda: run_model(batch)) if not SMOKE else 0.0
    row("kernel", f"cuda graph replay B={B} (bucket {graphs.bucket(B)}) vs eager: err {err:.1e} "
        f"{'ok' if ok else 'FAIL'}", f"{ms * 1e3:.0f} / {ms_eager * 1e3:.0f} us", "", "graph / eager, 1 layer")


def kernel_fp8(args, deadline) -> None:
    """FP8 KV cache (write + decode attention) and FP8 linear (per-token quant + _scaled_mm)."""
    from gpu_worker.kernels.fp8_linear import (fp8_linear, fp8_linear_ref, quantize_per_token,
                                               quantize_per_token_ref, quantize_weight_fp8)
    from gpu_worker.kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref
    from gpu_worker.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
    f8 = torch.float8_e4m3fn
    H, KVH, D, page = (32, 8, 128, 16) if not SMOKE else (4, 2, 64, 16)
    B, ctx = (64, 8192) if not SMOKE else (2, 40)
    k, v, tables = _paged_cache([ctx] * B, KVH, D, page, attn_dtype(), seed=7)
    kc, vc = (k * 16).to(f8), (v * 16).to(f8)           # stored = value / (1/16)
    del k, v
    ks = vs = 1.0 / 16
    T = 4096 if not SMOKE else 5
    kk = torch.randn(T, KVH, D, device=DEV, dtype=attn_dtype())
    vv = torch.randn(T, KVH, D, device=DEV, dtype=attn_dtype())
    kc_w, vc_w = torch.zeros(T // page + 8, page, KVH, D, device=DEV, dtype=f8), torch.zeros(T // page + 8, page, KVH, D, device=DEV, dtype=f8)
    kc_r, vc_r = kc_w.clone(), vc_w.clone()
    slots = torch.randperm(kc_w.shape[0] * page, device=DEV)[:T]
    kv_cache_write(kk, vv, kc_w, vc_w, slots, 0.05, 0.05)
    kv_cache_write_ref(kk, vv, kc_r, vc_r, slots, 0.05, 0.05)
    same = torch.equal(kc_w.float(), kc_r.float()) and torch.equal(vc_w.float(), vc_r.float())
    row("kernel", "fp8 kv write vs reference", "ok" if same or SMOKE else "FAIL (rounding differs)")
    from gpu_worker.kernels.rope import build_cos_sin_cache, rope_inv_freq
    from gpu_worker.kernels.rope_kv_write import rope_kv_write, rope_kv_write_ref
    cs = build_cos_sin_cache(rope_inv_freq(D, 500000.0), 8192).to(DEV)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    qq = torch.randn(T, H, D, device=DEV, dtype=attn_dtype())
    k1, q2, k2 = kk.clone(), qq.clone(), kk.clone()
    kc_w.zero_(), vc_w.zero_(), kc_r.zero_(), vc_r.zero_()
    rope_kv_write(pos, qq, k1, vv, cs, kc_w, vc_w, slots, 0.05, 0.05)
    rope_kv_write_ref(pos, q2, k2, vv, cs, kc_r, vc_r, slots, 0.05, 0.05)
    # the fused kernel rotates k in fp32 registers with its own FMA order: a rotated value that lands
    # on an fp8 rounding boundary may round to the neighbouring code. V is not rotated: bit for bit.
    kw, kr = kc_w.view(torch.uint8).int(), kc_r.view(torch.uint8).int()
    differ = kw != kr
    steps = int((kw - kr).abs()[differ].max()) if bool(differ.any()) else 0
    same_sign = bool(((kw ^ kr)[differ] & 0x80 == 0).all())
    ok = torch.equal(vc_w.view(torch.uint8), vc_r.view(torch.uint8)) and steps <= 1 and same_sign \
        and float(differ.float().mean()) < 1e-5
    row("kernel", "fp8 rope+kv write vs reference", "ok" if ok or SMOKE else "FAIL",
        note=f"V bit for bit; {int(differ.sum())} of {differ.numel()} K codes differ, by at most {steps} fp8 code(s)")
    _fp8_decode_row(kc, vc, tables, B, ctx, H, ks, vs)
    del kc, vc
    for B1, ctx1 in ((1, 8192), (1, 32768)) if not SMOKE else ((1, 40),):   # batch 1: the split programs
        k1c, v1c, tables1 = _paged_cache([ctx1] * B1, KVH, D, page, attn_dtype(), seed=11)
        _fp8_decode_row((k1c * 16).to(f8), (v1c * 16).to(f8), tables1, B1, ctx1, H, ks, vs)
        del k1c, v1c
    # fp8 linear at Llama-8B's gate_up shape
    K, N = (4096, 28672) if not SMOKE else (64, 32)
    w = torch.randn(N, K, device=DEV, dtype=attn_dtype()) / K ** 0.5
    wq = quantize_weight_fp8(w)
    for M in ((1, 64, 4096) if not SMOKE else (3,)):
        x = torch.randn(M, K, device=DEV, dtype=attn_dtype())
        x8, xs = quantize_per_token(x)
        r8, rs = quantize_per_token_ref(x)
        mism = float((x8.float() != r8.float()).float().mean())
        y = fp8_linear(x, wq)
        err_q = rel_err(y, fp8_linear_ref(x, wq))
        err_bf = rel_err(y, x.float() @ w.float().t())
        t8 = time_graph(lambda: fp8_linear(x, wq), inner=10)
        tb = time_graph(lambda: x @ w.t(), inner=10)
        ok = err_q < 1e-2 and err_bf < 6e-2 and mism < 1e-3
        row("kernel", f"fp8 linear M={M} K={K} N={N} ({'ok' if ok else 'FAIL'})", f"{t8 * 1e3:.0f} / {tb * 1e3:.0f} us",
            "", f"fp8 / bf16 time; fp8 {2 * M * N * K / (t8 * 1e-3) / 1e12:.0f} TFLOP/s; err {err_q:.1e} vs ref, "
            f"{err_bf:.1e} vs bf16; quant mismatch {mism:.0e}")


def section_kernels(args, deadline) -> None:
    for fn in (kernel_decode_attention, kernel_prefill_attention, kernel_small_ops, kernel_sampling,
               kernel_cuda_graphs, kernel_fp8):
        if deadline.left() < 20:
            row("kernel", fn.__name__, "skipped (time)")
            continue
        try:
            fn(args, deadline)
        except Exception as exc:
            RESULTS["errors"][fn.__name__] = traceback.format_exc()
            row("kernel", fn.__name__, f"ERROR {type(exc).__name__}: {str(exc)[:120]}")
        empty_cache()


# ============================================================================ engine
@dataclass(frozen=True)
class EngineScale:
    """Sizes of the engine section: `full` is the benchmark; `quick` (a 1B model, short lengths)
    checks the engine's GPU path in about a minute; `smoke` is the CPU check of this script."""
    model_size: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_ctx: tuple[int, ...]          # batch-1 decode at these prompt lengths
    decode_out: int
    batch_sizes: tuple[int, ...]         # batched decode
    batch_out: int
    prefill_lens: tuple[int, ...]        # prefill throughput, ~prefill_tokens prompt tokens each
    prefill_tokens: int
    num_requests: int                    # offline throughput
    max_in: int
    max_out: int


SCALES = {
    # full: 1,024 sequences and 16,384-token steps, what the ShareGPT-like record ran with (vLLM's
    # offline LLM also allows 1,024 sequences on 80+ GB GPUs)
    "full": EngineScale("8b", 32768 + 256, 1024, 16384, (128, 8192), 128, (64, 256), 160,
                        (512, 2048, 8192, 32768), 32768, 1000, 2048, 1024),
    "quick": EngineScale("1b", 4096 + 256, 256, 8192, (128, 2048), 64, (64, 256), 48,
                         (512, 2048), 16384, 300, 1024, 256),
    "smoke": EngineScale("tiny", 1024, 8, 512, (128, 300), 8, (4, 8), 20, (64, 256), 512, 12, 200, 40),
}


def ensure_model(args) -> Path:
    model_dir = Path(args.model_dir or f"/tmp/kvmesh-llama-{args.scale.model_size}")
    if (model_dir / "config.json").exists() and list(model_dir.glob("*.safetensors")):
        return model_dir
    size = args.scale.model_size
    log(f"making a random-weight llama {size} in {model_dir} ...")
    cmd = [sys.executable, "-m", "services.cli", "make-model", "--arch", "llama", "--size", size, str(model_dir)]
    subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parents[1], timeout=300)
    return model_dir


def _prompt(rng, n: int, vocab: int) -> list[int]:
    return [rng.randrange(300, vocab) for _ in range(n)]   # random ids: no prefix-cache hits


def _drain(eng, deadline=None) -> int:
    """Step until idle; returns new tokens produced."""
    n = 0
    while eng.has_unfinished_requests():
        n += sum(len(d.new_token_ids) for d in eng.step())
        if deadline is not None and deadline.left() < 0:
            break
    return n


def section_engine(args, deadline) -> None:
    import random

    from gpu_worker.config import EngineConfig
    from gpu_worker.engine import Engine
    from services.protocol.sampling import SamplingParams

    sc: EngineScale = args.scale
    model_dir = ensure_model(args)
    log("loading the engine ...")
    t = time.time()
    sizes = dict(model=str(model_dir), max_num_seqs=sc.max_num_seqs, max_model_len=sc.max_model_len,
                 max_num_batched_tokens=sc.max_num_batched_tokens, async_scheduling=args.async_scheduling)
    if SMOKE:
        cfg = EngineConfig(**sizes, device="cpu", dtype="float32", attention_backend="torch", num_gpu_blocks=1024)
    else:
        cfg = EngineConfig(**sizes, gpu_memory_utilization=args.gpu_mem, dtype="bfloat16",
                           attention_backend=args.attention_backend)
    eng = Engine(cfg)
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    graphs = getattr(getattr(eng, "runner", None), "decode_graphs", None)
    row("engine", "load (weights + KV + graphs)", time.time() - t, "s",
        f"{eng.model_config.__class__.__name__}; attention {getattr(eng.setup, 'attention_backend', '?')}; "
        f"decode graphs {len(graphs.sizes) if graphs else 'none'}; max_num_seqs {sc.max_num_seqs}, "
        f"max_num_batched_tokens {sc.max_num_batched_tokens}, async scheduling {cfg.async_scheduling}, "
        f"{eng.block_manager.num_blocks} KV blocks")
    vocab, rng = eng.vocab_size, random.Random(0)
    greedy = dict(temperature=0.0, ignore_eos=True)
    ids = iter(range(10**9))

    def add(n_prompt, n_out, **kw):
        eng.add_request(f"r{next(ids)}", _prompt(rng, n_prompt, vocab), SamplingParams(max_tokens=n_out, **{**greedy, **kw}))

    # warm-up: compile every kernel variant (prefill, mixed, decode) before timing anything
    add(1000, 8)
    add(20, 8)
    _drain(eng)
    if not SMOKE:
        eng.freeze_gc()          # what the GPU worker does once its engine is up (Engine.freeze_gc)

    # batch-1 decode
    for ctx in sc.decode_ctx:
        if deadline.left() < 60:
            row("engine", f"batch-1 decode ctx={ctx}", "skipped (time)")
            continue
        add(ctx, sc.decode_out)
        while not eng.step():                         # the prefill (one step: ctx <= max_num_batched_tokens);
            pass                                      # async scheduling reads its token a step later
        sync()
        t = time.time()
        n = _drain(eng)
        dt = time.time() - t
        row("engine", f"batch-1 decode ctx={ctx}", 1e3 * dt / max(n, 1), "ms/token",
            f"{n / dt:.0f} tok/s (target >= 240 at 128)")

    # batched decode: B requests, prompt 128, measure steady state after the prefills
    for B in sc.batch_sizes:
        if deadline.left() < 60:
            row("engine", f"batched decode B={B}", "skipped (time)")
            continue
        for _ in range(B):
            add(128, sc.batch_out)
        steps = 0
        while steps < 8:                               # prefill them all (B * 128 / budget steps), then decode
            eng.step()
            steps += 1
        sync()
        t, n, steps = time.time(), 0, 0
        while eng.has_unfinished_requests() and steps < 100:
            n += sum(len(d.new_token_ids) for d in eng.step())
            steps += 1
        dt = time.time() - t
        _drain(eng)
        row("engine", f"batched decode B={B}", n / dt, "out tok/s",
            f"{1e3 * dt / steps:.1f} ms/step" + (" (target >= 18k at 256)" if B == 256 else ""))

    # prefill throughput, one output token each, two workloads per length: ~32k prompt tokens
    # (two 16,384-token steps: long enough for the board to reach its power cap) and vLLM's peer
    # run's (B = 16384 // L prompts, one step), so the vLLM line compares like with like
    totals = (sc.prefill_tokens, min(PEER_PREFILL_TOKENS, sc.prefill_tokens))   # smaller scales: one workload
    workloads = [(L, max(1, total // L)) for total in totals for L in sc.prefill_lens]
    for L, n_req in dict.fromkeys(workloads):                  # a 32k prompt is one workload
        if deadline.left() < 60:
            row("engine", f"prefill L={L} x{n_req}", "skipped (time)")
            continue
        times = []
        for _ in range(2):                             # twice: the first may still compile a kernel variant
            for _ in range(n_req):
                add(L, 1)
            sync()
            t = time.time()
            _drain(eng)
            times.append(time.time() - t)
        peer = " (vLLM's workload)" if n_req * L == PEER_PREFILL_TOKENS and L < PEER_PREFILL_TOKENS else ""
        row("engine", f"prefill L={L} x{n_req}{peer}", n_req * L / min(times), "tok/s",
            f"best of 2 ({n_req * L / max(times):.0f} the other)" + (", target >= 47k at 2k" if L == 2048 else ""))

    # offline throughput: vLLM's peer run's ShareGPT-like lengths (mean 211 in / 182 out), ignore_eos,
    # token-id prompts; the smoke scale draws its own short lognormal lengths
    if deadline.left() > 60:
        n_req = args.num_requests or sc.num_requests
        if SMOKE:
            lens_rng = random.Random(1)

            def lognormal(mean, sigma, lo, hi):
                return int(min(hi, max(lo, lens_rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))))

            reqs = [(lognormal(200, 1.0, 4, sc.max_in), lognormal(180, 1.0, 4, sc.max_out)) for _ in range(n_req)]
        else:
            reqs = vllm_peer_sharegpt_lengths(n_req)
        for p, o in reqs:
            add(p, o, temperature=args.temperature)
        box = Deadline(time.time() - T0 + min(args.throughput_seconds, deadline.left() - 30))
        t, preempted = time.time(), eng.scheduler.num_preemptions
        n_out = _drain(eng, box)
        dt = time.time() - t
        done = not eng.has_unfinished_requests()
        in_tokens = sum(p for p, _ in reqs)
        row("engine", f"offline throughput {n_req} reqs{'' if done else ' (time-boxed, partial)'}",
            n_out / dt, "out tok/s", f"{(n_out + (in_tokens if done else 0)) / dt:.0f} total tok/s, {dt:.1f} s"
            f", temperature {args.temperature}, {eng.scheduler.num_preemptions - preempted} preemptions")
        for r in list(getattr(eng, "requests", {})):
            eng.abort_request(r)
    else:
        row("engine", "offline throughput", "skipped (time)")
    del eng, add
    import gc
    gc.collect()                                       # CUDA graphs and KV cache: free them for the peer
    empty_cache()


# ============================================================================ peers
def section_peers(args, deadline) -> None:
    import transformers
    model_dir = ensure_model(args)
    log(f"loading transformers {transformers.__version__} (sdpa attention) ...")
    t = time.time()
    auto = transformers.AutoModelForCausalLM
    try:                                  # straight onto the GPU (needs accelerate; transformers 5 names)
        model = auto.from_pretrained(model_dir, dtype=torch.bfloat16, device_map=DEV)
    except (TypeError, ValueError, ImportError):
        model = auto.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEV)
    model.eval()
    row("peer", "HF load", time.time() - t, "s")
    vocab = model.config.vocab_size
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    n_prefill = min(8192, args.scale.max_model_len // 2)
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.inference_mode():
        if deadline.left() > 40:
            ids = torch.randint(300, vocab, (1, 128), device=DEV, generator=g)
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)    # warm-up
            sync()
            n = 64
            t = time.time()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            sync()
            dt = time.time() - t
            row("peer", "HF batch-1 decode ctx=128", n / dt, "tok/s", f"{1e3 * dt / n:.1f} ms/token (incl. prefill)")
        if deadline.left() > 40:
            ids = torch.randint(300, vocab, (1, n_prefill), device=DEV, generator=g)
            model(ids[:, :1024])
            sync()
            t = time.time()
            model(ids, logits_to_keep=1) if "logits_to_keep" in model.forward.__code__.co_varnames else model(ids)
            sync()
            dt = time.time() - t
            row("peer", f"HF prefill {n_prefill}", n_prefill / dt, "tok/s")
        if deadline.left() > args.hf_compile_min_s:
            hf_static_compiled_decode(model, torch.randint(300, vocab, (1, 128), device=DEV, generator=g), sync)
        else:
            row("peer", "HF static cache + torch.compile", "skipped (time)")
    del model
    empty_cache()


def hf_static_compiled_decode(model, ids, sync) -> None:
    """Batch-1 decode through transformers' own fast path (its "static kv-cache and torch.compile"
    guide): generate() with cache_implementation="static" compiles the decode step itself on a
    GPU (CompileConfig's default mode, reduce-overhead: CUDA graphs). Per-token time from the
    difference of 160- and 32-token runs, so the prompt's prefill and generate's setup cancel."""
    import torch._dynamo.utils as dynamo_utils
    long_n, short_n = 160, 32

    def run(n: int) -> float:
        sync()
        t = time.time()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static")
        sync()
        return time.time() - t

    t = time.time()
    for n in (long_n, short_n, long_n):         # the longest first: later calls reuse its cache, no recompile
        run(n)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    row("peer", "HF static cache + compile warm-up", time.time() - t, "s",
        f"{graphs} graphs compiled")
    long_s, short_s = min(run(long_n) for _ in range(2)), min(run(short_n) for _ in range(2))
    ms = 1e3 * (long_s - short_s) / (long_n - short_n)
    label = "static cache + torch.compile" if graphs else "static cache, NOT compiled"
    row("peer", f"HF batch-1 decode ctx=128, {label}", 1e3 / ms, "tok/s",
        f"{ms:.2f} ms/token (the difference of {long_n}- and {short_n}-token runs)")


# ============================================================================ sustained
# Llama-3.1-8B's layer GEMMs, name -> (N, K): y (M, N) = x (M, K) @ w (N, K).T, as nn.Linear runs them
LAYER_GEMMS = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def sustained_gemm_shapes() -> dict[str, tuple[int, int, int]]:
    if SMOKE:
        return {"square 64": (64, 64, 64), "qkv M=32": (32, 48, 64)}
    out = {"square 8192": (8192, 8192, 8192)}
    for m in (16384, 2048):                            # a full prefill step, and a serving chunk
        out |= {f"{name} M={m}": (m, n, k) for name, (n, k) in LAYER_GEMMS.items()}
    return out


def section_sustained(args, deadline) -> None:
    """The matmul ceiling is a burst (~15 ms of products, the board at its boost clock); a prefill
    step runs GEMMs long enough to reach the board's power cap, where the SM clock drops. Each
    shape, per cuBLAS backend: burst and sustained TFLOP/s, SM clock and board power."""
    cuda = not SMOKE
    dt = torch.bfloat16 if cuda else torch.float32
    backends = ["cublas", "cublaslt"] if cuda else ["default"]
    rows = []
    for name, (m, n, k) in sustained_gemm_shapes().items():
        if deadline.left() < 30:
            row("sustained", name, "skipped (time)")
            continue
        x = torch.randn(m, k, device=DEV, dtype=dt)
        w = torch.randn(n, k, device=DEV, dtype=dt)
        for backend in backends:
            if cuda:
                torch.backends.cuda.preferred_blas_library(backend)
            with PowerSampler(cuda) as smi:
                burst, sustained = burst_and_sustained_tflops(lambda: x @ w.t(), 2 * m * n * k,
                                                              args.sustained_seconds if cuda else 0.05, cuda)
            clock, power = smi.median()
            rows.append(dict(shape=name, m=m, n=n, k=k, backend=backend, burst_tflops=burst,
                             sustained_tflops=sustained, sm_clock_mhz=clock, power_w=power))
            row("sustained", f"{name} {backend}", sustained, "TFLOP/s",
                f"burst {burst:.0f}; {clock:.0f} MHz, {power:.0f} W")
        del x, w
    if cuda:
        torch.backends.cuda.preferred_blas_library("default")
    RESULTS["sustained_gemm"] = rows


def section_kv_transfer(args, deadline) -> None:
    """A prefill worker's core (P) and a decode worker's core (D) in one process, each on a thread
    of its own as their engine threads run, on one device (half the engine's memory each), joined
    by the services' hand-off (gpu_worker/service/handoff.py) over loopback sockets: per prompt
    length and path (zmq frames after the first token, zmq frames streamed while P prefills, the
    same through the shared-memory ring, D reading P's cache (cuda_ipc: on the CPU only, see
    below), NIXL's READ), P's prefill, the transfer after P's first token (its bytes, GB/s), and
    the overlap: P's first token -> D's first decode token; beside them the device-copy ceiling
    of cuda_ipc's copy. Both cores share one process's GIL with their sender and receiver threads,
    so host paths here are slower than between two worker processes (serve_bench pd)."""
    from gpu_worker.config import EngineConfig
    from gpu_worker.engine import Engine

    sc: EngineScale = args.scale
    lens = {"full": (2048, 8192, 32768), "quick": (512, 2048)}.get(args.engine_scale, (128,))
    sizes = dict(model=str(ensure_model(args)), max_num_seqs=8, max_model_len=max(sc.max_model_len, max(lens) + 64),
                 max_num_batched_tokens=sc.max_num_batched_tokens)
    if SMOKE:
        sizes["max_num_batched_tokens"] = 32       # several chunks: the streaming path
        make = lambda: Engine(EngineConfig(**sizes, device="cpu", dtype="float32", attention_backend="torch",
                                           num_gpu_blocks=1024))
    else:
        make = lambda: Engine(EngineConfig(**sizes, gpu_memory_utilization=args.gpu_mem / 2, dtype="bfloat16",
                                           attention_backend=args.attention_backend))
    from gpu_worker.kv_transfer.shm import host_identity
    # cuda_ipc: D copies the blocks out of P's cache (device to device; a CPU cache through shared memory).
    # CUDA cannot open an IPC handle in the process that exported it, and P and D share this one, so on
    # a GPU D would fall back to frames: the row would time frames under cuda_ipc's name. The device
    # copy's ceiling is still measured; the path itself is timed between two processes (serve_bench pd).
    on_gpu = not SMOKE and torch.cuda.is_available()
    paths = ("zmq", "zmq_streamed") + (("shm", "shm_streamed") if host_identity() else ())
    if host_identity() and not on_gpu:
        paths += ("cuda_ipc",)
    if not host_identity():
        row("kv_transfer", "shm and cuda_ipc", "skipped (no /dev/shm or boot id)")
    elif on_gpu:
        row("kv_transfer", "cuda_ipc", "not timed here (one process cannot open its own CUDA IPC handles); "
                                        "scripts/gpu_checks.sh pd times it between two processes")
    try:
        import nixl._api  # noqa: F401
        paths += ("nixl",)
    except ImportError:
        row("kv_transfer", "nixl", "skipped (the nixl package is not installed)")
    if args.kv_transfer_paths:       # e.g. nixl alone: the other paths were timed in another run
        wanted = {x.strip() for x in args.kv_transfer_paths.split(",")}
        paths = tuple(x for x in paths if x in wanted)
        if not paths:
            row("kv_transfer", "paths", f"skipped (none of {sorted(wanted)} runs here)")
            return
    p, d = make(), make()
    source = None
    if "cuda_ipc" in paths:          # exported once, before P runs (a CPU cache moves into shared memory)
        from gpu_worker.kv_transfer.cuda_ipc import export_cache
        source = export_cache(p)
    rng = random.Random(0)
    for path in paths:       # first connections (NIXL: agent metadata, UCX endpoints) are not timed
        _pd_handoff(p, d, path, f"warm-{path}", _prompt(rng, 2 * p.config.block_size, p.vocab_size), deadline,
                    source)
    for k, L in enumerate(lens):
        for path in paths:
            if deadline.left() < 30:
                row("kv_transfer", f"{path} L={L}", "skipped (time)")
                continue
            r = _pd_handoff(p, d, path, f"kv{k}-{path}", _prompt(rng, L, p.vocab_size), deadline, source)
            gbps = r["bytes"] / r["transfer_s"] / 1e9 if r["transfer_s"] > 0 else 0.0
            row("kv_transfer", f"{path} L={L} transfer after the first token", 1e3 * r["transfer_s"], "ms",
                f"{r['bytes'] / 1e6:.2f} MB, {gbps:.3f} GB/s; prefill on P {1e3 * r['prefill_s']:.1f} ms "
                f"(transfer = {100 * r['transfer_s'] / r['prefill_s']:.0f}% of it); {r['streamed']} blocks "
                f"streamed during the prefill; {r['outcome']}")
            row("kv_transfer", f"{path} L={L} first token -> D's first decode token", 1e3 * r["overlap_s"], "ms")
        if host_identity() and deadline.left() >= 30:
            _device_copy_ceiling(p, d, L)
    p.close()
    d.close()


def _device_copy_ceiling(p_engine, d_engine, L: int) -> None:
    """What cuda_ipc's copy is bounded by: the same gather + scatter of an L-token prompt's blocks
    from P's cache into D's within one process (no IPC mapping, no protocol), best of 5."""
    from gpu_worker.kv_transfer.layout import layout_of
    lay, caches = layout_of(p_engine), list(zip(p_engine.runner.kv_caches, d_engine.runner.kv_caches))
    n = -(-L // lay.block_size)
    src = torch.arange(n, device=caches[0][0][0].device)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    best = float("inf")
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for (pk, pv), (dk, dv) in caches:
            dk.index_copy_(0, src, pk.index_select(0, src))
            dv.index_copy_(0, src, pv.index_select(0, src))
        sync()
        best = min(best, time.perf_counter() - t0)
    nbytes = n * 2 * lay.num_layers * lay.block_size * lay.num_kv_heads * lay.head_dim * caches[0][0][0].element_size()
    row("kv_transfer", f"device copy ceiling L={L}", 1e3 * best, "ms",
        f"{nbytes / 1e6:.2f} MB, {nbytes / best / 1e9:.3f} GB/s (gather + scatter in one process)")


def _pd_handoff(p_engine, d_engine, path: str, rid: str, prompt: list[int], deadline, cache_source=None) -> dict:
    """One request through P and D (see section_kv_transfer); times by perf_counter, the device
    synchronized where a thread reads its results (the cores' own step outputs)."""
    import queue as queue_mod
    import threading

    from gpu_worker.service.core import WorkerCore
    from gpu_worker.service.handoff import DecodeReceiver, PrefillSender
    from services.protocol.messages import AwaitKV, Dispatch, StepOutput
    from services.protocol.sampling import SamplingParams
    from services.security.curve import Plane

    nixl = path == "nixl"
    agents = []
    if nixl:
        from gpu_worker.kv_transfer.nixl_transport import NixlKVAgent
        agents = [NixlKVAgent(p_engine, f"p-{rid}"), NixlKVAgent(d_engine, f"d-{rid}")]
    p = WorkerCore(p_engine, "p", 1)
    p.hands_off, p.streams_kv = True, path.endswith("_streamed")
    shm = path.startswith("shm")          # the payloads through /dev/shm (one host), the headers over ZMQ
    from gpu_worker.kv_transfer.shm import DEFAULT_RING_BYTES
    ipc = path == "cuda_ipc"              # D reads P's exported cache itself (no frames)
    sender = PrefillSender(p_engine, Plane.insecure(), 60.0, nixl_agent=agents[0] if nixl else None,
                           shm_ring_bytes=DEFAULT_RING_BYTES if shm else 0,
                           cache_source=cache_source if ipc else None)
    d = WorkerCore(d_engine, "d", 1)
    rx = DecodeReceiver(d_engine, Plane.insecure(), "127.0.0.1", 0, 60.0, nixl_agent=agents[1] if nixl else None,
                        shm=shm, cache_reads=ipc)
    d.imports = rx.imports
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    d_inbox: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    d_inbox.put(AwaitKV(request_id=rid, epoch=1, n=1, reply_addr="gw", detok_addr="dt"))
    times: dict[str, float] = {}
    stop = threading.Event()

    def tokens_of(out) -> bool:
        return any(isinstance(e.msg, StepOutput) and any(s.request_id == rid and s.token_ids for s in e.msg.seqs)
                   for e in out)

    def d_thread() -> None:
        while not stop.is_set():
            inbox = []
            while not d_inbox.empty():
                inbox.append(d_inbox.get())
            rx.poll()
            d.adopt_imports([])
            if tokens_of(d.run(inbox)) and "d_first" not in times:
                times["d_first"] = time.perf_counter()
            if not d.has_work():
                time.sleep(0.0002)

    worker = threading.Thread(target=d_thread, daemon=True)
    worker.start()
    out: list = []
    streamed = 0
    inbox = [Dispatch(request_id=rid, epoch=1, prompt_token_ids=prompt, params=params, reply_addr="gw",
                      detok_addr="dt", handoff_to=rx.endpoint.address)]
    outcome = "no answer"
    t0 = time.perf_counter()
    while deadline.left() > 5 and (rid in p.requests or "d_first" not in times):
        step, inbox = p.run(inbox), []
        if tokens_of(step) and "p_first" not in times:
            times["p_first"] = time.perf_counter()
        for srid, to, first, ids in p.take_stream_blocks():
            if sender.stream(srid, to, first, ids):
                streamed += len(ids)
            else:
                p.stop_streaming(srid)
        todo, cancel = p.take_handoffs()
        for crid, to in cancel:
            sender.cancel(crid, to)
        for hrid, to in todo:
            sender.submit(hrid, to)
        for result in sender.take_results():
            outcome = "ack" if result.ok else result.reason
            times.setdefault("acked", time.perf_counter())
            p.handoff_done(result.request_id, result.ok, result.reason, out)
        if not p.has_work():
            time.sleep(0.0002)
    stop.set()
    worker.join(10)
    while d.has_work() or d.requests:      # the rest of the decode, on this thread now
        d.run([])
    sender.close()
    rx.close()
    layout = sender.producer.layout
    per_block = 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim * \
        p_engine.runner.kv_caches[0][0].element_size()
    p_first = times.get("p_first", t0)
    return {"prefill_s": p_first - t0, "transfer_s": times.get("acked", p_first) - p_first,
            "overlap_s": times.get("d_first", p_first) - p_first, "streamed": streamed, "outcome": outcome,
            "bytes": -(-len(prompt) // layout.block_size) * per_block}


# ============================================================================ kv_tiers
def _tier_chat_sizes(sc: "EngineScale") -> tuple[int, int, int]:
    """(users, turns, tokens added per turn): the history grows to turns * per_turn tokens."""
    if SMOKE:
        return 3, 4, 48
    return (8, 8, 2048) if sc.model_size == "8b" else (8, 6, 512)


def _tier_engine(args, model_dir, num_blocks: int, **tiers):
    from gpu_worker.config import EngineConfig
    from gpu_worker.engine import Engine
    sc: EngineScale = args.scale
    sizes = dict(model=str(model_dir), max_num_seqs=64, max_num_batched_tokens=sc.max_num_batched_tokens,
                 num_gpu_blocks=num_blocks)     # max_model_len: what the small pool holds
    if SMOKE:
        return Engine(EngineConfig(**sizes, device="cpu", dtype="float32", attention_backend="torch", **tiers))
    return Engine(EngineConfig(**sizes, gpu_memory_utilization=args.gpu_mem, dtype="bfloat16",
                               attention_backend=args.attention_backend, **tiers))


def _tier_copy_bandwidth(eng, sync) -> None:
    """The tier path's D2H (gather + copy into host slots) and H2D (stage + scatter) against plain
    pinned copies of the same bytes in one piece, the ceiling."""
    tiers = eng.kv_tiers
    n = min(256 if not SMOKE else 32, tiers.host.num_slots, eng.block_manager.num_blocks)
    ids, nbytes = list(range(n)), n * tiers.mover.block_bytes
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEV == "cuda")

    def timed(fn, reps=5) -> float:
        fn()
        sync()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t)
        return best

    # on a fresh engine: host slots 0..n-1 and device blocks 0..n-1 hold nothing yet
    d2h = timed(lambda: tiers.mover.offload(ids, tiers.host.data, ids))
    h2d = timed(lambda: tiers.mover.scatter(tiers.mover.stage([tiers.host.data[i] for i in ids], [None] * n), ids))
    d2h_ceiling = timed(lambda: pinned.copy_(dev, non_blocking=True))
    h2d_ceiling = timed(lambda: dev.copy_(pinned, non_blocking=True))
    for name, t, ceiling in (("D2H", d2h, d2h_ceiling), ("H2D", h2d, h2d_ceiling)):
        row("kv_tiers", f"{name} tier path, {n} blocks", nbytes / t / 1e9, "GB/s",
            f"{100 * ceiling / t:.0f}% of a pinned copy of the same {nbytes / 1e6:.1f} MB "
            f"({nbytes / ceiling / 1e9:.1f} GB/s)")


def _tier_chat_ttft(eng, users: int, turns: int, per_turn: int, deadline) -> list[float]:
    """Median time to first token per turn of `users` chats served turn by turn in rotation, so
    each user's history is pushed out of the device pool by the others'."""
    import random
    import statistics

    from services.protocol.sampling import SamplingParams
    rng = random.Random(0)
    histories = [[] for _ in range(users)]
    out = []
    for turn in range(turns):
        ttfts = []
        for u in range(users):
            if deadline.left() < 15:
                return out
            histories[u] += _prompt(rng, per_turn, eng.vocab_size)
            rid = f"u{u}t{turn}"
            eng.add_request(rid, list(histories[u]), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            t, first = time.perf_counter(), None
            while eng.has_unfinished_requests():
                for d in eng.step():
                    if first is None:
                        first = time.perf_counter() - t
                    histories[u] += d.new_token_ids
            ttfts.append(first)
        out.append(statistics.median(ttfts))
    return out


def _decode_step_ms(eng, sync, batch: int, steps: int) -> float:
    """Median step time of `batch` decoding sequences after filling the pool with cached blocks,
    so every block a sequence needs evicts one (offloaded when the engine has tiers)."""
    import random

    from services.protocol.sampling import SamplingParams
    rng = random.Random(1)
    bs, bm = eng.config.block_size, eng.block_manager
    for i in range(10_000):                                                      # fill the cache
        if bm.num_cached_blocks >= bm.num_blocks - batch * (steps // bs + 4):
            break
        eng.add_request(f"fill{i}", _prompt(rng, 1024 if not SMOKE else 64, eng.vocab_size),
                        SamplingParams(max_tokens=1))
        _drain(eng)
    for i in range(batch):
        eng.add_request(f"dec{i}", _prompt(rng, 64, eng.vocab_size),
                        SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    step_ms = _median_step_ms(eng, sync, steps)
    _drain(eng)
    return step_ms


def _median_step_ms(eng, sync, steps: int) -> float:
    """Median time of `steps` engine steps (device-synchronized), after 4 untimed ones."""
    import statistics
    for _ in range(4):
        eng.step()
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        eng.step()
        sync()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _history_sizes(sc: "EngineScale") -> tuple[int, ...]:
    """History lengths of the one-chat TTFT rows (the 1B quick model's max_model_len is 4k)."""
    return (64, 160) if SMOKE else (2048, 8192) if sc.model_size == "8b" else (2048,)


def _history_turn(eng, sync, history: int, rng) -> tuple[float, float, float, int]:
    """One chat whose `history`-token prompt was pushed out of the device pool (to the host tier,
    by unrelated prompts as long that fill the pool), then its next turn (+64 tokens) beside a
    batch of 8 decoding requests: (its time to first token in s, the batch's median plain decode
    step in ms, the step that admitted the turn in ms: its load overlaps that step, the batch
    goes on; the blocks loaded)."""
    import statistics

    from services.protocol.sampling import SamplingParams
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = _prompt(rng, history, eng.vocab_size)
    fillers = eng.block_manager.num_blocks * eng.config.block_size // history + 1
    for i in range(1 + fillers):
        eng.add_request(f"h{history}-{i}", prompt if i == 0 else _prompt(rng, history, eng.vocab_size), greedy)
        _drain(eng)
    loaded = sum(eng.stats().extra.get("kv_tiers", {}).get("loaded_blocks", {}).values())
    for i in range(8):
        eng.add_request(f"d{history}-{i}", _prompt(rng, 32, eng.vocab_size),
                        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    steps = []
    for _ in range(12):
        sync()
        t = time.perf_counter()
        eng.step()
        sync()
        steps.append(time.perf_counter() - t)
    eng.add_request(f"t{history}", prompt + _prompt(rng, 64, eng.vocab_size), greedy)
    t0, admit_s, ttft = time.perf_counter(), None, None
    while ttft is None and eng.has_unfinished_requests():
        t = time.perf_counter()
        deltas = eng.step()
        sync()
        admit_s = time.perf_counter() - t if admit_s is None else admit_s
        if any(d.request_id == f"t{history}" for d in deltas):
            ttft = time.perf_counter() - t0
    _drain(eng)
    loaded = sum(eng.stats().extra.get("kv_tiers", {}).get("loaded_blocks", {}).values()) - loaded
    return ttft or float("nan"), 1e3 * statistics.median(steps[4:]), 1e3 * admit_s, loaded


def _tier_history_rows(args, model_dir, sync, tiers: dict, deadline) -> None:
    """Per history length: the next turn's TTFT loading the history (policy always) against
    recomputing it (never), and the batch's decode step while the load is under way."""
    import random

    bs, sizes = 16, _history_sizes(args.scale)
    pool = 2 * max(sizes) // bs + 64        # the turn and the batch beside it fit
    ttft = {}
    for policy in ("never", "always"):
        if deadline.left() < 90:
            row("kv_tiers", f"history TTFT policy={policy}", "skipped (time)")
            return
        eng = _tier_engine(args, model_dir, pool, kv_load_policy=policy,
                           **dict(tiers, kv_offload_dir=os.path.join(tiers["kv_offload_dir"], policy)))
        rng = random.Random(2)
        for history in sizes:
            ttft[policy, history], plain_ms, admit_ms, loaded = _history_turn(eng, sync, history, rng)
            if policy == "always":
                row("kv_tiers", f"decode step of 8 while a {history}-token history loads", admit_ms, "ms",
                    f"plain decode step {plain_ms:.2f} ms; the load ({loaded} blocks) overlaps this step")
        eng.close()
        del eng
        empty_cache()
    for history in sizes:
        row("kv_tiers", f"next-turn TTFT after a {history}-token history, recompute / load",
            ttft["never", history] / ttft["always", history], "x",
            f"load {1e3 * ttft['always', history]:.1f} ms, recompute {1e3 * ttft['never', history]:.1f} ms")


def _tier_drain_and_scan(eng, directory: str) -> None:
    """Drain to disk (the device's and host tier's cached blocks, as on SIGTERM) and the start-up
    scan that rebuilds the disk index from those files."""
    from gpu_worker.kv_tiers import disk_restore
    from gpu_worker.kv_tiers.drain_to_disk import drain_to_disk
    tiers = eng.kv_tiers
    result = drain_to_disk(tiers, time.monotonic() + 60)
    nbytes = result.written * tiers.mover.block_bytes
    row("kv_tiers", "drain to disk", nbytes / max(result.seconds, 1e-9) / 1e9, "GB/s",
        f"{result.written} blocks in {result.seconds:.2f} s, {result.left} left")
    t = time.perf_counter()
    found = disk_restore.scan(directory, tiers.layout, tiers.mover.block_bytes)
    seconds = time.perf_counter() - t
    row("kv_tiers", "restart: disk index scan", len(found.blocks) / max(seconds, 1e-9), "files/s",
        f"{len(found.blocks)} files in {seconds:.2f} s (headers only), {found.dropped} dropped")


def section_kv_tiers(args, deadline) -> None:
    """KV tiers (gpu_worker/kv_tiers): copy bandwidth against the pinned ceiling, multi-turn TTFT
    with tiers (policy always / auto) against recompute (never), decode step time with
    offloads running against an engine without tiers."""
    import tempfile

    sc: EngineScale = args.scale
    model_dir = ensure_model(args)
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    users, turns, per_turn = _tier_chat_sizes(sc)
    bs = 16
    # the device pool holds about 1.5 users' final histories: the others' must come from a tier
    pool = 3 * turns * (per_turn + 8) // (2 * bs) + 8
    host_gb = 16.0 if not SMOKE else 0.05
    with tempfile.TemporaryDirectory(prefix="kvmesh-tiers-") as tmp:
        tiers = dict(kv_offload_cpu_gb=host_gb, kv_offload_dir=tmp, kv_offload_disk_gb=2 * host_gb)
        ttft, decisions = {}, {}
        for policy in ("never", "always", "auto"):
            if deadline.left() < 60:
                row("kv_tiers", f"chat policy={policy}", "skipped (time)")
                continue
            # a directory per engine: one would restore the previous one's files (the same chats)
            directory = os.path.join(tmp, policy)
            eng = _tier_engine(args, model_dir, pool, kv_load_policy=policy, **dict(tiers, kv_offload_dir=directory))
            if policy == "always":
                _tier_copy_bandwidth(eng, sync)
            ttft[policy] = _tier_chat_ttft(eng, users, turns, per_turn, deadline)
            stats = eng.stats().extra["kv_tiers"]
            decisions[policy] = stats["decisions"]
            row("kv_tiers", f"chat TTFT per turn, policy={policy}", " ".join(f"{1e3 * t:.1f}" for t in ttft[policy]),
                "ms", f"{users} users x {turns} turns, +{per_turn} tokens a turn, {pool}-block device pool; "
                f"decisions {stats['decisions']}; blocks loaded {stats['loaded_blocks']}, "
                f"offloaded {stats['offloaded_blocks']}")
            if policy == "auto":
                _tier_drain_and_scan(eng, directory)
            eng.close()
            del eng
            empty_cache()
            # the next policy's run must not share the disk with this one's files: their dirty
            # pages would be written back under it (deleted, they are dropped)
            shutil.rmtree(directory, ignore_errors=True)
        if "never" in ttft and "always" in ttft and ttft["always"]:
            last = len(ttft["always"]) - 1
            row("kv_tiers", "last-turn TTFT, recompute / load", ttft["never"][last] / ttft["always"][last], "x",
                f"history {turns * per_turn} tokens")
        if "auto" in ttft and "never" in ttft and "always" in ttft:
            worst = max(a / min(n, l) for a, n, l in zip(ttft["auto"], ttft["never"], ttft["always"]))
            same = next((p for p in ("always", "never") if decisions[p] == decisions["auto"]), None)
            row("kv_tiers", "auto vs the better of always/never, worst turn", worst, "x", "target <= 1.05" + (
                f"; auto decided as {same} did: the gap is between two runs of the same work" if same else ""))
    with tempfile.TemporaryDirectory(prefix="kvmesh-tiers-") as tmp:    # a fresh disk tier
        _tier_history_rows(args, model_dir, sync, dict(tiers, kv_offload_dir=tmp), deadline)
    with tempfile.TemporaryDirectory(prefix="kvmesh-tiers-") as tmp:
        tiers = dict(tiers, kv_offload_dir=tmp)
        if deadline.left() < 60:
            row("kv_tiers", "decode with offload", "skipped (time)")
            return
        batch, steps = (64, 64) if not SMOKE else (4, 16)
        step_ms = {}
        for name, kw in (("without tiers", {}), ("offloading", tiers)):
            eng = _tier_engine(args, model_dir, pool, **kw)
            step_ms[name] = _decode_step_ms(eng, sync, batch, steps)
            offloaded = eng.stats().extra.get("kv_tiers", {}).get("offloaded_blocks", {})
            row("kv_tiers", f"decode step, batch {batch}, {name}", step_ms[name], "ms", f"offloaded {offloaded}")
            eng.close()
            del eng
            empty_cache()
        row("kv_tiers", "decode step with offload / without", step_ms["offloading"] / step_ms["without tiers"], "x",
            "target <= 1.02")


# ============================================================================ main
def _tpot_ms(eng, sync, params_of, batch: int, steps: int) -> float:
    """Median step time of `batch` sequences decoding with params_of(i), after their prefill and
    first tokens (a constrained batch's compiles included there)."""
    import random
    rng = random.Random(2)
    for i in range(batch):
        eng.add_request(f"tpot{i}", _prompt(rng, 64, eng.vocab_size), params_of(i))
    step_ms = _median_step_ms(eng, sync, steps)
    running = len(eng.scheduler.running)
    for rid in list(eng.requests):
        eng.abort_request(rid)
    _drain(eng)
    assert running == batch, f"only {running} of {batch} sequences ran through the timed steps"
    return step_ms


def section_structured(args, deadline) -> None:
    """Constrained decoding: the token mask's cost per decode step, and grammar compile times."""
    import statistics

    from gpu_worker.config import EngineConfig
    from gpu_worker.engine import Engine
    from gpu_worker.structured import GrammarCompilerPool
    from services.protocol.sampling import SamplingParams, StructuredOutput
    from tests.gpu_worker.structured.schema_corpus import LONG_SCHEMA, SCHEMAS

    sc: EngineScale = args.scale
    model_dir = ensure_model(args)
    sizes = dict(model=str(model_dir), max_num_seqs=max(64, sc.max_num_seqs), max_model_len=sc.max_model_len,
                 max_num_batched_tokens=sc.max_num_batched_tokens, async_scheduling=args.async_scheduling)
    if SMOKE:
        cfg = EngineConfig(**sizes, device="cpu", dtype="float32", attention_backend="torch", num_gpu_blocks=1024)
    else:
        cfg = EngineConfig(**sizes, gpu_memory_utilization=args.gpu_mem, dtype="bfloat16",
                           attention_backend=args.attention_backend)
    eng = Engine(cfg)
    eng.freeze_gc()
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    steps = 8 if SMOKE else 64
    schema = StructuredOutput(json_schema=json.dumps(LONG_SCHEMA))
    plain = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 16)
    constrained = SamplingParams(temperature=0.0, max_tokens=4096, structured=schema)
    _tpot_ms(eng, sync, lambda i: plain, 4, 4)          # warm-up: the first steps' one-time costs
    for batch in ((1, 4) if SMOKE else (1, 64)):
        base = _tpot_ms(eng, sync, lambda i: plain, batch, steps)
        masked = _tpot_ms(eng, sync, lambda i: constrained, batch, steps)
        row("structured", f"TPOT batch {batch}: unconstrained", base, "ms")
        row("structured", f"TPOT batch {batch}: JSON schema", masked, "ms",
            f"{100 * (masked / base - 1):+.1f}% (async scheduling {cfg.async_scheduling}: a constrained batch's forward "
            "runs ahead, its draw after the mask)")
        if deadline.left() < 30:
            break
    eng.close()
    pool = GrammarCompilerPool(str(model_dir), eng.vocab_size, eng.eos_token_ids)
    t = time.perf_counter()
    pool.compile(StructuredOutput(json_schema='{"type": "boolean"}'))
    row("structured", "compiler build (tokenizer info) + first compile", 1e3 * (time.perf_counter() - t), "ms")
    for kind in ("cold", "cached"):
        times = []
        for s in SCHEMAS:
            t = time.perf_counter()     # through submit: "cached" is the pool's cache, as served
            pool.submit(StructuredOutput(json_schema=json.dumps(s))).wait()
            times.append(1e3 * (time.perf_counter() - t))
        times.sort()
        row("structured", f"compile {kind}: p50 / p99 over {len(SCHEMAS)} schemas",
            f"{statistics.median(times):.2f} / {times[min(len(times) - 1, int(0.99 * len(times)))]:.2f}", "ms")
    pool.close()


SECTIONS = {"ceilings": section_ceilings, "sustained": section_sustained, "kernels": section_kernels,
            "engine": section_engine, "peers": section_peers, "kv_transfer": section_kv_transfer,
            "kv_tiers": section_kv_tiers, "structured": section_structured}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="ceilings,kernels,engine,peers",
                    help=f"comma-separated, from {','.join(SECTIONS)}")
    ap.add_argument("--model-dir", default=None, help="default /tmp/kvmesh-llama-<size>; made with make-model if missing")
    ap.add_argument("--engine-scale", default="full", choices=sorted(SCALES),
                    help="full: Llama-8B benchmark; quick: a 1B model at short lengths (checks the GPU path)")
    ap.add_argument("--time-budget", type=float, default=520.0, help="seconds for the whole run (sections skip when short)")
    ap.add_argument("--attention-backend", default="triton", choices=("triton", "torch", "auto"))
    ap.add_argument("--gpu-mem", type=float, default=0.6, help="engine gpu_memory_utilization (leaves room for the peer: "
                    "at 0.9 the engine's memory was not all back when transformers ran its 8k prefill)")
    ap.add_argument("--num-requests", type=int, default=None, help="offline throughput requests (default: the scale's)")
    ap.add_argument("--throughput-seconds", type=float, default=90.0, help="time box of the offline run")
    ap.add_argument("--temperature", type=float, default=0.0, help="offline throughput sampling temperature "
                    "(0, greedy: what vLLM's peer run does)")
    ap.add_argument("--sync-scheduling", dest="async_scheduling", action="store_false",
                    help="run the engine without async scheduling (the GPU worker's default is async)")
    ap.add_argument("--sweep", action="store_true", help="also sweep attention tile configs")
    ap.add_argument("--sustained-seconds", type=float, default=2.0,
                    help="the sustained section: seconds of back-to-back products per shape and backend")
    ap.add_argument("--hf-compile-min-s", type=float, default=200.0,
                    help="seconds the budget must still hold for the transformers peer's static cache + "
                    "torch.compile decode (its compile and CUDA-graph capture take one to two minutes)")
    ap.add_argument("--kv-transfer-paths", default="",
                    help="kv_transfer: time only these comma-separated paths (zmq, zmq_streamed, shm, "
                         "shm_streamed, cuda_ipc, nixl); default every path that runs here")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny sizes: test this script")
    args = ap.parse_args(argv)
    global DEV, SMOKE, TUNING
    TUNING = tuning_from_env()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV, SMOKE = "cpu", True
        args.engine_scale = "smoke"
    args.scale = SCALES[args.engine_scale]
    out_dir = Path(os.environ.get("OUT", "/tmp/gpu_bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = Deadline(args.time_budget)
    import triton
    gpu, sms = ("cpu (smoke)", 0)
    if DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu, sms = props.name, props.multi_processor_count
    RESULTS["env"] = {"gpu": gpu, "sms": sms, "torch": torch.__version__,
                      "triton": triton.__version__, "python": sys.version.split()[0], "argv": sys.argv}
    log(f"{gpu}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}")
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        if name not in SECTIONS:
            row("error", name, f"unknown section (choose from {','.join(SECTIONS)})")
            continue
        if deadline.left() < 20:
            row(name, "section", "skipped (time)")
            continue
        log(f"=== {name} (time left {deadline.left():.0f} s)")
        try:
            SECTIONS[name](args, deadline)
        except Exception as exc:
            RESULTS["errors"][name] = traceback.format_exc()
            log(RESULTS["errors"][name])
            row(name, "section", f"ERROR {type(exc).__name__}: {str(exc)[:150]}")
        empty_cache()
        (out_dir / "gpu_bench.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    print("\n" + "=" * 100)
    print(f"{'section':8s} | {'metric':62s} | {'value':>16s} | note")
    print("-" * 100)
    for sec, metric, value, note in ROWS:
        print(f"{sec:8s} | {metric[:62]:62s} | {value:>16s} | {note}")
    print(f"total {time.time() - T0:.0f} s; JSON: {out_dir / 'gpu_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
