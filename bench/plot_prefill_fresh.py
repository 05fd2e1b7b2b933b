"""Plots the sixteenth session's prefill work on the H200 (BENCHMARKS.md): left, the fresh-prompt
attention kernel against paged_prefill_attention's v2 (its default configurations) per case, from
bench/sweep_prefill_attention.py --only-fresh; right, the engine's prefill tok/s with the fresh
kernel and the residual adds in the GEMMs against the same engine without them, from
bench/engine_perf.py --prefill-variants default,baseline (the committed code, call 6).

    python bench/plot_prefill_fresh.py   ->  bench/plots/h200_prefill_fresh.png
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RESULTS_DIR = HERE / "results"   # the stored device results
SWEEP = "results_sweep_prefill_fresh_2026-12-02_s16.json"
ENGINE = "results_engine_perf_vs_baseline_final_2026-12-02_s16.json"
CASES = ["32 x 512 fresh", "8 x 2k fresh", "1 x 8k fresh", "1 x 32k fresh"]


def best(variants: dict, prefix: str) -> float:
    return max(v["tflops"] for name, v in variants.items() if name.startswith(prefix) and v.get("tflops"))


def engine_lines(rows: dict) -> list[tuple[str, float, float]]:
    """(label, default tok/s, baseline tok/s) per prefill line."""
    out = []
    for name, row in rows.items():
        if name.startswith("prefill") and not name.endswith("[baseline]"):
            label = name.removeprefix("prefill ").replace(" (vLLM's workload)", "\n(vLLM's, 1 step)")
            out.append((label, float(row["value"].split()[0]), float(rows[name + " [baseline]"]["value"].split()[0])))
    return out


def main() -> None:
    sweep = json.loads((RESULTS_DIR / SWEEP).read_text())["cases"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1, 1.5]})
    v2 = [best(sweep[c]["variants"], "v2 ") for c in CASES]
    fresh = [best(sweep[c]["variants"], "fresh ") for c in CASES]
    xs = range(len(CASES))
    ax1.bar([x - 0.2 for x in xs], v2, 0.4, color="tab:gray", label="v2 (paged_prefill_attention), its defaults")
    ax1.bar([x + 0.2 for x in xs], fresh, 0.4, color="tab:blue", label="fresh_prefill_attention, best config")
    for x, a, b in zip(xs, v2, fresh):
        ax1.text(x + 0.2, b + 5, f"{b / a:.2f}x", ha="center", fontsize=9)
    ax1.set_xticks(list(xs), [c.removesuffix(" fresh") for c in CASES])
    ax1.set_ylabel("TFLOP/s (causal), CUDA-graph replays")
    ax1.set_ylim(0, 700)
    ax1.set_title("Prefill attention kernels, Llama-8B heads, bf16")
    ax1.legend(loc="upper left", fontsize=8)

    lines = engine_lines(json.loads((RESULTS_DIR / ENGINE).read_text()))
    xs = range(len(lines))
    ax2.bar([x - 0.2 for x in xs], [b for _, _, b in lines], 0.4, color="tab:gray",
            label="without (adds in the norms, v2 attention)")
    ax2.bar([x + 0.2 for x in xs], [a for _, a, _ in lines], 0.4, color="tab:green",
            label="with the fresh kernel and the adds in the GEMMs")
    for x, (_, a, b) in zip(xs, lines):
        ax2.text(x + 0.2, a + 200, f"{100 * (a / b - 1):+.1f}%", ha="center", fontsize=9)
    ax2.set_xticks(list(xs), [label for label, _, _ in lines], fontsize=8)
    ax2.set_ylim(30_000, 48_000)
    ax2.set_ylabel("prompt tok/s (axis from 30k)")
    ax2.set_title("The engine's prefill, one engine, lines alternating (random Llama-3.1-8B)")
    ax2.legend(loc="upper right", fontsize=8)
    fig.suptitle("H200, sixteenth session: bench/sweep_prefill_attention.py --only-fresh (call 5), "
                 "bench/engine_perf.py --prefill-variants default,baseline (call 6)", fontsize=10)
    fig.tight_layout()
    out = HERE / "plots" / "h200_prefill_fresh.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
