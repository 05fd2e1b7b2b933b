#!/usr/bin/env python3
"""Sweep of the split-K GEMV (gpu_worker/kernels/fp8_gemv.py) on the Llama-3.1-8B layer shapes at
decode sizes, against cuBLAS: for each shape (N x K: qkv, o_proj, gate_up, down) x M in {1, 2, 4}
x weight dtype {fp8 e4m3 with per-channel scale, bf16}:

    baseline   bf16: F.linear (cuBLAS);  fp8: fp8_linear (per-token quantize + torch._scaled_mm)
    ours       stage 1: each config family (tile, warps, stages, dot/FMA rows, e4m3 upcast) at
               the split-K that fills the SMs (auto_split_k); stage 2: the best family at other
               split-K values (1 = single pass, /2, x2, x4) and with the two-pass reduction

Every variant is first checked against w8_gemv_ref (rel. error < 1e-2) and, after timing, its
outputs of the last timed replay are checked again (a race in the split-K reduction would show);
each fp8 family also decodes every e4m3 code exactly (a one-hot x) or is left out. Timing: the
weights exist in >= 4 copies totalling > 200 MB of fp8 (> 400 MB bf16), and one CUDA graph calls
the op on every copy twice, so neither L2 (50 MB) nor launch gaps of the host count; median of
7 replays, per call. Kernel compiles run first in parallel worker processes (--jobs; they fill
Triton's disk cache).

Prints per-variant rows, then the table (per shape x M x dtype: cuBLAS us, best ours us, weight
TB/s, best config), the per-layer sums (fp8 GEMV vs bf16 cuBLAS: the batch-1 decode target is
>= 1.5x), and the DEFAULTS / TUNED tables to paste into fp8_gemv.py. Writes $OUT/sweep_gemv.json
(OUT defaults to ./out).

    PYTHONPATH=. python3 bench/sweep_gemv.py                  # the H200 (~60-100 s)
    PYTHONPATH=. python3 bench/sweep_gemv.py --smoke          # CPU, TRITON_INTERPRET=1, toy sizes
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # the repo root (workers too)

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_SHAPES = {"o_proj": (32, 64), "down": (48, 1024)}
MS = (1, 2, 4)
SMOKE_MS = (1, 4)
KINDS = ("fp8", "bf16")
L2_BYTES = 220e6            # weight bytes (fp8) looped over per replay: > 4x the H200's 50 MB L2
REPS, REPLAYS = 2, 7
TOL = 1e-2
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def families(kind: str, M: int = 1):
    """Config families (split_k 0: auto) per weight kind: label -> GemvConfig. FMA rows only for
    M <= 2 (they cost ~4 instructions per weight at M=1, ~6 at M=2, ~11 at M=4: the dots win)."""
    from gpu_worker.kernels.fp8_gemv import GemvConfig as C
    if kind == "fp8":
        fam = {
            "dot64x256": C(64, 256, 0, "last", True, 2, 4, 3),
            "dot64x128": C(64, 128, 0, "last", True, 2, 4, 4),
            "dot128x128w8": C(128, 128, 0, "last", True, 2, 8, 3),
            "dot64x256cvt": C(64, 256, 0, "last", True, 0, 4, 3),
            "fma16x512": C(16, 512, 0, "last", False, 0, 4, 1),
            "fma16x1024": C(16, 1024, 0, "last", False, 0, 4, 1),
        }
    else:
        fam = {
            "dot64x128": C(64, 128, 0, "last", True, 0, 4, 4),
            "dot64x256": C(64, 256, 0, "last", True, 0, 4, 3),
            "dot128x128w8": C(128, 128, 0, "last", True, 0, 8, 3),
            "dot32x256": C(32, 256, 0, "last", True, 0, 4, 3),
            "fma16x256": C(16, 256, 0, "last", False, 0, 4, 1),
            "fma16x512": C(16, 512, 0, "last", False, 0, 4, 1),
        }
    return {k: v for k, v in fam.items() if v.dot or M <= 2}


def auto_split(cfg, N: int, K: int) -> int:
    from gpu_worker.kernels.fp8_gemv import resolve_split
    return resolve_split(cfg._replace(split_k=0), N, K).split_k


def stage2(cfg, N: int, K: int):
    """The best family's other split-K values and reductions: label -> config."""
    nk = math.ceil(K / cfg.block_k)
    s = cfg.split_k
    out = {}
    for s2 in sorted({1, max(1, s // 2), min(nk, 2 * s)} - {s}):
        out[f"split{s2}"] = cfg._replace(split_k=s2)
    if s > 1:
        out[f"split{s}-2pass"] = cfg._replace(reduce="two_pass")
    return out


def cfg_str(cfg) -> str:
    return (f"GemvConfig({cfg.block_n}, {cfg.block_k}, {cfg.split_k}, \"{cfg.reduce}\", {cfg.dot}, "
            f"{cfg.upcast}, {cfg.num_warps}, {cfg.num_stages})")


# ------------------------------------------------------------------------------- compile workers

def compile_jobs(shapes, ms):
    """Distinct kernel variants the sweep will launch (by their constexprs), one example call each."""
    import torch
    from gpu_worker.kernels.fp8_gemv import _plan
    jobs, seen = [], set()
    for N, K in shapes.values():
        for kind in KINDS:
            wdt = torch.float8_e4m3fn if kind == "fp8" else torch.bfloat16
            w = torch.empty(N, K, dtype=wdt, device="meta")
            for M in ms:
                x = torch.empty(M, K, dtype=torch.bfloat16, device="meta")
                for fam in families(kind, M).values():
                    base = fam._replace(split_k=auto_split(fam, N, K))
                    for cfg in [base, *stage2(base, N, K).values()]:
                        plan = _plan(x, w, cfg)
                        key = (kind, tuple(sorted(plan.kw.items())), plan.mode == 1 and max(2, M))
                        if key not in seen:
                            seen.add(key)
                            jobs.append((N, K, kind, M, list(cfg)))
    return jobs


def run_worker(path: str) -> None:
    """--worker JOBS.json: compile (by launching once) each job's kernel; errors are reported."""
    import torch
    from gpu_worker.kernels.fp8_gemv import GemvConfig, w8_gemv
    weights = {}
    for N, K, kind, M, cfg in json.load(open(path)):
        try:
            if (N, K, kind) not in weights:
                wdt = torch.float8_e4m3fn if kind == "fp8" else torch.bfloat16
                weights[(N, K, kind)] = torch.zeros(N, K, dtype=torch.uint8, device="cuda").view(wdt) \
                    if kind == "fp8" else torch.zeros(N, K, dtype=wdt, device="cuda")
            w = weights[(N, K, kind)]
            x = torch.zeros(M, K, dtype=torch.bfloat16, device="cuda")
            s = torch.ones(N, device="cuda") if kind == "fp8" else None
            w8_gemv(x, w, s, config=GemvConfig(*cfg))
        except Exception as e:
            print(f"worker: compile failed {kind} M={M} {N}x{K} {cfg}: {type(e).__name__}: {e}"[:400], flush=True)
    torch.cuda.synchronize()


def precompile(shapes, ms, jobs_n: int, deadline: float) -> None:
    """Fill Triton's disk cache from worker processes; stragglers past `deadline` are stopped
    (whatever they did not compile compiles on first use here)."""
    jobs = compile_jobs(shapes, ms)
    n = max(1, min(jobs_n, len(jobs)))
    log(f"precompiling {len(jobs)} kernel variants in {n} worker processes")
    tmp = Path(tempfile.mkdtemp(prefix="sweep_gemv_"))
    procs = []
    for i in range(n):
        p = tmp / f"jobs{i}.json"
        p.write_text(json.dumps(jobs[i::n]))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(p)]))
    for pr in procs:
        try:
            pr.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            log(f"precompile worker {pr.pid} still running at the deadline: stopped")
            pr.kill()
            pr.wait()
    bad = sum(pr.returncode != 0 for pr in procs)
    log(f"precompile done ({bad} workers failed)" if bad else "precompile done")


