"""Plots from the benchmarks' JSON: kvmesh against vLLM on one machine, and the sustained GEMM rates.

    python bench/plot.py vs-vllm [--engine GPU_BENCH.json --vllm VLLM_PEER.json --serve SERVE.json] [--out PNG]
    python bench/plot.py gemm [--gemm GPU_BENCH.json] [--out PNG]

The defaults are the results BENCHMARKS.md cites (bench/results/), and the PNGs it and the README
show (bench/plots/). `vs-vllm` reads gpu_bench.py's engine section, vllm_peer.py's JSON and
serve_bench.py's `single` and `vllm` sections, all from one machine: each line's kvmesh rate as a
multiple of vLLM's (latencies as vLLM's ms over kvmesh's). Batched decode is left out: gpu_bench
times kvmesh's steady state after the prefills, vllm_peer.py one `generate` call with them, so
the two figures are not the same measurement. `gemm` reads the `sustained` section of gpu_bench.py.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RESULTS = HERE / "results"
PLOTS = HERE / "plots"

# (label, gpu_bench engine row, how its rate is read, vllm_peer key, target or None); the prefill
# rows are vLLM's workload (16,384 prompt tokens per length); ShareGPT-like is vLLM's 1,000 requests
ENGINE_LINES = [
    ("batch-1 decode\n128 ctx", "batch-1 decode ctx=128", "per_ms", "bs1_decode_tok_s_ctx128", 240),
    ("batch-1 decode\n8k ctx", "batch-1 decode ctx=8192", "per_ms", "bs1_decode_tok_s_ctx8192", None),
    ("prefill 512", "prefill L=512 x32 (vLLM's workload)", "value", "prefill_tok_s_512", None),
    ("prefill 2k", "prefill L=2048 x8 (vLLM's workload)", "value", "prefill_tok_s_2048", 47000),
    ("prefill 8k", "prefill L=8192 x2 (vLLM's workload)", "value", "prefill_tok_s_8192", 40000),
    ("ShareGPT-like\n1,000 requests", "offline throughput 1000 reqs", "note_total", "sharegpt_like_total_tok_s", 25000),
]
# (label, run, key, lower is better, target or None): kvmesh serve and vLLM's server, one client
SERVING_LINES = [
    ("serve c=1\nmedian TTFT", "c1", "median_ttft_ms", True, 20.0),
    ("serve c=1\nmedian TPOT", "c1", "median_tpot_ms", True, 4.3),
    ("serve c=64\ntotal tok/s", "c64", "total_token_throughput", False, 35000.0),
    ("serve c=64\np99 ITL", "c64", "p99_itl_ms", True, 50.0),
]
GFLOP_PER_TOKEN = 13.96     # Llama-3.1-8B's dense layer GEMMs, 2 x 6.98e9 weights
PREFILL_TARGETS = {"47k tok/s (2k target)": 47_000, "40k tok/s (8k target)": 40_000}


def engine_rate(engine: dict, row: str, how: str) -> float:
    r = engine[row]
    if how == "per_ms":                       # ms/token -> tok/s
        return 1e3 / float(r["value"])
    if how == "note_total":                   # "25614 total tok/s, ..." (the value is out tok/s)
        return float(r["note"].split(" total tok/s")[0])
    return float(r["value"])


def vs_vllm(args) -> Path:
    engine = json.loads(Path(args.engine).read_text())["sections"]["engine"]
    vllm = json.loads(Path(args.vllm).read_text())
    serve = json.loads(Path(args.serve).read_text())["sections"]
    labels, ratios, targets, texts = [], [], [], []
    for label, row, how, key, target in ENGINE_LINES:
        ours, theirs = engine_rate(engine, row, how), float(vllm[key])
        labels.append(label)
        ratios.append(ours / theirs)
        targets.append(None if target is None else target / theirs)
        texts.append(f"{ours:,.0f}\nvs {theirs:,.0f}")
    for label, run, key, lower, target in SERVING_LINES:
        ours, theirs = float(serve["single"][run][key]), float(serve["vllm"][run][key])
        labels.append(label)
        ratios.append(theirs / ours if lower else ours / theirs)
        targets.append(None if target is None else (theirs / target if lower else target / theirs))
        fmt = "{:,.2f}" if lower else "{:,.0f}"
        texts.append(f"{fmt.format(ours)}\nvs {fmt.format(theirs)}" + (" ms" if lower else ""))
    fig, ax = plt.subplots(figsize=(14, 4.8))
    ax.bar(range(len(labels)), ratios, color=["tab:blue" if r >= 1 else "tab:red" for r in ratios])
    top = 2.4                                  # taller bars are cut here, their label inside
    for i, (r, t) in enumerate(zip(ratios, texts)):
        y, va = (r + 0.02, "bottom") if r < top - 0.35 else (top - 0.05, "top")
        ax.text(i, y, f"{r:.2f}x\n{t}", ha="center", va=va, fontsize=7, color="white" if va == "top" else "black")
    first_target = next((i for i, t in enumerate(targets) if t is not None), None)
    for i, t in enumerate(targets):
        if t is not None:
            ax.hlines(t, i - 0.4, i + 0.4, colors="k", linestyles="--", lw=1.2,
                      label="target" if i == first_target else None)
    ax.axhline(1.0, color="tab:orange", lw=1.2, label=f"vLLM {vllm.get('vllm_version', '')} (same machine)")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("kvmesh / vLLM, as speed (higher is better)")
    ax.set_ylim(0, top)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("kvmesh vs vLLM on one H200, random Llama-3.1-8B bf16: the engines offline (tok/s), then both "
                 "servers under one client (batched decode not shown: timed differently)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return Path(args.out)


def gemm(args) -> Path:
    data = json.loads(Path(args.gemm).read_text())
    rows = data["sustained_gemm"] if isinstance(data, dict) else data    # gpu_bench.json, or its rows alone
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, ax = plt.subplots(figsize=(13, 6))
    width = 0.2
    for j, (backend, kind, color) in enumerate([("cublas", "burst_tflops", "tab:blue"),
                                                ("cublas", "sustained_tflops", "navy"),
                                                ("cublaslt", "burst_tflops", "tab:orange"),
                                                ("cublaslt", "sustained_tflops", "saddlebrown")]):
        vals = {r["shape"]: r[kind] for r in rows if r["backend"] == backend}
        if vals:
            ax.bar([i + (j - 1.5) * width for i in range(len(shapes))], [vals.get(s, 0) for s in shapes], width,
                   color=color, label=f"{backend}, {kind.split('_')[0]}")
    for (label, tok_s), ls in zip(PREFILL_TARGETS.items(), ("--", ":")):
        need = tok_s * GFLOP_PER_TOKEN / 1000
        ax.axhline(need, color="tab:red", ls=ls, lw=1.2,
                   label=f"GEMMs alone at {label}: {need:.0f} TFLOP/s, nothing else in the step")
    ax.set_xticks(range(len(shapes)), shapes, rotation=20, ha="right", fontsize=9)
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(450, 800)
    ax.legend(fontsize=8, ncol=2, loc="lower left")
    ax.set_title("bf16 GEMMs on one H200: ten products after a pause (burst) against 2 s back to back "
                 "(sustained, at the ~690 W cap)\n(bench/gpu_bench.py --sections sustained)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return Path(args.out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="plot", required=True)
    p = sub.add_parser("vs-vllm", help="kvmesh against vLLM, engines offline and servers")
    p.add_argument("--engine", default=RESULTS / "gpu_bench_beside_vllm_2026-12-02.json")
    p.add_argument("--vllm", default=RESULTS / "vllm_peer_2026-12-02.json")
    p.add_argument("--serve", default=RESULTS / "serve_bench_vs_vllm_2026-12-02.json")
    p.add_argument("--out", default=PLOTS / "h200_vs_vllm.png")
    p.set_defaults(draw=vs_vllm)
    p = sub.add_parser("gemm", help="bf16 GEMMs in a burst and sustained")
    p.add_argument("--gemm", default=RESULTS / "gemm_sustained_2026-12-01.json")
    p.add_argument("--out", default=PLOTS / "h200_gemm_sustained.png")
    p.set_defaults(draw=gemm)
    args = ap.parse_args(argv)
    print(args.draw(args))


if __name__ == "__main__":
    main()
