"""FP8 (e4m3) KV cache decode attention vs the bf16 cache: each fp8 upcast variant, then tiles.

One GPU call (H200, well under 90 s with the default --time-budget), from the repository root:

    PYTHONPATH=. python3 bench/sweep_fp8_decode.py            # writes $OUT/sweep_fp8_decode.json

Llama-8B attention heads (32 q, 8 kv, head_dim 128), page 16, shuffled block tables; B in {1, 64}
x context in {128, 8k, 32k}:
  0. probe: each upcast of paged_decode_attention on all 256 e4m3 bytes, exact vs plain torch
  1. the bf16 cache with today's defaults, then the same values stored in e4m3 (scale 1/16) read
     with each fp8_upcast ("bf16" = today's fp8 path, "f16", "f16_bits", "f16_asm"); every output
     is checked first (rel. error ||out-ref|| / ||ref|| < 1e-2 against the fp32 maths on the SAME
     cache values, sequences 0, 1, B-2, B-1, and no NaN anywhere), only then timed
  2. time permitting: a few (block_n, num_warps, num_stages) for each case's best fp8 upcast
Times are the median per call of CUDA-graph replays (device time, as a graph-captured decode step
sees it); GB/s counts the KV bytes read (2 x B x ctx x kv_heads x head_dim x bytes/element).
The short table (bf16 us, best fp8 us, fp8/bf16, best variant) is printed last.

--smoke: on the CPU under TRITON_INTERPRET=1 at toy sizes (fp32 instead of bf16, wall-clock
times): checks this script, its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from anywhere in the repo

from cuda_timing import event_median_ms, graph_median_ms  # noqa: E402  (bench/, the script's folder)

T0 = time.time()
UPCASTS = ("bf16", "f16", "f16_bits", "f16_asm")
# (block_n, num_warps, num_stages) tried for each case's best upcast, besides the defaults
TILES = ((32, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3), (128, 4, 4), (256, 8, 2))
MAX_ERR = 1e-2


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


class Sweep:
    def __init__(self, args):
        import torch

        import gpu_worker.kernels.paged_decode_attention as pda
        self.torch, self.pda, self.args = torch, pda, args
        self.smoke = args.smoke
        self.dev = "cpu" if self.smoke else "cuda"
        self.dtype = torch.float32 if self.smoke else torch.bfloat16   # the interpreter's bf16 is wrong
        self.end = T0 + args.time_budget
        if self.smoke:
            self.H, self.KVH, self.D, self.page = 8, 2, 64, 16
            self.cases = [(3, 17), (1, 100), (3, 100), (1, 17)]
            self.tiles = ((16, 4, 2), (32, 4, 2))
        else:
            self.H, self.KVH, self.D, self.page = 32, 8, 128, 16
            # headline case first, then those that need no new compiles (one split); later ones are
            # skipped if the budget runs out
            self.cases = [(64, 8192), (64, 32768), (64, 128), (1, 128), (1, 32768), (1, 8192)]
            self.tiles = TILES
        self.kept: dict = {}      # (B, ctx) -> fp8 cache + inputs, for the tile phase
        self.results: dict = {"args": vars(args), "heads": [self.H, self.KVH, self.D, self.page],
                              "module_default_fp8_upcast": pda.FP8_UPCAST, "probe": {}, "cases": {},
                              "errors": {}}
        if not self.smoke:
            self.results.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                triton=__import__("triton").__version__)

    # ------------------------------------------------------------------ helpers
    def left(self) -> float:
        return self.end - time.time()

    def sync(self):
        if self.dev == "cuda":
            self.torch.cuda.synchronize()

    def time_events(self, fn, warmup: int = 2, reps: int = 9) -> float:
        """Median ms of fn() by CUDA events (wall clock once in --smoke)."""
        if self.smoke:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return event_median_ms(fn, reps, warmup)

    def time_graph(self, fn) -> float:
        """Median ms of one fn() replayed from a CUDA graph of `inner` back-to-back calls (inner
        sized from an eager estimate so that a replay is a few ms): no launch overhead."""
        if self.smoke:
            return self.time_events(fn)
        est = self.time_events(fn, warmup=1, reps=3)
        inner = int(min(50, max(3, round(3.0 / max(est, 1e-3)))))
        return graph_median_ms(fn, inner, reps=9)

    @staticmethod
    def rel_err(out, ref) -> float:
        out, ref = out.double(), ref.double()
        return float((out - ref).norm() / ref.norm().clamp_min(1e-30))

    def paged_cache(self, B: int, ctx: int, seed: int):
        """(k, v, tables): B sequences of ctx tokens in exactly the blocks they need, shuffled."""
        torch = self.torch
        g = torch.Generator(device=self.dev).manual_seed(seed)
        nb = (ctx + self.page - 1) // self.page
        perm = torch.randperm(B * nb, device=self.dev, generator=g).to(torch.int32)
        tables = perm.view(B, nb).contiguous()
        shape = (B * nb, self.page, self.KVH, self.D)
        k = torch.randn(shape, device=self.dev, dtype=self.dtype, generator=g)
        v = torch.randn(shape, device=self.dev, dtype=self.dtype, generator=g)
        return k, v, tables

    def call(self, inp: dict, **kw):
        return self.pda.paged_decode_attention(inp["q"], inp["k"], inp["v"], inp["tables"], inp["cl"],
                                               self.D ** -0.5, max_context_len=inp["ctx"], k_scale=inp["ks"],
                                               v_scale=inp["vs"], num_splits=inp["splits"], **kw)

    def check(self, inp: dict, ref, **kw) -> tuple[float, bool]:
        out = self.call(inp, **kw)
        self.sync()
        err = self.rel_err(out[inp["idx"]], ref)
        nan = bool(self.torch.isnan(out).any())
        return err, (err < MAX_ERR and not nan)

    def measure(self, inp: dict, ref, nbytes: int, **kw) -> dict:
        """Check, then time one configuration -> {us, gbps, err, ok} (or {error})."""
        try:
            err, ok = self.check(inp, ref, **kw)
            rec = {"err": err, "ok": ok}
            if ok:
                ms = self.time_graph(lambda: self.call(inp, **kw))
                rec.update(us=ms * 1e3, gbps=nbytes / (ms * 1e-3) / 1e9)
        except Exception as exc:                              # a compile failure, out of resources, ...
            rec = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
        return rec

    @staticmethod
    def fmt(rec: dict | None) -> str:
        if not rec:
            return "-"
        if "error" in rec:
            return "ERROR"
        if not rec.get("ok"):
            return f"WRONG (err {rec['err']:.1e})" if "err" in rec else rec.get("skipped", "-")
        return f"{rec['us']:.1f} us {rec['gbps']:.0f} GB/s (err {rec['err']:.1e})"

    def write(self):
        self.results["elapsed_s"] = time.time() - T0
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep_fp8_decode.json").write_text(json.dumps(self.results, indent=1, default=str))

    # ------------------------------------------------------------------ phases
    def probe(self):
        """Each upcast on all 256 e4m3 bytes vs plain torch (NaN codes excluded): exact or not."""
        torch, pda = self.torch, self.pda
        x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(self.dev)
        finite = ~torch.isnan(x.float())
        for name in ("f16", "f16_bits", "f16_asm"):
            if self.smoke and name == "f16_asm":
                self.results["probe"][name] = "n/a (interp.)"
                continue
            try:
                got = pda.fp8_upcast_probe(x, name)[finite]
                want = pda.fp8_upcast_probe_ref(x, name)[finite]
                bad = int((got != want).sum())
                self.results["probe"][name] = "exact" if bad == 0 else f"MISMATCH on {bad} bytes"
            except Exception as exc:
                self.results["probe"][name] = f"error {type(exc).__name__}: {str(exc)[:200]}"
            log(f"probe {name:9s} {self.results['probe'][name]}")

    def run_case(self, B: int, ctx: int):
        torch, pda = self.torch, self.pda
        key = f"B={B} ctx={ctx}"
        res = self.results["cases"][key] = {"B": B, "ctx": ctx, "fp8": {}}
        k, v, tables = self.paged_cache(B, ctx, seed=B * 100003 + ctx)
        q = torch.randn(B, self.H, self.D, device=self.dev, dtype=self.dtype)
        cl = torch.full((B,), ctx, dtype=torch.int32, device=self.dev)
        splits = pda.choose_num_splits(B, self.KVH, ctx, q.device)
        if self.smoke and B == 1:
            splits = 3                                      # exercise split-K at toy sizes
        res["num_splits"] = splits
        res["default_tiles"] = "block_n 128, 4 warps, 3 stages" if splits > 1 else "block_n 64, 4 warps, 2 stages"
        idx = sorted({0, min(1, B - 1), max(0, B - 2), B - 1})
        inp = dict(q=q, k=k, v=v, tables=tables, cl=cl, ctx=ctx, ks=1.0, vs=1.0, splits=splits,
                   idx=torch.tensor(idx, device=self.dev))
        scale = self.D ** -0.5
        elems = 2 * B * ctx * self.KVH * self.D
        # bf16 cache, today's defaults
        ref = pda.paged_decode_attention_ref(q[idx].float(), k, v, tables[idx], cl[idx], scale)
        res["bf16_cache"] = rec = self.measure(inp, ref, elems * k.element_size())
        log(f"{key:18s} bf16 cache      {self.fmt(rec)}")
        # the same values in e4m3, stored = value * 16 (|value| < ~6: far from 448)
        f8 = torch.float8_e4m3fn
        kc, vc = (k * 16).to(f8), (v * 16).to(f8)
        del k, v, inp["k"], inp["v"]
        self.empty_cache()
        inp.update(k=kc, v=vc, ks=1 / 16, vs=1 / 16)
        ref = pda.paged_decode_attention_ref(q[idx].float(), kc, vc, tables[idx], cl[idx], scale,
                                             k_scale=1 / 16, v_scale=1 / 16)
        for name in UPCASTS:
            if self.smoke and name == "f16_asm":
                res["fp8"][name] = {"skipped": "n/a (interp.)"}
                continue
            if self.left() < 6:
                res["fp8"][name] = {"skipped": "time"}
                continue
            if str(self.results["probe"].get(name, "exact")) != "exact":
                res["fp8"][name] = {"skipped": f"probe: {self.results['probe'][name]}"}
                continue
            res["fp8"][name] = rec = self.measure(inp, ref, elems, fp8_upcast=name)
            log(f"{key:18s} fp8 {name:9s}   {self.fmt(rec)}")
        self.kept[key] = (inp, ref, elems)

    def run_tiles(self, key: str):
        """A few tiles for this case's best upcast (each checked, then timed)."""
        res = self.results["cases"][key]
        best = self.best_upcast(res)
        if best is None:
            return
        inp, ref, elems = self.kept[key]
        res["tiles"] = []
        for bn, nw, ns in self.tiles:
            if self.left() < 5:
                res["tiles_skipped"] = "time"
                break
            rec = self.measure(inp, ref, elems, fp8_upcast=best, block_n=bn, num_warps=nw, num_stages=ns)
            rec.update(fp8_upcast=best, block_n=bn, num_warps=nw, num_stages=ns)
            res["tiles"].append(rec)
            log(f"{key:18s} fp8 {best:9s} bn={bn:3d} w={nw} s={ns}  {self.fmt(rec)}")

    @staticmethod
    def best_upcast(res: dict) -> str | None:
        ok = {n: r["us"] for n, r in res["fp8"].items() if r.get("ok") and "us" in r}
        return min(ok, key=ok.get) if ok else None

    def empty_cache(self):
        if self.dev == "cuda":
            self.torch.cuda.empty_cache()

    # ------------------------------------------------------------------ summary
    def summarize(self):
        rows = []
        ratios: dict[str, list[float]] = {n: [] for n in UPCASTS}
        complete = {n: True for n in UPCASTS}      # measured in every case that has a bf16 time and an fp8 one
        for key, res in self.results["cases"].items():
            bf = res.get("bf16_cache", {})
            cands = [(r["us"], n, "default tiles") for n, r in res["fp8"].items() if r.get("ok") and "us" in r]
            cands += [(r["us"], r["fp8_upcast"], f"bn={r['block_n']} w={r['num_warps']} s={r['num_stages']}")
                      for r in res.get("tiles", []) if r.get("ok") and "us" in r]
            if bf.get("ok") and cands:
                for n in UPCASTS:
                    r = res["fp8"].get(n, {})
                    if r.get("ok") and "us" in r:
                        ratios[n].append(r["us"] / bf["us"])
                    else:
                        complete[n] = False
            best = min(cands) if cands else None
            res["best"] = None if best is None else {"us": best[0], "fp8_upcast": best[1], "tiles": best[2],
                                                    "ratio_vs_bf16": best[0] / bf["us"] if bf.get("ok") else None}
            rows.append((key, bf.get("us"), best))
        geo = {n: math.exp(sum(map(math.log, r)) / len(r)) for n, r in ratios.items() if r}
        usable = {n: g for n, g in geo.items() if complete[n]}
        self.results["geomean_fp8_over_bf16"] = geo
        self.results["recommended_fp8_upcast"] = min(usable, key=usable.get) if usable else None
        return rows

    def print_tables(self, rows):
        print("\nper variant (us per call, default tiles; fp8/bf16 in brackets):")
        hdr = f"{'case':18s} {'bf16 cache':>10s}" + "".join(f" {n:>16s}" for n in UPCASTS)
        print(hdr)
        for key, res in self.results["cases"].items():
            bf = res.get("bf16_cache", {})
            line = f"{key:18s} {bf['us'] if bf.get('ok') else float('nan'):10.1f}"
            for n in UPCASTS:
                r = res["fp8"].get(n, {})
                if r.get("ok") and "us" in r:
                    ratio = f"({r['us'] / bf['us']:.2f})" if bf.get("ok") else ""
                    line += f" {r['us']:9.1f} {ratio:>6s}"
                else:
                    what = "ERROR" if "error" in r else "WRONG" if "err" in r else r.get("skipped", "-")
                    line += f" {what[:16]:>16s}"
            print(line)
        print("geomean fp8/bf16 by variant: "
              + ", ".join(f"{n} {g:.3f}" for n, g in self.results["geomean_fp8_over_bf16"].items())
              + f"; recommended FP8_UPCAST = {self.results['recommended_fp8_upcast']!r}"
              + f" (module default now {self.results['module_default_fp8_upcast']!r})")
        print(f"\n{'case':18s} {'bf16 us':>9s} {'best fp8 us':>12s} {'fp8/bf16':>9s}  best variant")
        for key, bf_us, best in rows:
            bf_s = f"{bf_us:9.1f}" if bf_us else f"{'-':>9s}"
            if best is None:
                print(f"{key:18s} {bf_s} {'-':>12s} {'-':>9s}  none passed")
                continue
            ratio = f"{best[0] / bf_us:9.3f}" if bf_us else f"{'-':>9s}"
            print(f"{key:18s} {bf_s} {best[0]:12.1f} {ratio}  {best[1]} ({best[2]})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, toy sizes")
    ap.add_argument("--time-budget", type=float, default=78.0, help="seconds from start; later work is skipped")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for sweep_fp8_decode.json")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"                 # before triton is imported
    sw = Sweep(args)
    log(f"device {sw.results.get('device', 'cpu (smoke)')}; budget {args.time_budget:.0f} s")
    rc = 0
    try:
        sw.probe()
        for B, ctx in sw.cases:
            if sw.left() < 15:
                sw.results["cases"][f"B={B} ctx={ctx}"] = {"B": B, "ctx": ctx, "fp8": {}, "skipped": "time"}
                log(f"B={B} ctx={ctx}: skipped (time)")
                continue
            try:
                sw.run_case(B, ctx)
            except Exception:
                sw.results["errors"][f"B={B} ctx={ctx}"] = traceback.format_exc()
                log(f"B={B} ctx={ctx}: FAILED\n{traceback.format_exc()}")
                rc = 1
            sw.write()
        for key in list(sw.kept):                           # tiles, time permitting (headline cases first)
            if sw.left() < 8:
                break
            try:
                sw.run_tiles(key)
            except Exception:
                sw.results["errors"][f"tiles {key}"] = traceback.format_exc()
                log(f"tiles {key}: FAILED\n{traceback.format_exc()}")
            sw.write()
    finally:
        sw.kept.clear()
        rows = sw.summarize()
        sw.write()
        sw.print_tables(rows)
        log(f"wrote {Path(args.out) / 'sweep_fp8_decode.json'}")
    bad = [k for k, r in sw.results["cases"].items() if r.get("bf16_cache", {}).get("ok") is False
           or any(x.get("ok") is False for x in [*r.get("fp8", {}).values(), *r.get("tiles", [])])]
    if bad:
        log(f"CHECK FAILED in {bad}")
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
