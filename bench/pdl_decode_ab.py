#!/usr/bin/env python3
"""Batch-1 decode with and without programmatic dependent launch (gpu_worker/kernels/_pdl.py),
per way of running a decode layer, on one engine (Llama-3.1-8B shapes, random bf16 weights, then
the same weights quantized to fp8 in place, then with `--fp8-lm-head-variants` the lm_head too):

    cublas   bf16: norm / RoPE+KV-write / attention / SwiGLU Triton kernels around cuBLAS GEMMs
             (DecoderLayer.gemv_max_m 0): only the Triton kernels can launch early
    gemv     every linear a split-K GEMV (fp8_gemv.py), norms and SwiGLU separate kernels
             (DecoderLayer._forward_gemv, gemv_fuse off): all Triton
    fused    four GEMVs with the residual adds, the norms and SwiGLU in their epilogues
             (DecoderLayer._forward_gemv, gemv_fuse): all Triton, three kernels fewer per layer
    fused-norm, fused-swiglu   only the norms / only SwiGLU in the epilogues
    gemv-ropekernel            `gemv` with RoPE + KV write as a kernel of its own, not inside the
                               decode attention kernel (TritonAttentionBackend.fuse_rope_decode)
    gemv-cublashead            `gemv` with the 16-bit lm_head on cuBLAS (CausalLM.head_gemv off;
                               every other mode runs it as a GEMV where the layers run GEMVs)

and, to find where a step's time goes, `gemv` with kernels left out (the tokens are then wrong;
the time the graph loses is what those kernels cost inside it): gemv-noattn (no RoPE + KV write,
no attention: o_proj reads q), gemv-nonorm (every RMSNorm an identity), gemv-noswiglu (down reads
the gate half), gemv-only (all three: the GEMVs, embedding, lm_head and sampling alone).

Each variant also runs under every decode-attention configuration of `--attention` (default
just the current one): `u` runs the short graphs' decode kernel unsplit (RoPE + KV write its own
kernel: the default until the ninth session), `sNxB` splits short contexts into up to N
partitions of B-key tiles (paged_decode_attention.SHORT_MAX_SPLITS / SHORT_BLOCK_N; RoPE + KV
write fused in), `sNxBhH` the same with H query heads per program (SHORT_HEADS_PER_PROGRAM;
s1x64h1: unsplit, a program per query head), a `wW` after either W warps per program
(SHORT_NUM_WARPS), and a `+2p` suffix merges split partials in a second kernel (SPLIT_MERGE
"two_pass"; `+2pW` with W warps) instead of in the launch ("last"); the merge also applies to the
8k graph's 32 splits. The default configuration is `s16x16+2p1` (KVMESH_DECODE_ATTENTION sets
another for a serving run: paged_decode_attention.set_attention_config).

Each variant recaptures the decode graphs (sizes 1, 2, 4) and measures: the GPU time of one
batch-1 graph replay at 128 and 8k context (CUDA events, median of 30, real contexts in the
buffers), and wall tok/s of a 256-token greedy decode at 128 context, sync and with
async_scheduling. PDL 0 is off, 1 on, 3 on with the GEMVs letting the next kernel launch only
after their K loops (results of this script's earlier version also hold 2: the next kernel
launched at each kernel's start, since dropped); pf is the weight tiles per program the GEMVs
prefetch before waiting. Variants run in rounds (A B C .. A B C ..) to show the spread. The greedy
tokens of every PDL variant must equal those of the same layer mode without PDL (a kernel
reading its predecessor's output too early would change them). Also the copy-bandwidth ceiling.

    python3 bench/pdl_decode_ab.py --model-dir /tmp/kvmesh-llama-8b      # the H200, ~3 min
    python3 bench/pdl_decode_ab.py --smoke                               # CPU: checks the script

Prints a table last and writes $OUT/pdl_decode_ab.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def copy_ceiling_gbs() -> float:
    """Device-to-device copy of 2 GiB, read + write bytes, launched eagerly as gpu_bench.py does
    (captured into a CUDA graph the copy becomes a memcpy node, which read only 2.7 TB/s on the
    H200 against 4.2 for the eager copy)."""
    from cuda_timing import event_median_ms
    a = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    ms = event_median_ms(lambda: b.copy_(a), reps=10, warmup=2)
    return 2 * a.numel() * 2 / ms / 1e6


MODES = ("cublas", "gemv", "fused", "fused-norm", "fused-swiglu", "gemv-ropekernel",
         "gemv-noattn", "gemv-nonorm", "gemv-noswiglu", "gemv-only", "gemv-cublashead")
_ORIG: dict = {}        # the model's kernel namespace and Attention's methods, as built


def _skip_rotate_attend(self, qkv, positions, kv, batch):
    """Attention.rotate_attend without RoPE, the KV write or attention: q as the output (ablation)."""
    return qkv[:, : self.q_size].view(qkv.shape[0], self.num_heads, self.head_dim)


def _variant_kernels(mode: str, k):
    """The kernel namespace of a mode: the model's own, or with kernels left out / unfused."""
    from types import SimpleNamespace

    from gpu_worker.kernels.rmsnorm import NormOutput
    ns = SimpleNamespace(**vars(k))
    if mode in ("gemv-nonorm", "gemv-only"):
        ns.rmsnorm = lambda x, w, eps, residual=None: NormOutput(x, x if residual is None else residual)
    if mode in ("gemv-noswiglu", "gemv-only"):
        ns.swiglu = lambda x: x[:, : x.shape[1] // 2]

    def gemv(*a, swiglu_out=False, norm_out=None, **kw):
        if swiglu_out and mode == "fused-norm":
            return k.swiglu(k.gemv(*a, **kw))
        if norm_out is not None and mode == "fused-swiglu":
            return k.rmsnorm(k.gemv(*a, **kw), *norm_out)
        return k.gemv(*a, swiglu_out=swiglu_out, norm_out=norm_out, **kw)
    ns.gemv = gemv if mode in ("fused-norm", "fused-swiglu") else k.gemv
    return ns


def set_variant(mode: str, pdl: int, prefetch: int, model=None) -> None:
    """pdl 0: off; 1: on; 3: on, the GEMVs let the next kernel launch only after their K loops
    (fp8_gemv.PDL_LAUNCH_LATE). `model`: the engine's, whose kernels the ablation modes replace."""
    from gpu_worker.attention.triton_backend import TritonAttentionBackend
    from gpu_worker.kernels import _pdl, fp8_gemv
    from gpu_worker.models.decoder import Attention, CausalLM, DecoderLayer
    _pdl.ENABLED = pdl > 0
    CausalLM.head_gemv = mode != "gemv-cublashead"
    fp8_gemv.PDL_LAUNCH_LATE = pdl == 3
    TritonAttentionBackend.fuse_rope_decode = mode != "gemv-ropekernel"
    fp8_gemv.PDL_PREFETCH_TILES = prefetch
    DecoderLayer.gemv_max_m = 0 if mode == "cublas" else 1
    DecoderLayer.gemv_weights, DecoderLayer.gemv_fuse = "all", mode.startswith("fused")
    if model is None or model.model.layers[0].kernels is None:
        return
    _ORIG.setdefault("kernels", model.model.layers[0].kernels)
    _ORIG.setdefault("rotate_attend", Attention.rotate_attend)
    model.use_fused_kernels(_variant_kernels(mode, _ORIG["kernels"]))
    skip_attn = mode in ("gemv-noattn", "gemv-only")
    Attention.rotate_attend = _skip_rotate_attend if skip_attn else _ORIG["rotate_attend"]


class Decode:
    """Timed batch-1 decodes on one engine (engine_perf's Bench for requests)."""

    def __init__(self, eng, smoke: bool):
        from engine_perf import Bench
        self.eng, self.b, self.smoke = eng, Bench(eng), smoke
        self.p128 = self.b.prompt(128 if not smoke else 12)
        self.p8k = self.b.prompt(8192 if not smoke else 40)

    def tokens(self) -> list[int]:
        return self.b.generate([self.p128], 64 if not self.smoke else 8)[0]

    def run(self, prompt, n_out: int, async_: bool = False) -> float:
        eng = self.eng
        eng.async_scheduling = async_
        try:
            self.b.add(prompt, n_out)
            while eng.scheduler.waiting or any(s.num_new_tokens > 1 for s in eng.scheduler.running):
                eng.step()
            for _ in range(4):
                eng.step()
            if not self.smoke:
                torch.cuda.synchronize()
            t = time.perf_counter()
            n = self.b.drain()
            return n / (time.perf_counter() - t)
        finally:
            eng.async_scheduling = False

    def graph_ms(self, short: bool) -> float:
        from cuda_timing import event_median_ms
        runner = self.eng.runner
        g = runner.short_decode_graphs if short else runner.decode_graphs
        if self.smoke or g is None or 1 not in g.graphs:
            return float("nan")
        return event_median_ms(g.graphs[1].replay, 30, warmup=2)


def build_decode(model_dir: Path, smoke: bool) -> Decode:
    """The engine these scripts time (batch <= 4, CUDA graphs up to 4; smoke: the tiny model
    on the CPU, made if missing), warmed up, wrapped in a Decode."""
    from gpu_worker.config import EngineConfig
    from gpu_worker.engine import Engine
    if smoke:
        from gpu_worker.make_model import make_model
        if not (model_dir / "config.json").exists():
            make_model(model_dir, arch="llama", size="tiny", progress=False)
        extra = dict(device="cpu", dtype="float32", attention_backend="torch", num_gpu_blocks=512,
                     max_model_len=256)
    else:
        extra = dict(dtype="bfloat16", gpu_memory_utilization=0.6, max_model_len=16384)
    eng = Engine(EngineConfig(model=str(model_dir), max_num_seqs=4, max_num_batched_tokens=16384,
                              cuda_graph_max_bs=4, **extra))
    d = Decode(eng, smoke)
    d.run(d.p8k, 8)                                  # warm-up: prefill and decode kernels compiled
    return d


def measure(d: Decode, weights: str, mode: str, pdl: int, prefetch: int, attn: str) -> dict:
    from gpu_worker.kernels.paged_decode_attention import set_attention_config
    set_variant(mode, pdl, prefetch, d.eng.runner.model)
    set_attention_config(attn)
    runner = d.eng.runner
    runner.capture_cuda_graphs(4, d.eng.max_model_len)
    # every variant's tokens from a fresh prefill: a prompt cached by an earlier variant would be
    # extended from that variant's KV (another kernel path; other weights after quantizing)
    d.eng.reset_prefix_cache()
    toks = d.tokens()
    sync = d.run(d.p128, 256 if not d.smoke else 8)
    short_ms = d.graph_ms(short=True)
    asyn = d.run(d.p128, 256 if not d.smoke else 8, async_=True)
    d.eng.step()
    at8k = d.run(d.p8k, 64 if not d.smoke else 10)
    long_ms = d.graph_ms(short=False)
    r = dict(weights=weights, mode=mode, pdl=pdl, prefetch=prefetch, attn=attn, graph_ms_128=short_ms,
             graph_ms_8k=long_ms, sync_tok_s=sync, async_tok_s=asyn, tok_s_8k=at8k, tokens=toks)
    log(f"{weights} {mode:15s} pdl={pdl} pf={prefetch} attn={attn}: graph {short_ms:.3f} / {long_ms:.3f} ms "
        f"(128 / 8k ctx); {sync:.1f} sync, {asyn:.1f} async tok/s; 8k {at8k:.1f} tok/s")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/kvmesh-llama-8b")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=float, default=400, help="seconds; later rounds are skipped")
    ap.add_argument("--variants", default="",
                    help="mode:pdl[:pf],... run for the bf16 and fp8 weights instead of the full plan, e.g. gemv:1,fused:1")
    ap.add_argument("--attention", default="",
                    help="decode-attention configurations to cross with every variant, e.g. u+2p,s8x16 "
                         "(module doc; default: the current one)")
    ap.add_argument("--fp8-variants", default=None,
                    help="mode:pdl[:pf],... for the fp8 weights (default: --variants); 'none' skips fp8")
    ap.add_argument("--fp8-attention", default=None, help="--attention for the fp8 weights (default: --attention)")
    ap.add_argument("--fp8-lm-head-variants", default="none",
                    help="mode:pdl[:pf],... run last with the lm_head quantized too (quantization='fp8_lm_head', "
                         "--fp8-attention's configurations); default none")
    args = ap.parse_args()
    from gpu_worker.kernels.paged_decode_attention import attention_config, attention_config_error
    attns = [a for a in args.attention.split(",") if a] or [attention_config()]
    fp8_attns = attns if args.fp8_attention is None else [a for a in args.fp8_attention.split(",") if a]
    bad_attn = [a for a in attns + fp8_attns if attention_config_error(a)]
    if bad_attn:
        ap.error(f"--attention: not configurations: {bad_attn} ({attention_config_error(bad_attn[0])})")
    from gpu_worker.models.layers.fp8 import quantize_lm_head_fp8, quantize_linears_fp8

    ceiling = float("nan")
    if not args.smoke:
        from engine_perf import ensure_model
        ensure_model(Path(args.model_dir))
        log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        ceiling = copy_ceiling_gbs()
        log(f"copy ceiling {ceiling:.0f} GB/s")
    d = build_decode(Path(args.model_dir), args.smoke)
    eng = d.eng
    results = []
    # (mode, pdl, prefetched weight tiles)
    plans = {"bf16": [("cublas", 0, 0), ("fused", 0, 0), ("fused", 1, 0), ("gemv", 0, 0), ("gemv", 1, 0),
                      ("gemv", 1, 1), ("gemv", 1, 2)],
             "fp8": [("fused", 0, 0), ("gemv", 0, 0), ("gemv", 1, 0), ("gemv", 1, 1), ("gemv", 1, 2)]}

    def parse_variants(flag: str, text: str) -> list[tuple[str, int, int]]:
        picked = [(v.split(":") + ["0"])[:3] for v in text.split(",")]
        bad = [v for v in picked if v[0] not in MODES or not v[1].isdigit() or not v[2].isdigit()]
        if bad:
            ap.error(f"{flag}: expected mode:pdl[:pf] with mode one of {'|'.join(MODES)}, got {bad}")
        return [(m, int(pdl), int(pf)) for m, pdl, pf in picked]

    if args.variants:
        plans = {w: parse_variants("--variants", args.variants) for w in plans}
    if args.fp8_variants is not None:
        plans["fp8"] = [] if args.fp8_variants == "none" else parse_variants("--fp8-variants", args.fp8_variants)
    plans["fp8_lm_head"] = ([] if args.fp8_lm_head_variants == "none"
                            else parse_variants("--fp8-lm-head-variants", args.fp8_lm_head_variants))
    plans = {w: [(m, pdl, pf, a) for m, pdl, pf in plan for a in (attns if w == "bf16" else fp8_attns)]
             for w, plan in plans.items()}
    end = T0 + args.budget
    kinds = [w for w in ("bf16", "fp8", "fp8_lm_head") if plans[w]]
    for i, weights in enumerate(kinds):
        if weights != "bf16" and quantize_linears_fp8(eng.runner.model):    # the first fp8 pass
            eng.runner.prefill_graphs = None       # captured over the bf16 weights: prefill runs eagerly
        eng.reset_prefix_cache()                   # cached KV of other weights must not be reused
        if weights == "fp8_lm_head":
            quantize_lm_head_fp8(eng.runner.model)
        if weights != "bf16" and not args.smoke:
            torch.cuda.empty_cache()
        # the time left, shared by the kinds still to run in proportion to their variants
        share = (end - time.time()) * len(plans[weights]) / sum(len(plans[w]) for w in kinds[i:])
        stop = time.time() + share
        for rnd in range(args.rounds):
            for mode, pdl, pf, attn in plans[weights]:
                if time.time() > stop:
                    log(f"{weights} round {rnd + 1}: time budget, skipping the rest")
                    break
                try:
                    results.append(dict(measure(d, weights, mode, pdl, pf, attn), round=rnd + 1))
                except Exception as e:       # one broken variant must not lose the others
                    log(f"{weights} {mode} pdl={pdl} pf={pf} attn={attn}: ERROR {type(e).__name__}: {e}"[:400])
                    for rid in list(eng.requests):
                        eng.abort_request(rid)
    means = attention_means(results)
    best = min((m for m in means if m["weights"] == "bf16" and m["mode"] == "gemv" and m["pdl"] == 1),
               key=lambda m: m["graph_ms_128"] + m["graph_ms_8k"], default=None)
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "pdl_decode_ab.json").write_text(json.dumps(dict(
        copy_ceiling_gbs=ceiling, runs=results, means=means, best_attention=best and best["attn"]), indent=1))

    # attention configurations sum in other orders: tokens are compared within one configuration
    base = {(r["weights"], r["mode"], r["attn"]): r["tokens"] for r in results if not r["pdl"]}
    first = {}                                   # without PDL runs: the weights' first variant
    for r in results:
        first.setdefault(r["weights"], r["tokens"])
    print(f"\ncopy ceiling {ceiling:.0f} GB/s; batch-1 decode, Llama-3.1-8B shapes (tokens: same greedy "
          "tokens as the mode without PDL)")
    print(f"{'weights':11s} {'mode':15s} {'pdl':>3s} {'pf':>2s} {'attn':>8s} {'rnd':>3s} {'graph@128':>10s} "
          f"{'graph@8k':>9s} {'sync':>7s} {'async':>7s} {'8k':>7s} tokens")
    for r in results:
        same = base.get((r["weights"], r["mode"], r["attn"]))
        if same is None and r["pdl"]:            # no run of this mode without PDL: vs the first run
            verdict = "same as 1st" if first[r["weights"]] == r["tokens"] else "differ from 1st"
        else:
            verdict = "-" if not r["pdl"] else ("same" if same == r["tokens"] else "DIFFER")
        print(f"{r['weights']:11s} {r['mode']:15s} {r['pdl']:3d} {r['prefetch']:2d} {r['attn']:>8s} {r['round']:3d} "
              f"{r['graph_ms_128']:10.3f} {r['graph_ms_8k']:9.3f} {r['sync_tok_s']:7.1f} "
              f"{r['async_tok_s']:7.1f} {r['tok_s_8k']:7.1f} {verdict}")
    if len({m["attn"] for m in means}) > 1:
        print("\nper attention configuration, mean of the rounds (graph ms, async tok/s):")
        for m in means:
            print(f"{m['weights']:11s} {m['mode']:15s} {m['pdl']:3d} {m['attn']:>10s}  {m['graph_ms_128']:.3f} @128  "
                  f"{m['graph_ms_8k']:.3f} @8k  {m['async_tok_s']:7.1f} async  ({m['rounds']} rounds)")
        if best:
            print(f"fastest bf16 gemv:1 configuration (128 + 8k graph ms): {best['attn']}")
    print(f"total {time.time() - T0:.0f} s")


def attention_means(results: list[dict]) -> list[dict]:
    """Mean graph ms (128, 8k) and async tok/s of each (weights, mode, pdl, attention) over its rounds."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["weights"], r["mode"], r["pdl"], r["attn"]), []).append(r)
    return [dict(weights=w, mode=mode, pdl=pdl, attn=attn, rounds=len(rs),
                 **{k: sum(r[k] for r in rs) / len(rs) for k in ("graph_ms_128", "graph_ms_8k", "async_tok_s")})
            for (w, mode, pdl, attn), rs in groups.items()]


if __name__ == "__main__":
    main()
