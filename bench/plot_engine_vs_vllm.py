"""Plots kvmesh against vLLM 0.26.0 measured in the same device session on the same H200
(BENCHMARKS.md, fifteenth or seventeenth session, one machine: bench/gpu_bench.py's engine section, then
../shared/peer-vllm/run_peer.py, then bench/serve_bench.py --sections single,vllm: both servers
driven by the same client with the same requests): each workload's kvmesh rate as a multiple of
vLLM's (latencies as vLLM's ms over kvmesh's), with the issue's target as a tick where it has one.

    python bench/plot_engine_vs_vllm.py               ->  bench/plots/h200_engine_vs_vllm.png      (s15)
    python bench/plot_engine_vs_vllm.py --session s17 ->  bench/plots/h200_engine_vs_vllm_s17.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RESULTS_DIR = HERE / "results"   # the stored device results
# session -> (gpu_bench.py's engine run, run_peer.py's vLLM run, serve_bench.py --sections single,vllm),
# each pair from one machine
SESSIONS = {
    "s15": ("results_gpu_bench_2026-12-02_s15.json", "results_vllm_peer_2026-12-02_s15.json",
            "results_serve_single_vs_vllm_2026-12-02_s15.json"),
    "s17": ("results_gpu_bench_m2_2026-12-02_s17.json", "results_vllm_peer_2026-12-02_s17.json",
            "results_serve_single_vs_vllm_2026-12-02_s17.json"),
}

# (label, gpu_bench engine row, how its rate is read, vLLM key, target or None); the prefill rows
# are vLLM's workload (16,384 prompt tokens per length), ShareGPT-like is vLLM's own 1,000 requests
LINES = [
    ("batch-1 decode\n128 ctx", "batch-1 decode ctx=128", "per_ms", "bs1_decode_tok_s_ctx128", 240),
    ("batch-1 decode\n8k ctx", "batch-1 decode ctx=8192", "per_ms", "bs1_decode_tok_s_ctx8192", None),
    ("decode B=64", "batched decode B=64", "value", "decode_bs64_out_tok_s", None),
    ("decode B=256", "batched decode B=256", "value", "decode_bs256_out_tok_s", 18000),
    ("prefill 512", "prefill L=512 x32 (vLLM's workload)", "value", "prefill_tok_s_512", None),
    ("prefill 2k", "prefill L=2048 x8 (vLLM's workload)", "value", "prefill_tok_s_2048", 47000),
    ("prefill 8k", "prefill L=8192 x2 (vLLM's workload)", "value", "prefill_tok_s_8192", 40000),
    ("ShareGPT-like\n1,000 requests", "offline throughput 1000 reqs", "note_total", "sharegpt_like_total_tok_s", 25000),
]


# (label, run, key, lower is better, target or None): the serving runs, kvmesh serve and vLLM's server
SERVING = [
    ("serve c=1\nmedian TTFT", "c1", "median_ttft_ms", True, 20.0),
    ("serve c=1\nmedian TPOT", "c1", "median_tpot_ms", True, 4.3),
    ("serve c=64\ntotal tok/s", "c64", "total_token_throughput", False, 35000.0),
    ("serve c=64\np99 ITL", "c64", "p99_itl_ms", True, 50.0),
]


def rate(engine: dict, row: str, how: str) -> float:
    r = engine[row]
    if how == "per_ms":                       # ms/token -> tok/s
        return 1e3 / float(r["value"])
    if how == "note_total":                   # "25614 total tok/s, ..." (the value is out tok/s)
        return float(r["note"].split(" total tok/s")[0])
    return float(r["value"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--session", default="s15", choices=sorted(SESSIONS))
    session = ap.parse_args().session
    engine_file, vllm_file, serve_file = SESSIONS[session]
    vllm = json.loads((RESULTS_DIR / vllm_file).read_text())
    engine = json.loads((RESULTS_DIR / engine_file).read_text())["sections"]["engine"]
    labels, ratios, targets, texts = [], [], [], []
    for label, row, how, key, target in LINES:
        ours, theirs = rate(engine, row, how), float(vllm[key])
        labels.append(label)
        ratios.append(ours / theirs)
        targets.append(None if target is None else target / theirs)
        texts.append(f"{ours:,.0f}\nvs {theirs:,.0f}")
    serve = json.loads((RESULTS_DIR / serve_file).read_text())["sections"]
    for label, run, key, lower, target in SERVING:
        ours, theirs = float(serve["single"][run][key]), float(serve["vllm"][run][key])
        labels.append(label)
        ratios.append(theirs / ours if lower else ours / theirs)
        targets.append(None if target is None else (theirs / target if lower else target / theirs))
        fmt = "{:,.2f}" if lower else "{:,.0f}"
        texts.append(f"{fmt.format(ours)}\nvs {fmt.format(theirs)}" + (" ms" if lower else ""))
    fig, ax = plt.subplots(figsize=(16, 4.8))
    colors = ["tab:blue" if r >= 1 else "tab:red" for r in ratios]
    ax.bar(range(len(labels)), ratios, color=colors)
    top = 2.4                                  # taller bars are cut here, their label inside
    for i, (r, t) in enumerate(zip(ratios, texts)):
        y, va = (r + 0.02, "bottom") if r < top - 0.35 else (top - 0.05, "top")
        ax.text(i, y, f"{r:.2f}x\n{t}", ha="center", va=va, fontsize=7,
                color="white" if va == "top" else "black")
    for i, t in enumerate(targets):
        if t is not None:
            ax.hlines(t, i - 0.4, i + 0.4, colors="k", linestyles="--", lw=1.2,
                      label="target" if i == next(j for j, x in enumerate(targets) if x is not None) else None)
    ax.axhline(1.0, color="tab:orange", lw=1.2, label="vLLM 0.26.0 (same session)")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("kvmesh / vLLM, as speed (higher is better)")
    ax.set_ylim(0, top)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"kvmesh vs vLLM 0.26.0 on one H200 in one session ({session}), random Llama-3.1-8B bf16: the engines "
                 "offline (tok/s; ShareGPT-like: vLLM's own 1,000 requests), then both servers under one client",
                 fontsize=10)
    fig.tight_layout()
    out = HERE / "plots" / ("h200_engine_vs_vllm.png" if session == "s15" else f"h200_engine_vs_vllm_{session}.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
