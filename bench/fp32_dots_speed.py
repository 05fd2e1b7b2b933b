#!/usr/bin/env python3
"""What the attention kernels' fp32 dot precision costs: fresh-prompt prefill attention
(8 x 2k tokens, the engine's 16,384-token step) and paged decode attention (64 rows at 2k of
context) on fp32 q / K / V with Llama-3.1-8B's heads (32 q, 8 kv, head_dim 128), once per
precision of `kernels/_paged_kv.F32_DOTS` (tf32: one TF32 product; tf32x3, the default: three;
ieee: fp32 FMAs), and the same kernels on bf16 for scale. Each precision runs in a child process
that sets F32_DOTS in the kernel modules before anything compiles (Triton reads the global at
compile time). Prints per case: median ms (CUDA events around one call), TFLOP/s for prefill or
GB/s of K/V read for decode, and the output's error against the fp32 torch reference
(max |out - ref| / std(ref)).

    python3 bench/fp32_dots_speed.py           # H200, ~1 min; writes $OUT/fp32_dots_speed.json

--smoke: on the CPU under TRITON_INTERPRET=1 at toy sizes (checks this script; numbers mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"                      # before triton is imported

PRECISIONS = ("tf32", "tf32x3", "ieee")


def set_f32_dots(precision: str) -> None:
    """F32_DOTS in every loaded kernel module that holds it (each imported the name itself), after
    importing the two kernels measured here and what they import."""
    import triton.language as tl

    import gpu_worker.kernels.fresh_prefill_attention  # noqa: F401
    import gpu_worker.kernels.paged_decode_attention  # noqa: F401
    for name, mod in list(sys.modules.items()):
        if name.startswith("gpu_worker.kernels.") and hasattr(mod, "F32_DOTS"):
            mod.F32_DOTS = tl.constexpr(precision)


def measure(dtype_name: str, smoke: bool) -> dict:
    """Both cases in one dtype under the F32_DOTS already set: {case: {ms, rate, err}}."""
    import torch

    from gpu_worker.kernels.fresh_prefill_attention import fresh_prefill_attention, fresh_prefill_attention_ref
    from gpu_worker.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
    dev = "cpu" if smoke else "cuda"
    dt = getattr(torch, dtype_name)
    H, KVH, D, page = (8, 2, 32, 16) if smoke else (32, 8, 128, 16)
    n_pre, L, n_dec, ctx = (2, 24, 3, 40) if smoke else (8, 2048, 64, 2048)
    g = torch.Generator(device=dev).manual_seed(0)
    scale = D ** -0.5

    def timed(fn) -> float:
        if smoke:
            fn()
            return float("nan")
        from cuda_timing import event_median_ms           # bench/, this script's folder
        return event_median_ms(fn, reps=10, warmup=3)

    def err(out, ref) -> float:
        return float((out.float() - ref.float()).abs().max() / ref.float().std())

    res = {}
    # fresh prefill: n_pre prompts of L tokens, causal
    T = n_pre * L
    q = torch.randn(T, H, D, device=dev, generator=g).to(dt)
    k = torch.randn(T, KVH, D, device=dev, generator=g).to(dt)
    v = torch.randn(T, KVH, D, device=dev, generator=g).to(dt)
    qsl = torch.arange(0, T + 1, L, device=dev, dtype=torch.int32)
    out = fresh_prefill_attention(q, k, v, qsl, scale, max_query_len=L)
    ref = fresh_prefill_attention_ref(q.float(), k.float(), v.float(), qsl, scale)
    ms = timed(lambda: fresh_prefill_attention(q, k, v, qsl, scale, max_query_len=L, out=out))
    flops = 4 * H * D * n_pre * L * (L + 1) / 2                  # causal: row i sees i + 1 keys
    res[f"prefill {n_pre} x {L}"] = {"ms": ms, "tflops": flops / ms / 1e9, "err": err(out, ref)}
    # paged decode: n_dec rows, each over ctx keys in shuffled pages
    per = -(-ctx // page)
    blocks = n_dec * per
    kc = torch.randn(blocks, page, KVH, D, device=dev, generator=g).to(dt)
    vc = torch.randn(blocks, page, KVH, D, device=dev, generator=g).to(dt)
    tables = torch.randperm(blocks, device=dev, generator=g).int().view(n_dec, per).contiguous()
    lens = torch.full((n_dec,), ctx, device=dev, dtype=torch.int32)
    qd = torch.randn(n_dec, H, D, device=dev, generator=g).to(dt)
    out = paged_decode_attention(qd, kc, vc, tables, lens, scale, max_context_len=ctx)
    ref = paged_decode_attention_ref(qd.float(), kc.float(), vc.float(), tables, lens, scale)
    ms = timed(lambda: paged_decode_attention(qd, kc, vc, tables, lens, scale, max_context_len=ctx, out=out))
    kv_bytes = 2 * n_dec * ctx * KVH * D * kc.element_size()
    res[f"decode {n_dec} x {ctx}"] = {"ms": ms, "gbps": kv_bytes / ms / 1e6, "err": err(out, ref)}
    return res


def child(precision: str, smoke: bool) -> None:
    set_f32_dots(precision)
    rows = {"float32": measure("float32", smoke)}
    if precision == "tf32x3":                                 # bf16 ignores F32_DOTS: once is enough
        # (--smoke runs that row in fp32 too: the interpreter's bf16 arithmetic is wrong)
        rows["bfloat16"] = measure("float32" if smoke else "bfloat16", smoke)
    print("RESULT " + json.dumps({"precision": precision, "rows": rows}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, toy sizes")
    ap.add_argument("--child", choices=PRECISIONS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.smoke)
    path = [str(ROOT), str(ROOT / "bench")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    results = []
    for precision in PRECISIONS:
        print(f"[fp32_dots_speed] F32_DOTS={precision} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--child", precision] + (["--smoke"] if args.smoke else [])
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode != 0 or not lines:
            sys.exit(f"F32_DOTS={precision} failed (rc {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fp32_dots_speed.json").write_text(json.dumps(results, indent=1))
    print(f"{'dtype':9} {'F32_DOTS':8} {'case':16} {'ms':>8} {'rate':>16} {'max err/std':>12}")
    for r in results:
        for dtype, cases in r["rows"].items():
            for case, m in cases.items():
                rate = f"{m['tflops']:.1f} TFLOP/s" if "tflops" in m else f"{m['gbps']:.0f} GB/s"
                dots = r["precision"] if dtype == "float32" else "-"
                print(f"{dtype:9} {dots:8} {case:16} {m['ms']:8.3f} {rate:>16} {m['err']:12.2e}")


if __name__ == "__main__":
    main()
