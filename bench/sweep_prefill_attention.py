"""Prefill / extend attention on the GPU: paged_prefill_attention ("v2": this step's keys from the
contiguous k/v rows, only the cached prefix from the paged cache) over a small grid of launch
configurations, against fresh_prefill_attention; prints the defaults to put in
paged_prefill_attention.py.

One GPU call (H200, about 1-2 minutes; --time-budget, default 130 s, skips what would not fit),
from the repository root:

    PYTHONPATH=. python3 bench/sweep_prefill_attention.py      # writes $OUT/sweep_prefill_attention.json

Llama-8B attention heads (32 q, 8 kv, head_dim 128), bf16, page 16, shuffled block tables. Cases:
"1 x 8k fresh", "4 x 2k fresh", "16 x 2k fresh", "8 x 2k fresh" (the engine's 16,384-token step),
"32 x 512 fresh", "1 x 32k fresh", "2k chunk behind 6k cached + 64 decode rows" (skip_decode_rows,
as the backend calls it). The cache holds every token's K/V
(this step's too, as after the KV write) and k_new / v_new are the same values. Variants per case:
  v2 default            prefill_config()'s launch for the case (the baseline)
  v2 bm/bn/w/s[/pack]   each configuration of CONFIGS
Each output is checked first (rel. error ||out - ref|| / ||ref|| < 1e-2 against the fp32 torch
reference, no NaN; 32k: the reference on its first and last 1024 rows, and the whole output vs
the default's), only then timed: median per call of CUDA-graph replays (device time). TFLOP/s counts the
causal FLOPs, 4 * H * D * sum over the computed rows of the keys each sees. For the fresh cases
torch's own flash attention is timed as a reference point ("torch flash (reference)": varlen_attn,
else SDPA per sequence). Every case also times fresh_prefill_attention (q and this step's K/V
through TMA, the cached prefix, where there is one, through the block table) per FreshConfig of
FRESH ("fresh bm/bn/w/s"; --only-fresh: only v2's default configurations and these). The cases
behind a cached prefix: "8 x 2k behind 2k", "32 x 512 behind 1.5k", "1 x 8k behind 24k", "1k chunk
behind 512 + 60 decodes" (a serving step at concurrency 64). Printed last: the best variant per case (v2's and the fresh kernel's, and
their ratio), then the PREFILL_CONFIGS lines
for gpu_worker/kernels/paged_prefill_attention.py (per max_query_len bucket, the configuration with
the best geometric-mean TFLOP/s over the bucket's cases).

--smoke: on the CPU under TRITON_INTERPRET=1 at toy sizes (fp32 instead of bf16, wall-clock
times, fewer configurations): checks this script, its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from anywhere in the repo

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"                       # before triton is imported

import torch  # noqa: E402

from gpu_timing import event_median_ms, graph_median_ms  # noqa: E402  (bench/, the script's folder)

from gpu_worker.kernels import fresh_prefill_attention as fpa  # noqa: E402
from gpu_worker.kernels import paged_prefill_attention as ppa  # noqa: E402

T0 = time.time()
MAX_ERR = 1e-2
# (block_m, block_n, num_warps, num_stages, pack_gqa[, tma]): the v2 grid, compiled once each (~2-4 s)
CONFIGS = [
    (128, 64, 8, 2, False), (128, 64, 8, 3, False), (128, 128, 8, 2, False), (128, 128, 8, 3, False),
    (128, 32, 8, 2, False), (64, 64, 4, 2, False), (64, 64, 4, 3, False), (64, 128, 8, 2, False),
    (128, 64, 8, 2, True), (64, 64, 4, 2, True),
    # this step's K/V through TMA descriptors (128 x 128 with 4 stages overflows shared memory)
    (128, 128, 8, 2, False, True), (128, 128, 8, 3, False, True),
    (128, 64, 8, 3, False, True), (128, 64, 4, 3, False, True), (64, 64, 4, 3, False, True),
    (64, 64, 4, 4, False, True), (64, 128, 4, 3, False, True),
]
SMOKE_CONFIGS = [(16, 16, 4, 2, False), (32, 16, 4, 2, True), (64, 32, 4, 2, True), (16, 16, 4, 2, False, True)]
# fresh_prefill_attention (fresh cases only): (block_m, block_n, warps, stages)
FRESH = [fpa.FreshConfig(64, 64, 4, 3), fpa.FreshConfig(128, 128, 8, 3), fpa.FreshConfig(128, 64, 8, 3),
         fpa.FreshConfig(64, 64, 4, 2), fpa.FreshConfig(64, 128, 4, 3), fpa.FreshConfig(128, 128, 8, 2)]
SMOKE_FRESH = [fpa.FreshConfig(16, 16, 4, 2), fpa.FreshConfig(32, 16, 4, 2)]
BUCKETS = (4096, 1 << 62)             # PREFILL_CONFIGS bounds the sweep sets (<= 16 is left alone)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def cfg_name(c: tuple) -> str:
    if isinstance(c, fpa.FreshConfig):
        return f"fresh bm{c.block_m} bn{c.block_n} w{c.num_warps} s{c.num_stages}"
    return f"v2 bm{c[0]} bn{c[1]} w{c[2]} s{c[3]}" + (" pack" if c[4] else "") + (" tma" if c[5:6] == (True,) else "")


def cfg_literal(c: tuple) -> str:
    return (f"PrefillConfig(block_m={c[0]}, block_n={c[1]}, num_warps={c[2]}, num_stages={c[3]}, "
            f"pack_gqa={bool(c[4])}" + (", tma=True)" if c[5:6] == (True,) else ")"))


class Sweep:
    def __init__(self, args):
        self.args, self.smoke = args, args.smoke
        self.dev = "cpu" if self.smoke else "cuda"
        self.dtype = torch.float32 if self.smoke else torch.bfloat16   # the interpreter's bf16 is wrong
        self.end = T0 + args.time_budget
        if self.smoke:
            self.H, self.KVH, self.D, self.page = 8, 2, 32, 16
            self.cases = {                      # name: (query_lens, context_lens, skip_decode_rows)
                "1 x 8k fresh": ([96], [96], False),
                "4 x 2k fresh": ([40] * 2, [40] * 2, False),
                "16 x 2k fresh": ([24] * 3, [24] * 3, False),
                "8 x 2k fresh": ([24] * 2, [24] * 2, False),
                "32 x 512 fresh": ([9] * 5, [9] * 5, False),
                "1 x 32k fresh": ([128], [128], False),
                "2k chunk behind 6k + 64 decodes": ([40] + [1] * 3, [100] + [30] * 3, True),
                "8 x 2k behind 2k": ([24] * 2, [48] * 2, False),
                "32 x 512 behind 1.5k": ([9] * 3, [30] * 3, False),
                "1 x 8k behind 24k": ([64], [200], False),
                "1k chunk behind 512 + 60 decodes": ([20] + [1] * 3, [30] + [25] * 3, True),
            }
            self.configs, self.fresh, self.ref_rows = SMOKE_CONFIGS, SMOKE_FRESH, 12   # 128 rows > 8 x 12: sliced ref
        else:
            self.H, self.KVH, self.D, self.page = 32, 8, 128, 16
            self.cases = {
                "1 x 8k fresh": ([8192], [8192], False),
                "4 x 2k fresh": ([2048] * 4, [2048] * 4, False),
                "16 x 2k fresh": ([2048] * 16, [2048] * 16, False),
                "8 x 2k fresh": ([2048] * 8, [2048] * 8, False),          # the engine's 16,384-token steps
                "32 x 512 fresh": ([512] * 32, [512] * 32, False),
                "1 x 32k fresh": ([32768], [32768], False),
                "2k chunk behind 6k + 64 decodes": ([2048] + [1] * 64, [8192] + [1000] * 64, True),
                # chunks behind a cached prefix: chunked prompts, multi-turn chats (prefix-cache hits),
                # a long prompt's last chunk, and a serving step at c=64 (kvmesh serve's 1,536-token budget)
                "8 x 2k behind 2k": ([2048] * 8, [4096] * 8, False),
                "32 x 512 behind 1.5k": ([512] * 32, [2048] * 32, False),
                "1 x 8k behind 24k": ([8192], [32768], False),
                "1k chunk behind 512 + 60 decodes": ([1024] + [1] * 60, [1536] + [1100] * 60, True),
            }
            self.configs, self.fresh, self.ref_rows = CONFIGS, FRESH, 1024
        self.G = self.H // self.KVH
        self.results: dict = {"device": self.device_name(), "torch": torch.__version__,
                              "triton": __import__("triton").__version__, "smoke": self.smoke,
                              "heads": [self.H, self.KVH, self.D], "page": self.page, "cases": {},
                              "compile_s": {}, "errors": {}}

    def device_name(self) -> str:
        if self.smoke:
            return "cpu (TRITON_INTERPRET=1)"
        p = torch.cuda.get_device_properties(0)
        return f"{p.name}, {p.multi_processor_count} SMs"

    def left(self) -> float:
        return self.end - time.time()

    # ------------------------------------------------------------------------------ timing
    def sync(self):
        if not self.smoke:
            torch.cuda.synchronize()

    def time_events(self, fn, reps: int) -> float:
        return event_median_ms(fn, reps)

    def time_ms(self, fn, graph: bool = True) -> float:
        """Median ms per fn() call: CUDA-graph replays of `inner` back-to-back calls (events, without
        a graph, when capture fails); one wall-clock call in --smoke."""
        if self.smoke:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        fn()
        self.sync()
        one = self.time_events(fn, 2)
        inner = max(1, min(20, int(5.0 / max(one, 1e-3))))       # ~5 ms per replay
        if graph:
            try:
                return graph_median_ms(fn, inner, reps=5, warmup=1)
            except Exception as exc:                                  # noqa: BLE001
                log(f"    (graph capture failed: {type(exc).__name__}: {str(exc)[:120]}; timing with events)")
                self.sync()
        return self.time_events(lambda: [fn() for _ in range(inner)], 5) / inner

    # ------------------------------------------------------------------------------ data
    def make_case(self, q_lens, ctx_lens, seed):
        """q, the cache (every token's K/V, shuffled blocks), k_new / v_new (this step's rows: the
        same values as the cache holds), tables, context lens, query_start_loc."""
        dev, dt, page, KVH, D = self.dev, self.dtype, self.page, self.KVH, self.D
        g = torch.Generator(device=dev).manual_seed(seed)
        need = [-(-c // page) for c in ctx_lens]
        total = sum(need) + 3
        perm = torch.randperm(total, device=dev, generator=g).int()
        tables = torch.zeros((len(ctx_lens), max(need) + 1), dtype=torch.int32, device=dev)
        k_cache = torch.randn((total, page, KVH, D), device=dev, dtype=dt, generator=g)
        v_cache = torch.randn((total, page, KVH, D), device=dev, dtype=dt, generator=g)
        T = sum(q_lens)
        k_new = torch.empty((T, KVH, D), device=dev, dtype=dt)
        v_new = torch.empty_like(k_new)
        used, row = 0, 0
        for b, (n, c) in enumerate(zip(q_lens, ctx_lens)):
            blocks = perm[used: used + need[b]]
            tables[b, : need[b]] = blocks
            used += need[b]
            k_new[row: row + n] = ppa.gather_context(k_cache, blocks, c)[c - n:]
            v_new[row: row + n] = ppa.gather_context(v_cache, blocks, c)[c - n:]
            row += n
        q = torch.randn((T, self.H, D), device=dev, dtype=dt, generator=g)
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        cl = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
        return q, k_cache, v_cache, k_new, v_new, tables, cl, qsl

    def reference(self, data, q_lens, ctx_lens, skip):
        """fp32 reference: the whole output, or (long cases) row slices {(r0, r1): ref rows}."""
        q, kc, vc, _, _, tables, cl, qsl = data
        scale = self.D ** -0.5
        if max(q_lens) <= 8 * self.ref_rows:
            return {(0, q.shape[0]): ppa.paged_prefill_attention_ref(q, kc, vc, tables, cl, qsl, scale,
                                                                     skip_decode_rows=skip)}
        assert len(q_lens) == 1, "row-sliced references: one sequence"
        n, R, out = q_lens[0], self.ref_rows, {}
        for r0, r1 in ((0, R), (n - R, n)):        # rows r0.. sit at positions ctx - n + r0 ..
            sub_qsl = torch.tensor([0, r1 - r0], dtype=torch.int32, device=q.device)
            sub_cl = torch.tensor([ctx_lens[0] - n + r1], dtype=torch.int32, device=q.device)
            out[(r0, r1)] = ppa.paged_prefill_attention_ref(q[r0:r1], kc, vc, tables, sub_cl, sub_qsl, scale)
        return out

    @staticmethod
    def check(out, refs) -> float:
        return max(rel_err(out[r0:r1], ref) for (r0, r1), ref in refs.items())

    # ------------------------------------------------------------------------------ torch flash
    def torch_flash(self, data, q_lens):
        """(name, fn) for torch's flash attention on a fresh case, or None."""
        q, _, _, k, v, _, _, qsl = data
        scale, G, max_len = self.D ** -0.5, self.G, max(q_lens)
        try:
            from torch.nn.attention import varlen
            params = inspect.signature(varlen.varlen_attn).parameters
            kw = {"scale": scale} if "scale" in params else {}
            if "is_causal" in params:
                kw["is_causal"] = True
            elif "window_size" in params:
                kw["window_size"] = (-1, 0)
            else:
                raise TypeError("varlen_attn: no causal argument")
            if "enable_gqa" in params:
                kw["enable_gqa"], kk, vv = True, k, v
            else:
                kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
            fn = lambda: varlen.varlen_attn(q, kk, vv, qsl, qsl, max_len, max_len, **kw)   # noqa: E731
            fn()
            return "varlen_attn" + (" (gqa)" if "enable_gqa" in kw else " (k/v repeated)"), fn
        except Exception as exc:                                      # noqa: BLE001
            log(f"    varlen_attn unavailable: {type(exc).__name__}: {str(exc)[:160]}")
        import torch.nn.functional as F
        bounds = [(int(a), int(b)) for a, b in zip(qsl[:-1].tolist(), qsl[1:].tolist())]
        qs = [q[a:b].transpose(0, 1).unsqueeze(0) for a, b in bounds]              # (1, H, L, D)
        for gqa in (True, False):
            if gqa:
                ks = [k[a:b].transpose(0, 1).unsqueeze(0) for a, b in bounds]
                vs = [v[a:b].transpose(0, 1).unsqueeze(0) for a, b in bounds]
                extra = {"enable_gqa": True}
            else:
                ks = [k[a:b].repeat_interleave(G, 1).transpose(0, 1).unsqueeze(0) for a, b in bounds]
                vs = [v[a:b].repeat_interleave(G, 1).transpose(0, 1).unsqueeze(0) for a, b in bounds]
                extra = {}
            outs = [None] * len(bounds)

            def fn(ks=ks, vs=vs, extra=extra):
                for i in range(len(bounds)):
                    outs[i] = F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=True, scale=scale,
                                                             **extra)
                return outs
            try:
                try:
                    from torch.nn.attention import SDPBackend, sdpa_kernel
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        fn()
                    def run(fn=fn):                                    # noqa: E306
                        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                            return fn()
                    name = "SDPA flash per sequence"
                except Exception:                                     # noqa: BLE001
                    fn()
                    run, name = fn, "SDPA (default backend) per sequence"
                def wrapped(run=run):                                  # noqa: E306
                    res = run()
                    return torch.cat([o[0].transpose(0, 1) for o in res], dim=0)
                return name + (" (gqa)" if gqa else " (k/v repeated)"), wrapped
            except Exception as exc:                                  # noqa: BLE001
                log(f"    SDPA (enable_gqa={gqa}) unavailable: {type(exc).__name__}: {str(exc)[:160]}")
        return None

    # ------------------------------------------------------------------------------ one case
    def run_case(self, name, q_lens, ctx_lens, skip, seed):
        scale, G = self.D ** -0.5, self.G
        rows_q = [(n, c) for n, c in zip(q_lens, ctx_lens) if not (skip and n == 1)]
        seen = sum(n * (c - n) + n * (n + 1) // 2 for n, c in rows_q)
        flops = 4 * self.H * self.D * seen
        res = {"query_lens": q_lens[:4] + (["..."] if len(q_lens) > 4 else []), "num_seqs": len(q_lens),
               "flops": flops, "variants": {}}
        self.results["cases"][name] = res
        t = time.time()
        data = self.make_case(q_lens, ctx_lens, seed)
        q, kc, vc, kn, vn, tables, cl, qsl = data
        refs = self.reference(data, q_lens, ctx_lens, skip)
        self.sync()
        log(f"== {name}: T={q.shape[0]}, {len(q_lens)} seqs, {flops / 1e12:.3f} TFLOP; data + reference "
            f"{time.time() - t:.1f}s (rows checked: {sorted(refs)})")
        out = torch.zeros_like(q)
        base = dict(max_query_len=max(q_lens), out=out, skip_decode_rows=skip)
        base_out = None
        variants = [("v2 default", None)]
        defaults = {tuple(c) for _, c in ppa.PREFILL_CONFIGS}             # --only-fresh keeps v2's defaults
        variants += [(cfg_name(c), c) for c in self.configs
                     if not self.args.only_fresh or tuple(ppa.PrefillConfig(*c)) in defaults]
        fresh = all(n == c for n, c in zip(q_lens, ctx_lens))
        variants += [(cfg_name(c), c) for c in self.fresh]         # the fresh kernel (with the prefix if any)
        prefix = None if fresh else fpa.CachedPrefix(kc, vc, tables, cl)
        for vname, c in variants:
            if self.left() < (25 if base_out is None else 8):
                res["variants"][vname] = {"skipped": "time budget"}
                log(f"  {vname:28s} skipped (time budget)")
                continue
            try:
                if isinstance(c, fpa.FreshConfig):
                    kw = dict(config=c, tiles=fpa.fresh_tile_map(qsl, c.block_m, q.shape[0], skip))
                else:
                    cfg = ppa.prefill_config(max(q_lens), self.D, G) if c is None else ppa.PrefillConfig(*c)
                    kw = dict(base, k_new=kn, v_new=vn, config=cfg,
                              tile_starts=ppa.prefill_tile_starts(qsl, cfg.tile_tokens(G), skip))

                def call(kw=kw, fresh_kernel=isinstance(c, fpa.FreshConfig)):
                    if fresh_kernel:
                        return fpa.fresh_prefill_attention(q, kn, vn, qsl, scale, max_query_len=max(q_lens), out=out,
                                                           skip_decode_rows=skip, prefix=prefix, **kw)
                    return ppa.paged_prefill_attention(q, kc, vc, tables, cl, qsl, scale, **kw)
                out.zero_()
                t = time.time()
                call()
                self.sync()
                first_s = time.time() - t
                self.results["compile_s"].setdefault(vname, round(first_s, 2))
                err = self.check(out, refs)
                finite = bool(torch.isfinite(out).all())
                err_base = None
                if c is None:
                    base_out = out.clone()
                elif base_out is not None:
                    err_base = rel_err(out, base_out)
                ok = finite and err < MAX_ERR and (err_base is None or err_base < MAX_ERR)
                entry = {"err": err, "err_vs_default": err_base, "finite": finite, "first_call_s": round(first_s, 2),
                         "ok": ok}
                res["variants"][vname] = entry
                if not ok:
                    log(f"  {vname:28s} WRONG: err {err:.1e}, vs the default {err_base}, finite {finite}")
                    continue
                ms = self.time_ms(call)
                entry.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
                log(f"  {vname:28s} err {err:.1e}{'' if err_base is None else f' (vs default {err_base:.1e})'}  "
                    f"{ms * 1e3:9.1f} us  {entry['tflops']:6.1f} TFLOP/s   (first call {first_s:.1f}s)")
            except Exception as exc:                                  # noqa: BLE001 e.g. out of shared memory
                res["variants"][vname] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                log(f"  {vname:28s} FAILED {type(exc).__name__}: {str(exc)[:200]}")
                if "out of resources" not in str(exc).lower():
                    self.results["errors"][f"{name} / {vname}"] = traceback.format_exc()[-2000:]
        if fresh and self.left() > 8:
            try:
                got = self.torch_flash(data, q_lens)
                if got is not None:
                    tname, fn = got
                    o = fn()
                    err = self.check(o.reshape(q.shape).to(q.dtype), refs) if o is not None else float("nan")
                    ms = self.time_ms(fn)
                    res["torch_flash"] = {"impl": tname, "err": err, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
                    log(f"  {'torch flash (reference)':28s} err {err:.1e}  {ms * 1e3:9.1f} us  "
                        f"{res['torch_flash']['tflops']:6.1f} TFLOP/s   [{tname}]")
            except Exception as exc:                                  # noqa: BLE001
                res["torch_flash"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                log(f"  torch flash (reference) FAILED {type(exc).__name__}: {str(exc)[:200]}")
        del data, refs, out, base_out
        if not self.smoke:
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------ summary
    def summary(self) -> None:
        print("\n" + "=" * 110)
        print(f"prefill attention sweep: {self.results['device']}, torch {self.results['torch']}, "
              f"triton {self.results['triton']}; heads {self.H}/{self.KVH} x {self.D}, page {self.page}")
        print(f"{'case':34s} {'default':>7s} {'best v2':>8s} {'x dflt':>6s} {'torch':>7s} {'fresh':>7s} "
              f"{'x v2':>5s}  best v2 / best fresh configuration  (TFLOP/s)")
        best_by_case = {}
        for name, res in self.results["cases"].items():
            timed = {v: e["tflops"] for v, e in res.get("variants", {}).items() if e.get("tflops")}
            v2 = {v: t for v, t in timed.items() if v.startswith("v2 bm")}
            if not v2:
                print(f"{name:34s} (no v2 configuration timed)")
                continue
            bname = max(v2, key=v2.get)
            best_by_case[name] = bname
            default = timed.get("v2 default", math.nan)
            tf = res.get("torch_flash", {}).get("tflops") or math.nan
            fresh = {v: t for v, t in timed.items() if v.startswith("fresh ")}
            fname = max(fresh, key=fresh.get) if fresh else ""
            ft = fresh[fname] if fresh else math.nan
            print(f"{name:34s} {default:7.1f} {v2[bname]:8.1f} {v2[bname] / default:6.2f} {tf:7.1f} {ft:7.1f} "
                  f"{ft / v2[bname]:5.2f}  {bname} / {fname or '-'}")
        self.results["best_by_case"] = best_by_case
        # PREFILL_CONFIGS: per bucket of max_query_len, the v2 config with the best geometric mean
        chosen, lo = {}, 16
        for bound in BUCKETS:
            names = [n for n, (ql, _, _) in self.cases.items() if lo < max(ql) <= bound
                     and self.results["cases"].get(n, {}).get("variants")]      # the cases that ran
            hi_txt = "inf" if bound >= (1 << 62) else str(bound)
            scores = {}
            for c in self.configs:
                tfs = [self.results["cases"].get(n, {}).get("variants", {}).get(cfg_name(c), {}).get("tflops")
                       for n in names]
                if names and all(tfs):
                    scores[c] = math.exp(sum(math.log(x) for x in tfs) / len(tfs))
            if scores:
                c = max(scores, key=scores.get)
                chosen[bound] = c
                print(f"max_query_len in ({lo}, {hi_txt}]: {cfg_name(c)}, geomean {scores[c]:.1f} TFLOP/s "
                      f"over {names}")
            else:
                print(f"max_query_len in ({lo}, {hi_txt}]: no configuration timed on every case of {names}")
            lo = bound
        bound_txt = {1 << 62: "1 << 62"}
        lines = []
        for bound, cfg in ppa.PREFILL_CONFIGS:
            lit = cfg_literal(chosen[bound]) if bound in chosen else cfg_literal(tuple(cfg))
            lines.append(f"    ({bound_txt.get(bound, str(bound))}, {lit}),")
        text = "PREFILL_CONFIGS: list[tuple[int, PrefillConfig]] = [\n" + "\n".join(lines) + "\n]"
        print("\nPut in gpu_worker/kernels/paged_prefill_attention.py (the <= 16 entry is not swept: kept):")
        print(text)
        self.results["suggested_prefill_configs"] = text
        self.results["suggested"] = {str(b): list(c) for b, c in chosen.items()}
        print(f"total {time.time() - T0:.0f}s")

    def write(self) -> None:
        out_dir = Path(os.environ.get("OUT", "./out"))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "sweep_prefill_attention.json").write_text(json.dumps(self.results, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, toy sizes")
    ap.add_argument("--time-budget", type=float, default=130.0, help="seconds; later variants are skipped")
    ap.add_argument("--only-fresh", action="store_true", help="v2's default configurations and the fresh "
                    "kernel's only")
    ap.add_argument("--cases", default="", help="comma-separated case names (substrings) to run")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --smoke on the CPU)")
    sweep = Sweep(args)
    log(f"{sweep.results['device']}, torch {sweep.results['torch']}, triton {sweep.results['triton']}; "
        f"{len(sweep.configs)} v2 configurations + the default; budget {args.time_budget:.0f}s")
    wanted = [w.strip() for w in args.cases.split(",") if w.strip()]
    for i, (name, (q_lens, ctx_lens, skip)) in enumerate(sweep.cases.items()):
        if wanted and not any(w in name for w in wanted):
            continue
        if sweep.left() < 15:
            log(f"== {name}: skipped (time budget)")
            sweep.results["cases"][name] = {"skipped": "time budget", "variants": {}}
            continue
        try:
            sweep.run_case(name, q_lens, ctx_lens, skip, seed=i)
        except Exception as exc:                                      # noqa: BLE001
            log(f"== {name}: FAILED {type(exc).__name__}: {exc}")
            sweep.results["errors"][name] = traceback.format_exc()[-3000:]
        sweep.write()
    sweep.summary()
    sweep.write()


if __name__ == "__main__":
    main()
