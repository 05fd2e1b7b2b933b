#!/usr/bin/env python3
"""Paged decode attention (gpu_worker/kernels/paged_decode_attention.py) at the batch sizes and
short contexts of a large offline run (ShareGPT-like: hundreds of rows, a few hundred tokens
each), where the defaults were never swept (gpu_bench.py --sweep tuned B = 1 / 64 at 8k+ contexts).

For each (B, mean context): context lengths drawn around the mean (uniform 0.5x..1.5x), a
fragmented block table of 16-token pages, Llama-8B heads (32 q / 8 kv, 128 dims); every
(block_n, num_warps, num_stages) is checked against the default's output, then timed in a CUDA
graph; GB/s = the KV bytes the step must read. Prints the default and the best per case.
With --splits the split count is swept too (each count with a few tile shapes, the two-pass
merge included in the time): the long decode graphs fix it per captured batch size
(choose_num_splits), so this shows what each batch size should get at a given context.

The timed graph cycles through copies of the KV cache that together hold >= KV_WORKING_SET
bytes, as a model's 32 layers do (the twelfth session's first --splits run re-read one copy,
partly from the 50 MB L2); --rope fuses RoPE + the KV write into split programs as the graphs
do. Even so, an isolated kernel is not the engine's: the winners at B=4-32 (4-warp 64-key
programs, more splits) measured 12-53% slower inside the engine's decode graphs, with or without
those two (BENCHMARKS.md, twelfth session: PDL beside the GEMMs and a cache spread over ~100 GB
are not ruled out). Check a policy there before adopting it: engine_perf.py --profile-cases B:ctx.

--exact gives every sequence the case's context (as gpu_bench.py's rows); --max-context-len is the
bound the calls pass (a decode graph's: it picks the default split); --merges and --tiles widen
the --splits sweep; --kv-dtype fp8 stores the cache in e4m3 with per-tensor scales; --pdl times
the graphs with programmatic dependent launch, as the engine's decode graphs run. Every config's
time goes to the JSON ("timings"; printed too for up to PRINT_EACH configs a case).

    PYTHONPATH=. python3 bench/sweep_decode_batch.py            # the H200, ~60 s
    PYTHONPATH=. python3 bench/sweep_decode_batch.py --exact --max-context-len 32768 --splits 16,32,64 \
        --merges two_pass,last --tiles 128:8:3,64:4:2 --cases 1:32768     # batch 1, long context
    PYTHONPATH=. TRITON_INTERPRET=1 python3 bench/sweep_decode_batch.py --smoke   # CPU check
Writes $OUT/sweep_decode_batch.json (OUT defaults to ./out).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gpu_worker.kernels.paged_decode_attention import (choose_decode_split,  # noqa: E402
                                                       paged_decode_attention, paged_decode_attention_ref)

H, KVH, D, PAGE = 32, 8, 128, 16
KV_WORKING_SET = 256 * 1024 ** 2     # bytes of distinct KV the timed graph cycles through (> L2)
# tile shapes (block_n, num_warps, num_stages) tried with each --splits count
SPLIT_TILES = [(64, 4, 2), (128, 4, 3), (128, 8, 3), (64, 8, 3), (32, 4, 3)]
PRINT_EACH = 24                      # configs per case up to which each one's time is printed


def make_case(B: int, mean_ctx: int, dev, dtype, seed: int = 0, exact: bool = False):
    rng = random.Random(seed)
    lens = [mean_ctx if exact else max(1, int(mean_ctx * rng.uniform(0.5, 1.5))) for _ in range(B)]
    need = [-(-n // PAGE) for n in lens]
    g = torch.Generator(device=dev).manual_seed(seed)
    perm = torch.randperm(sum(need), device=dev, generator=g).int()
    tables = torch.zeros((B, max(need)), dtype=torch.int32, device=dev)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used: used + nb]
        used += nb
    k = torch.randn((sum(need), PAGE, KVH, D), device=dev, dtype=dtype, generator=g)
    v = torch.randn((sum(need), PAGE, KVH, D), device=dev, dtype=dtype, generator=g)
    q = torch.randn((B, H, D), device=dev, dtype=dtype, generator=g)
    cl = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, k, v, tables, cl, sum(lens)


def fused_rope(q, k, tables, cl):
    """FusedRopeKV for the case: each sequence's new token at its last position (a decode step)."""
    from gpu_worker.kernels.paged_decode_attention import FusedRopeKV
    B, dev = q.shape[0], q.device
    pos = (cl - 1).long()
    slots = tables[torch.arange(B, device=dev), pos // PAGE].long() * PAGE + pos % PAGE
    ang = torch.arange(int(cl.max()), device=dev, dtype=torch.float32)[:, None] * 1e-3
    cos_sin = torch.cat([ang.cos().expand(-1, D // 2), ang.sin().expand(-1, D // 2)], dim=1).contiguous()
    kn = torch.randn((B, KVH, D), device=dev, dtype=q.dtype)
    return FusedRopeKV(pos, cos_sin, kn, torch.randn_like(kn), slots)


def _split_order(item: tuple[str, tuple]) -> tuple[int, str]:
    """by_split's keys "N" / "N/merge" in split-count order."""
    n, _, rest = item[0].partition("/")
    return int(n), rest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="768:270,384:300,192:350,64:500,16:1000",
                    help="B:mean_context, comma-separated")
    ap.add_argument("--splits", default="", help="comma list of split counts: sweep those (each with "
                    "SPLIT_TILES) instead of the unsplit tile grid")
    ap.add_argument("--rope", action="store_true", help="time split configs (num_splits > 1) as the decode "
                    "graphs run them: RoPE + this step's KV write fused in (FusedRopeKV)")
    ap.add_argument("--exact", action="store_true", help="every sequence exactly the case's context (gpu_bench.py's "
                    "cases), not drawn around it")
    ap.add_argument("--max-context-len", type=int, default=16384, help="the host-side bound the calls pass "
                    "(a decode graph's: the model's max length), which picks the default split")
    ap.add_argument("--merges", default="", help="comma list of split merges (last, two_pass): sweep those "
                    "with --splits (default: the module's SPLIT_MERGE only)")
    ap.add_argument("--tiles", default="", help="comma list of block_n:num_warps:num_stages tried with each "
                    "--splits count (default: SPLIT_TILES)")
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"), help="the cache's dtype: fp8 "
                    "stores the same values in e4m3 with per-tensor scales (kv_cache_dtype fp8)")
    ap.add_argument("--pdl", action="store_true", help="capture the timed graphs with PDL, as the engine's "
                    "decode graphs launch the kernels (each call starts while the one before finishes)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.merges and not args.splits:
        ap.error("--merges needs --splits")
    tiles = SPLIT_TILES
    if args.tiles:
        try:
            tiles = [tuple(map(int, t.split(":"))) for t in args.tiles.split(",")]
            assert all(len(t) == 3 for t in tiles)
        except (ValueError, AssertionError):
            ap.error(f"--tiles takes block_n:num_warps:num_stages,..., got {args.tiles!r}")
    merges = [None] + [m for m in args.merges.split(",") if m]
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cases = ["3:20"] if args.smoke else args.cases.split(",")
    configs = [(None, bn, nw, ns, None) for bn in (16, 32, 64, 128) for nw in (2, 4, 8) for ns in (1, 2, 3)]
    if args.splits:
        configs = [(sp, bn, nw, ns, mg) for sp in map(int, args.splits.split(",")) for bn, nw, ns in tiles
                   for mg in (merges[1:] or merges)]
    if args.smoke:
        configs = [(None, 16, 4, 1, None)] + ([(2, 16, 4, 1, mg) for mg in (merges[1:] or merges)] if args.splits else [])
    results = []
    for case in cases:
        B, ctx = map(int, case.split(":"))
        q, k, v, tables, cl, tokens = make_case(B, ctx, dev, dtype, exact=args.exact)
        # as the engine's long decode graphs call it: max_context_len of the model, splits chosen
        call = dict(max_context_len=max(args.max_context_len, int(cl.max())))
        if args.kv_dtype == "fp8":     # per-tensor scales, as the engine's fp8 cache keeps them
            ks, vs = (float(t.abs().max()) / 448.0 for t in (k, v))
            k, v = (k / ks).to(torch.float8_e4m3fn), (v / vs).to(torch.float8_e4m3fn)
            call.update(k_scale=ks, v_scale=vs)
        nbytes = 2 * tokens * KVH * D * k.element_size()
        scale = D ** -0.5
        out = paged_decode_attention(q, k, v, tables, cl, scale, **call)
        ref = paged_decode_attention_ref(q[:4].float(), k.float(), v.float(), tables[:4], cl[:4], scale,
                                         k_scale=call.get("k_scale", 1.0), v_scale=call.get("v_scale", 1.0))
        err = ((out[:4].float() - ref).abs().max() / ref.abs().max()).item()

        # copies of the cache for the timings, so that no call finds its KV in L2 (and --rope's
        # writes never reach the k, v the outputs are checked on)
        copies = [(k.clone(), v.clone()) for _ in range(min(16, -(-KV_WORKING_SET // nbytes)))]
        rope = fused_rope(q, k, tables, cl) if args.rope else None

        # the default config is split (and so fused) as choose_decode_split splits it
        default_split = choose_decode_split(B, KVH, call["max_context_len"], dev, H // KVH, k.dtype)

        def timed(**cfg) -> float:
            split = cfg["num_splits"] > 1 if "num_splits" in cfg else default_split.fine
            fused = rope if rope is not None and split else None
            if args.smoke:
                paged_decode_attention(q, *copies[0], tables, cl, scale, **call, **cfg, rope=fused)
                return 1.0
            from cuda_timing import graph_median_ms
            turn = itertools.cycle(copies)

            def one():
                kc, vc = next(turn)
                return paged_decode_attention(q, kc, vc, tables, cl, scale, **call, **cfg, rope=fused)
            return graph_median_ms(one, inner=max(5, len(copies)), reps=5, pdl=args.pdl)

        base = timed()
        best = (base, "default")
        by_split: dict[str, tuple[float, str]] = {}      # "splits" or "splits/merge" -> best
        timings: list[dict] = []
        for sp, bn, nw, ns, mg in configs:
            cfg = dict(block_n=bn, num_warps=nw, num_stages=ns)
            if sp is not None:
                cfg["num_splits"] = sp
            if mg is not None:
                cfg["merge"] = mg
            try:
                o2 = paged_decode_attention(q, k, v, tables, cl, scale, **call, **cfg)
                if ((o2.float() - out.float()).abs().max() / out.float().abs().max()).item() > 2e-2:
                    print(f"  B={B} ctx={ctx} {cfg}: WRONG", flush=True)
                    continue
                t = timed(**cfg)
            except Exception as exc:          # e.g. out of shared memory
                print(f"  B={B} ctx={ctx} {cfg}: {type(exc).__name__}", flush=True)
                continue
            label = (("" if sp is None else f"splits={sp} ") + f"bn={bn} warps={nw} stages={ns}"
                     + ("" if mg is None else f" merge={mg}"))
            timings.append({"config": label, "us": t * 1e3})
            if len(configs) <= PRINT_EACH:
                print(f"  B={B} ctx={ctx} {label}: {t * 1e3:.1f} us", flush=True)
            if t < best[0]:
                best = (t, label)
            key = f"{sp}" if mg is None else f"{sp}/{mg}"
            if sp is not None and t < by_split.get(key, (float("inf"), ""))[0]:
                by_split[key] = (t, label)
        gb = lambda ms: nbytes / (ms * 1e-3) / 1e9      # noqa: E731
        results.append({"B": B, "mean_ctx": ctx, "err": err, "default_us": base * 1e3, "default_gbs": gb(base),
                        "default_split": default_split._asdict(),
                        "best_us": best[0] * 1e3, "best_gbs": gb(best[0]), "best": best[1],
                        "by_split": {sp: {"us": t * 1e3, "gbs": gb(t), "config": c} for sp, (t, c) in by_split.items()},
                        "timings": timings})
        print(f"B={B:4d} ctx~{ctx:5d} err {err:.1e}: default {base * 1e3:7.1f} us ({gb(base):5.0f} GB/s, "
              f"{default_split}), best {best[0] * 1e3:7.1f} us ({gb(best[0]):5.0f} GB/s) {best[1]}", flush=True)
        if by_split:
            print("    by split: " + ", ".join(f"{sp}: {t * 1e3:.1f} us {gb(t):.0f} GB/s"
                                             for sp, (t, _) in sorted(by_split.items(), key=_split_order)), flush=True)
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep_decode_batch.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
