#!/usr/bin/env python3
"""The batch-1 GEMV configs (gpu_worker/kernels/fp8_gemv.py TUNED) tuned inside the decode graph.

bench/sweep_gemv.py tuned each GEMV alone, with CUDA events around one launch. Inside a batch-1
decode CUDA graph with programmatic dependent launch the kernels overlap their start and end with
their neighbours', so another config may win there. This sweep changes one layer shape's M=1
config at a time, recaptures the decode graphs and times the batch-1 replay at 128 context
(CUDA events, median of `--reps`): coordinate descent over qkv, o_proj, gate_up, down (or the
`--shapes` given: `lm_head` is the 16-bit head, a GEMV where the layers run GEMVs), for the bf16
weights, then for the same weights quantized to fp8 (`--kinds`). A candidate replaces the best so far
when it is faster by more than `--min-gain-us`. At the end the starting and the final configs are
timed against each other in alternation, and the greedy tokens of both are compared (a different
split-K changes the order of fp32 sums, which may flip a near-tie, so a difference is reported,
not fatal).

    python3 bench/sweep_gemv_in_graph.py --model-dir /tmp/kvmesh-llama-8b --budget 300   # the H200
    python3 bench/sweep_gemv_in_graph.py --model-dir /tmp/kvmesh-llama-8b --tiles wide --kinds 16bit
    python3 bench/sweep_gemv_in_graph.py --model-dir /tmp/kvmesh-llama-8b --shapes lm_head --kinds 16bit
    python3 bench/sweep_gemv_in_graph.py --smoke                                         # CPU: the flow

Prints the winners as TUNED lines to paste and a table last; writes $OUT/sweep_gemv_in_graph.json.
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

from pdl_decode_ab import T0, Decode, build_decode, log  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
LAYER_SHAPES = "qkv,o_proj,gate_up,down"


def tuned_key(kind: str, name: str) -> tuple[str, int, int, int]:
    """The M=1 TUNED key of a shape; the lm_head stays 16-bit under fp8 weights (CausalLM.head_gemv)."""
    N, K = SHAPES[name]
    return ("16bit" if name == "lm_head" else kind, 1, N, K)


def current_config(kind: str, name: str):
    """TUNED's entry, else what gemv_config resolves for the shape (DEFAULTS, split resolved)."""
    from gpu_worker.kernels import fp8_gemv
    key = tuned_key(kind, name)
    if key in fp8_gemv.TUNED:
        return fp8_gemv.TUNED[key]
    dtype = torch.float8_e4m3fn if key[0] == "fp8" else torch.bfloat16
    return fp8_gemv.gemv_config(1, key[2], key[3], dtype)


# (block_n, block_k, dot, upcast, num_stages): "base" the first pass's tiles, "wide" more shapes
# and pipeline depths around the first pass's winners
TILES = {
    "base": {"16bit": [(32, 256, True, 0, 3), (64, 128, True, 0, 4), (16, 512, False, 0, 1)],
             "fp8": [(16, 512, False, 0, 1), (16, 1024, False, 0, 1), (64, 128, True, 2, 4)]},
    "wide": {"16bit": [(64, 128, True, 0, 3), (64, 128, True, 0, 5), (128, 64, True, 0, 4), (32, 128, True, 0, 4),
                       (64, 64, True, 0, 6)],
             "fp8": [(16, 512, False, 0, 2), (32, 512, False, 0, 1), (16, 256, False, 0, 1), (64, 256, True, 2, 3)]},
}


def candidates(kind: str, N: int, K: int, current, tiles: str = "base"):
    """Configs to try for one (N, K) at M=1: the current one first, then TILES[tiles] x split-K
    with between 128 and 1,600 programs (split 1 at any count: the lm_head's 128k rows)."""
    import triton

    from gpu_worker.kernels.fp8_gemv import GemvConfig
    out = [current]
    for bn, bk, dot, upcast, stages in TILES[tiles][kind]:
        for split in (1, 2, 3, 4, 6, 8):
            programs = triton.cdiv(N, bn) * split
            if split > triton.cdiv(K, bk) or programs < 128 or (programs > 1600 and split > 1):
                continue
            cfg = GemvConfig(bn, bk, split, "last", dot, upcast, 4, stages)
            if cfg != current:
                out.append(cfg)
    return out


class Sweep:
    def __init__(self, d: Decode, reps: int):
        self.d, self.reps = d, reps

    def graph_us(self) -> float:
        """Recapture the graphs with the current TUNED, fill the buffers with a real 128-token
        context, time the batch-1 replay."""
        from cuda_timing import event_median_ms
        d = self.d
        d.eng.runner.capture_cuda_graphs(4, d.eng.max_model_len)
        d.run(d.p128, 16 if not d.smoke else 4)
        g = d.eng.runner.short_decode_graphs
        if d.smoke or g is None or 1 not in g.graphs:
            return float("nan")
        return 1000 * event_median_ms(g.graphs[1].replay, self.reps, warmup=3)