# ------------------------------------------------------------------------------------- measuring

class Timer:
    def __init__(self, smoke: bool):
        self.smoke = smoke

    def __call__(self, fn, copies: int):
        """Median us per call of fn(i) over copies i; returns (us, outputs of the last rep)."""
        import torch
        if self.smoke:                      # the interpreter: one pass, wall time (meaningless)
            t = time.perf_counter()
            outs = [fn(i) for i in range(copies)]
            return (time.perf_counter() - t) * 1e6 / copies, outs
        from cuda_timing import event_median_ms      # bench/, the script's folder (imports torch)
        for i in range(copies):
            fn(i)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = [fn(i) for _ in range(REPS) for i in range(copies)]
        us = event_median_ms(g.replay, REPLAYS, warmup=1) * 1e3 / (REPS * copies)
        last = [o.clone() for o in outs[-copies:]]
        del g, outs
        return us, last


def rel_err(y, ref) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def exact_codes(kind_families, dev, xdt):
    """fp8 families that decode every finite e4m3 code exactly (a one-hot x, unit scales)."""
    import torch
    from gpu_worker.kernels.fp8_gemv import w8_gemv
    codes = torch.arange(256)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)
    ok = {}
    for label, fam in kind_families.items():
        K = fam.block_k
        wc = torch.zeros(256, K, dtype=torch.uint8)
        wc[: codes.numel(), 3] = codes
        wc = wc.view(torch.float8_e4m3fn).to(dev)
        x = torch.zeros(1, K, dtype=xdt, device=dev)
        x[0, 3] = 1
        try:
            y = w8_gemv(x, wc, torch.ones(256, device=dev), config=fam._replace(split_k=1))[0].float()
            bad = int((y != wc[:, 3].float()).sum())
        except Exception as e:
            log(f"codes check {label}: {type(e).__name__}: {e}"[:300])
            bad = -1
        ok[label] = bad == 0
        if bad:
            log(f"codes check {label}: {bad} e4m3 codes decoded wrongly -> left out")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, toy sizes")
    ap.add_argument("--time-budget", type=float, default=110.0, help="seconds; later variants are skipped")
    ap.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                    help="parallel compile workers (0: compile in this process)")
    ap.add_argument("--shapes", default="", help="comma list of shape names (default all)")
    ap.add_argument("--ms", default="", help="comma list of M (default 1,2,4)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_worker(args.worker)
        return
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as F
    from gpu_worker.kernels import fp8_gemv as G
    from gpu_worker.kernels.fp8_linear import fp8_linear, quantize_weight_fp8

    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    shapes = SMOKE_SHAPES if smoke else SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else (SMOKE_MS if smoke else MS)
    xdt = torch.float32 if smoke else torch.bfloat16    # interpreter: fp32 holding bf16 values
    end = T0 + args.time_budget
    out_dir = Path(os.environ.get("OUT", "./out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not smoke:
        p = torch.cuda.get_device_properties(0)
        log(f"{p.name}, {p.multi_processor_count} SMs; torch {torch.__version__}; "
            f"triton {__import__('triton').__version__}")
        if p.multi_processor_count != G.SM_COUNT:
            log(f"note: fp8_gemv.SM_COUNT = {G.SM_COUNT}, this GPU has {p.multi_processor_count} SMs")
        if args.jobs > 0:
            precompile(shapes, ms, args.jobs, T0 + 0.4 * args.time_budget)

    timer = Timer(smoke)
    codes_ok = {"fp8": exact_codes(families("fp8"), dev, xdt), "bf16": {k: True for k in families("bf16")}}
    rows, results = [], {}
    skipped = 0

    def variant(name, kind, label, cfg, x, ws, refs, copies, N, K, M, stage):
        nonlocal skipped
        rec = dict(shape=name, N=N, K=K, M=M, kind=kind, variant=label, stage=stage,
                   config=list(cfg), us=None, tbs=None, err=None, ok=False, note="")
        rows.append(rec)
        if time.time() > end:
            rec["note"] = "skipped (time budget)"
            skipped += 1
            return rec
        scale = (lambda i: ws[i][1]) if kind == "fp8" else (lambda i: None)
        fn = lambda i: G.w8_gemv(x, ws[i][0], scale(i), config=cfg)     # noqa: E731
        try:
            t = time.time()
            err = rel_err(fn(0), refs[0])
            compile_s = time.time() - t
            rec["err"] = err
            if not err < TOL:
                rec["note"] = f"WRONG rel err {err:.2e}"
            else:
                us, outs = timer(fn, copies)
                err2 = max(rel_err(o, r) for o, r in zip(outs, refs))
                rec.update(us=us, tbs=N * K * (1 if kind == "fp8" else 2) / (us * 1e-6) / 1e12, err=max(err, err2))
                rec["ok"] = err2 < TOL and codes_ok[kind].get(label.split("/")[0], True)
                if err2 >= TOL:
                    rec["note"] = f"WRONG after graph replays: rel err {err2:.2e}"
                elif not rec["ok"]:
                    rec["note"] = "inexact e4m3 decode"
            if compile_s > 2:
                rec["note"] += f" (first call {compile_s:.1f} s)"
        except Exception as e:
            rec["note"] = f"ERROR {type(e).__name__}: {e}"[:200]
            traceback.print_exc()
        log(f"{name:8s} M={M} {kind:4s} {label:26s} split={cfg.split_k:<3d} "
            + (f"{rec['us']:8.2f} us {rec['tbs']:5.2f} TB/s" if rec["us"] else f"{'-':>8s}   ") + f" err {rec['err'] if rec['err'] is None else format(rec['err'], '.1e')} {rec['note']}")
        return rec

    for name, (N, K) in shapes.items():
        if time.time() > end:
            log(f"{name}: skipped (time budget)")
            continue
        copies = 1 if smoke else max(4, math.ceil(L2_BYTES / (N * K)))
        gen = torch.Generator(device=dev).manual_seed(0)
        wb = [(torch.randn(N, K, device=dev, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        if smoke:
            wb = [w.float() for w in wb]                 # interpreter: fp32 holding bf16 values
        wq = [quantize_weight_fp8(w) for w in wb]
        per_kind = {"fp8": [(q.weight, q.scale) for q in wq], "bf16": [(w, None) for w in wb]}
        for M in ms:
            x = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16).to(xdt)
            for kind in KINDS:
                ws = per_kind[kind]
                refs = [G.w8_gemv_ref(x, w, s).float() for w, s in ws]
                # baseline
                if kind == "bf16":
                    base_fn = lambda i: F.linear(x, ws[i][0])                      # noqa: E731
                else:
                    base_fn = lambda i: fp8_linear(x, G_Fp8Weight(*ws[i]))         # noqa: E731
                try:
                    base_us, _ = timer(base_fn, copies) if time.time() < end else (None, None)
                except Exception as e:
                    base_us = None
                    log(f"baseline {kind} failed: {type(e).__name__}: {e}"[:300])
                key = (name, M, kind)
                results[key] = dict(base_us=base_us, variants=[])
                if base_us:
                    log(f"{name:8s} M={M} {kind:4s} {'cuBLAS':26s}           {base_us:8.2f} us "
                        f"{N * K * (1 if kind == 'fp8' else 2) / (base_us * 1e-6) / 1e12:5.2f} TB/s")
                # stage 1: families at the auto split
                fams = families(kind, M)
                stage1 = []
                for label, fam in fams.items():
                    cfg = fam._replace(split_k=auto_split(fam, N, K))
                    stage1.append((label, variant(name, kind, label, cfg, x, ws, refs, copies, N, K, M, 1)))
                good = [(lab, r) for lab, r in stage1 if r["ok"]]
                if good:
                    blab, brec = min(good, key=lambda t: t[1]["us"])
                    bcfg = G.GemvConfig(*brec["config"])
                    for lab2, cfg2 in stage2(bcfg, N, K).items():
                        variant(name, kind, f"{blab}/{lab2}", cfg2, x, ws, refs, copies, N, K, M, 2)
                    # the best family of the other row handling (dot / FMA) as one pass (split 1)
                    other = [(lab, r) for lab, r in good if r["config"][4] != bcfg.dot and r["config"][2] != 1]
                    if other:
                        olab, orec = min(other, key=lambda t: t[1]["us"])
                        ocfg = G.GemvConfig(*orec["config"])._replace(split_k=1)
                        variant(name, kind, f"{olab}/split1", ocfg, x, ws, refs, copies, N, K, M, 2)
                results[key]["variants"] = [r for r in rows if (r["shape"], r["M"], r["kind"]) == key]
        del wb, wq, per_kind
        if not smoke:
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------------------------- report
    def best(key):
        ok = [r for r in results.get(key, {}).get("variants", []) if r["ok"]]
        return min(ok, key=lambda r: r["us"]) if ok else None

    print("\n" + "=" * 118)
    print(f"{'shape':8s} {'N x K':>12s} {'M':>2s} {'dtype':5s} | {'cuBLAS us':>9s} {'TB/s':>5s} | {'ours us':>8s} {'TB/s':>5s} "
          f"{'vs cuBLAS':>9s} {'vs bf16 cuBLAS':>14s} | best config")
    for (name, M, kind), res in results.items():
        N, K = shapes[name]
        b = best((name, M, kind))
        wbytes = N * K * (1 if kind == "fp8" else 2)
        base = res["base_us"]
        bf16_base = results.get((name, M, "bf16"), {}).get("base_us")
        base_s = f"{base:9.2f} {wbytes / (base * 1e-6) / 1e12:5.2f}" if base else f"{'-':>9s} {'-':>5s}"
        if b:
            vs = f"{base / b['us']:8.2f}x" if base else f"{'-':>9s}"
            vs16 = f"{bf16_base / b['us']:13.2f}x" if bf16_base else f"{'-':>14s}"
            cfg = G.GemvConfig(*b["config"])
            print(f"{name:8s} {N:>5d}x{K:<6d} {M:>2d} {kind:5s} | {base_s} | {b['us']:8.2f} {b['tbs']:5.2f} {vs} {vs16} | "
                  f"{b['variant']}: {cfg_str(cfg)}")
        else:
            print(f"{name:8s} {N:>5d}x{K:<6d} {M:>2d} {kind:5s} | {base_s} | {'none passed':>8s}")
    print("\nPer decoder layer (sum of the shapes timed), us:")
    for M in ms:
        sums = {}
        for label, kind, which in (("bf16 cuBLAS", "bf16", "base"), ("fp8 _scaled_mm", "fp8", "base"),
                                   ("bf16 GEMV", "bf16", "ours"), ("fp8 GEMV", "fp8", "ours")):
            vals = []
            for name in shapes:
                if which == "base":
                    vals.append(results.get((name, M, kind), {}).get("base_us"))
                else:
                    b = best((name, M, kind))
                    vals.append(b["us"] if b else None)
            sums[label] = sum(vals) if all(v for v in vals) else None
        txt = "  ".join(f"{k} {v:7.1f}" if v else f"{k} -" for k, v in sums.items())
        ratio = (f"  -> fp8 GEMV / bf16 cuBLAS speedup {sums['bf16 cuBLAS'] / sums['fp8 GEMV']:.2f}x (target 1.5x)"
                 if sums["bf16 cuBLAS"] and sums["fp8 GEMV"] else "")
        print(f"  M={M}: {txt}{ratio}")

    # paste-able tables: exact shapes, and per (kind, M bucket) the family with the best
    # geometric-mean slowdown against each case's best (its split from auto_split_k)
    print("\n# ---- paste into gpu_worker/kernels/fp8_gemv.py " + "-" * 50)
    print("TUNED: dict[tuple[str, int, int, int], GemvConfig] = {")
    tuned = {}
    for (name, M, kind) in results:
        b = best((name, M, kind))
        if b:
            N, K = shapes[name]
            wk = "fp8" if kind == "fp8" else "16bit"
            tuned[(wk, M, N, K)] = b
            print(f"    (\"{wk}\", {M}, {N}, {K}): {cfg_str(G.GemvConfig(*b['config']))},"
                  f"  # {name} {b['us']:.2f} us {b['tbs']:.2f} TB/s")
    print("}")
    print("DEFAULTS: dict[tuple[str, int], GemvConfig] = {")
    defaults = {}
    for kind in KINDS:
        wk = "fp8" if kind == "fp8" else "16bit"
        for mb in (1, 2, 4, 8):
            m_src = max([m for m in ms if m <= mb] or [min(ms)])
            score = {}
            for label in families(kind):
                rs = []
                for name in shapes:
                    b = best((name, m_src, kind))
                    mine = [r for r in rows if (r["shape"], r["M"], r["kind"], r["variant"]) == (name, m_src, kind, label) and r["ok"]]
                    if b and mine:
                        rs.append(mine[0]["us"] / b["us"])
                if rs and len(rs) == len(shapes):
                    score[label] = math.exp(sum(map(math.log, rs)) / len(rs))
            if score:
                lab = min(score, key=score.get)
                cfg = families(kind)[lab]
                defaults[(wk, mb)] = (lab, score[lab])
                print(f"    (\"{wk}\", {mb}): {cfg_str(cfg)},  # {lab}, geo-mean {score[lab]:.2f}x of best (M={m_src})")
    print("}")
    print("# " + "-" * 96)

    doc = dict(device="cpu (smoke)" if smoke else torch.cuda.get_device_name(0), smoke=smoke,
               torch=torch.__version__, triton=__import__("triton").__version__,
               shapes=shapes, ms=list(ms), reps=REPS, replays=REPLAYS, l2_bytes=L2_BYTES,
               rows=rows, baselines=[dict(shape=k[0], M=k[1], kind=k[2], us=v["base_us"]) for k, v in results.items()],
               tuned={f"{k[0]},{k[1]},{k[2]},{k[3]}": dict(variant=v["variant"], config=v["config"], us=v["us"], tbs=v["tbs"])
                      for k, v in tuned.items()},
               defaults={f"{k[0]},{k[1]}": dict(family=v[0], geo_mean=v[1]) for k, v in defaults.items()},
               skipped=skipped, seconds=time.time() - T0)
    (out_dir / "sweep_gemv.json").write_text(json.dumps(doc, indent=1, default=str))
    log(f"wrote {out_dir / 'sweep_gemv.json'}; {skipped} variants skipped; total {time.time() - T0:.0f} s")


def G_Fp8Weight(w, s):
    from gpu_worker.kernels.fp8_linear import Fp8Weight
    return Fp8Weight(w, s)


if __name__ == "__main__":
    main()
