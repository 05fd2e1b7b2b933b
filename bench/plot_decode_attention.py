"""Plots the batch-1 decode step per decode-attention configuration on the H200 (BENCHMARKS.md,
ninth session): GPU ms of one CUDA-graph replay at 128 and 8k context, mean of the rounds, for
bf16, fp8 and fp8 with an fp8 lm_head, from bench/pdl_decode_ab.py's calls 1-3.

    python bench/plot_decode_attention.py   ->  bench/plots/h200_decode_attention.png
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RESULTS_DIR = HERE / "results"   # the stored device results
CALLS = ["results_pdl_ab_attention_first_2026-12-01_s9.json", "results_pdl_ab_short_split_2026-12-01_s9.json",
         "results_pdl_ab_merge_warps_2026-12-01_s9.json"]
TARGET_MS = 1000 / 240          # the bf16 batch-1 target, 240 tok/s
FLOOR_MS = 3.54                 # bf16 weights read once at the measured copy rate


def means() -> dict[tuple[str, str], tuple[float, float]]:
    """(weights, configuration) -> (graph ms at 128, at 8k); a later call's mean replaces an earlier one."""
    out = {}
    for name in CALLS:
        for m in json.loads((RESULTS_DIR / name).read_text())["means"]:
            out[(m["weights"], m["attn"])] = (m["graph_ms_128"], m["graph_ms_8k"])
    return out


def main() -> None:
    data = means()
    fig, axes = plt.subplots(1, 3, figsize=(15, 6), sharey=False)
    for ax, weights in zip(axes, ("bf16", "fp8", "fp8_lm_head")):
        rows = sorted(((cfg, v) for (w, cfg), v in data.items() if w == weights), key=lambda x: -x[1][0])
        names = [cfg + (" (old default)" if cfg == "u+2p" else " (default)" if cfg == "s16x16+2p1" else "")
                 for cfg, _ in rows]
        y = range(len(rows))
        ax.barh([i + 0.2 for i in y], [v[0] for _, v in rows], height=0.4, label="128 context", color="tab:blue")
        ax.barh([i - 0.2 for i in y], [v[1] for _, v in rows], height=0.4, label="8k context", color="tab:orange")
        ax.set_yticks(list(y), names, fontsize=8)
        ax.set_xlabel("GPU ms per batch-1 step (CUDA-graph replay)")
        ax.set_title(weights)
        lo = min(min(v) for _, v in rows)
        ax.set_xlim(lo * 0.9, max(max(v) for _, v in rows) * 1.02)
        if weights == "bf16":
            ax.axvline(TARGET_MS, color="tab:red", ls="--", lw=1, label="240 tok/s target")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False)
    fig.suptitle("Llama-3.1-8B shapes, batch-1 decode on one H200, per decode-attention configuration "
                 "(bench/pdl_decode_ab.py)")
    fig.tight_layout()
    out = HERE / "plots" / "h200_decode_attention.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