def sweep_kind(sw: Sweep, kind: str, shapes: list[str], min_gain_us: float, stop: float,
               tiles: str) -> tuple[dict, list]:
    """Coordinate descent over the shapes -> (best config per shape, rows tried)."""
    from gpu_worker.kernels import fp8_gemv
    rows, best = [], {}
    base = sw.graph_us()
    log(f"{kind}: start {base:.1f} us per batch-1 step")
    for name in shapes:
        N, K = SHAPES[name]
        key = tuned_key(kind, name)
        start_cfg = current_config(kind, name)
        best_cfg, best_us = start_cfg, base
        for cfg in candidates(key[0], N, K, start_cfg, tiles)[1:3 if sw.d.smoke else None]:
            if time.time() > stop:
                log(f"{kind} {name}: time budget, keeping the best so far")
                break
            fp8_gemv.TUNED[key] = cfg
            try:
                us = sw.graph_us()
            except Exception as e:           # a config that fails to compile or launch is skipped
                log(f"{kind} {name} {cfg}: ERROR {type(e).__name__}: {e}"[:300])
                continue
            rows.append(dict(kind=kind, layer=name, config=list(cfg), step_us=us))
            log(f"{kind} {name:7s} {cfg.block_n}x{cfg.block_k} split {cfg.split_k} "
                f"{'dot' if cfg.dot else 'fma'}: {us:.1f} us")
            if us < best_us - min_gain_us:
                best_cfg, best_us = cfg, us
        fp8_gemv.TUNED[key] = best_cfg
        best[name] = best_cfg
        base = best_us
    return best, rows


def ab(sw: Sweep, kind: str, start: dict, final: dict, rounds: int = 3) -> dict:
    """Starting against final configs, alternating; median step us of each and their tokens."""
    from gpu_worker.kernels import fp8_gemv
    times, tokens = {"start": [], "final": []}, {}
    for _ in range(rounds):
        for label, cfgs in (("start", start), ("final", final)):
            for name, cfg in cfgs.items():
                fp8_gemv.TUNED[tuned_key(kind, name)] = cfg
            times[label].append(sw.graph_us())
            tokens[label] = sw.d.tokens()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return dict(start_us=med["start"], final_us=med["final"], same_tokens=tokens["start"] == tokens["final"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/kvmesh-llama-8b")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script")
    ap.add_argument("--budget", type=float, default=300, help="seconds for the sweeps (the A/B runs after)")
    ap.add_argument("--reps", type=int, default=40, help="graph replays timed per candidate")
    ap.add_argument("--min-gain-us", type=float, default=5.0, help="a candidate must beat the best by this")
    ap.add_argument("--tiles", choices=sorted(TILES), default="base", help="the tile shapes tried (TILES)")
    ap.add_argument("--kinds", default="16bit,fp8", help="comma list of weight kinds to sweep")
    ap.add_argument("--shapes", default=LAYER_SHAPES,
                    help=f"comma list from {','.join(SHAPES)} (lm_head: the 16-bit head, CausalLM.head_gemv)")
    args = ap.parse_args()
    shapes = [n for n in args.shapes.split(",") if n]
    if not shapes or any(n not in SHAPES for n in shapes):
        ap.error(f"--shapes: expected a comma list from {','.join(SHAPES)}, got {args.shapes!r}")
    from gpu_worker.kernels import fp8_gemv
    from gpu_worker.models.layers.fp8 import quantize_linears_fp8

    if not args.smoke:
        from engine_perf import ensure_model
        ensure_model(Path(args.model_dir))
        log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    d = build_decode(Path(args.model_dir), args.smoke)
    sw = Sweep(d, args.reps)
    t_start = time.time()
    results = {}
    kinds = [k for k in ("16bit", "fp8") if k in args.kinds.split(",")]
    for kind in kinds:
        if kind == "fp8":
            quantize_linears_fp8(d.eng.runner.model)
            d.eng.runner.prefill_graphs = None     # captured over the bf16 weights
        start = {name: current_config(kind, name) for name in shapes}
        share = (t_start + args.budget - time.time()) / (len(kinds) - kinds.index(kind))
        best, rows = sweep_kind(sw, kind, shapes, args.min_gain_us, time.time() + share, args.tiles)
        results[kind] = dict(start={k: list(v) for k, v in start.items()}, best={k: list(v) for k, v in best.items()},
                             rows=rows, ab=ab(sw, kind, start, best))
        log(f"{kind}: {results[kind]['ab']}")
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_gemv_in_graph.json").write_text(json.dumps(results, indent=1))

    print("\nTUNED lines (M=1) of the in-graph winners:")
    for kind, r in results.items():
        for name, cfg in r["best"].items():
            print(f"    {tuned_key(kind, name)!r}: GemvConfig{tuple(cfg)},  # {name}")
    print(f"\n{'weights':7s} {'start us':>9s} {'final us':>9s} {'gain':>7s} tokens")
    for kind, r in results.items():
        a = r["ab"]
        print(f"{kind:7s} {a['start_us']:9.1f} {a['final_us']:9.1f} {a['start_us'] - a['final_us']:7.1f} "
              f"{'same' if a['same_tokens'] else 'differ'}")
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
