"""Plots the eighteenth session's prefill work on the H200 (BENCHMARKS.md): left, attention of
chunks behind a cached prefix per case, from bench/sweep_prefill_attention.py --only-fresh (v2 at
its default configuration, v2 at its best, fresh_prefill_attention at the configuration
fresh_config picks); right, the engine's prompt tok/s with those chunks on either kernel, from
bench/engine_perf.py's behind part and --closedloop-kernel-ab (each line's last round).

    python bench/plot_prefill_behind.py   ->  bench/plots/h200_prefill_behind.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
RESULTS_DIR = HERE / "results"   # the stored device results
SWEEP = "results_sweep_prefill_behind_prefix_2026-12-03_s18.json"
ENGINE = "results_engine_perf_behind_prefix_ab_2026-12-03_s18.json"
# case: (max_query_len, max_context_len) as the backend sees the step
CASES = {"32 x 512 behind 1.5k": (512, 2048), "8 x 2k behind 2k": (2048, 4096),
         "2k chunk behind 6k + 64 decodes": (2048, 8192), "1 x 8k behind 24k": (8192, 32768),
         "1k chunk behind 512 + 60 decodes": (1024, 1536)}
V2_DEFAULT = {512: "v2 bm64 bn64 w4 s3 tma", 1024: "v2 bm64 bn64 w4 s3 tma", 2048: "v2 bm64 bn64 w4 s3 tma",
              8192: "v2 bm128 bn128 w8 s3 tma"}            # PREFILL_CONFIGS' entry for the chunk length


def tflops(variants: dict, name: str) -> float:
    return variants[name]["tflops"]


def picked(q: int, ctx: int) -> str:
    from gpu_worker.kernels.fresh_prefill_attention import fresh_config
    c = fresh_config(q, ctx)
    return f"fresh bm{c.block_m} bn{c.block_n} w{c.num_warps} s{c.num_stages}"


def engine_pairs(rows: dict) -> list[tuple[str, float, float]]:
    """(label, fresh kernel tok/s, v2 tok/s): the last value of each line's two rounds."""
    last: dict[str, float] = {}
    for name, row in rows.items():
        last[name] = float(row["value"].split()[0]) if row["value"][0].isdigit() else float("nan")
    out = []
    for name in rows:
        if name.endswith("[fresh kernel]"):
            base = name.removesuffix(" [fresh kernel]")
            out.append((base, last[name], last[base + " [v2]"]))
    loop = "closed-loop c64 budget=1536"
    if loop in last:
        out.append(("serving c=64 closed loop\n(total tok/s)", last[loop], last[loop + " [v2 behind a prefix]"]))
    return out


def main() -> None:
    sweep = json.loads((RESULTS_DIR / SWEEP).read_text())["cases"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1.4, 1]})
    names = list(CASES)
    xs = range(len(names))
    v2d = [tflops(sweep[n]["variants"], V2_DEFAULT[CASES[n][0]]) for n in names]
    v2b = [max(v["tflops"] for k, v in sweep[n]["variants"].items() if k.startswith("v2 bm") and v.get("tflops"))
           for n in names]
    fr = [tflops(sweep[n]["variants"], picked(*CASES[n])) for n in names]
    ax1.bar([x - 0.27 for x in xs], v2d, 0.27, color="tab:gray", label="v2, its default configuration")
    ax1.bar(list(xs), v2b, 0.27, color="silver", label="v2, its best configuration")
    ax1.bar([x + 0.27 for x in xs], fr, 0.27, color="tab:blue", label="fresh_prefill_attention (fresh_config)")
    for x, a, b in zip(xs, v2d, fr):
        ax1.text(x + 0.27, b + 5, f"{b / a:.2f}x", ha="center", fontsize=9)
    ax1.set_xticks(list(xs), [n.replace(" + ", "\n+ ") for n in names], fontsize=8)
    ax1.set_ylabel("TFLOP/s (causal), CUDA-graph replays")
    ax1.set_ylim(0, 520)
    ax1.set_title("Attention of chunks behind a cached prefix, Llama-8B heads, bf16")
    ax1.legend(loc="upper left", fontsize=8)

    pairs = engine_pairs(json.loads((RESULTS_DIR / ENGINE).read_text()))
    xs = range(len(pairs))
    ax2.bar([x - 0.2 for x in xs], [b for _, _, b in pairs], 0.4, color="tab:gray", label="v2 behind a prefix")
    ax2.bar([x + 0.2 for x in xs], [a for _, a, _ in pairs], 0.4, color="tab:blue", label="fresh_prefill_attention")
    for x, (_, a, b) in zip(xs, pairs):
        ax2.text(x + 0.2, a + 400, f"{a / b:.3f}x", ha="center", fontsize=9)
    ax2.set_xticks(list(xs), [p[0].replace(", budget", "\nbudget").replace(" behind", "\nbehind") for p in pairs],
                   fontsize=8)
    ax2.set_ylabel("tok/s (prompt; closed loop: total)")
    ax2.set_title("The engine (random Llama-3.1-8B), same call, alternating")
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = HERE / "plots" / "h200_prefill_behind.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
