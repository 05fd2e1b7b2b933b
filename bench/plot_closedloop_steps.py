"""Plots the steps of the serving benchmark's concurrency-64 run on the engine alone (640 requests
of 1,024 in / 128 out; BENCHMARKS.md, fifth session): each step's GPU time against the run's
clock, mixed (prefill) steps and pure-decode steps apart. At the default step budget (1,536
tokens) the 64 clients move in waves: ~44 mixed steps prefill a wave, ~84 pure-decode steps of
64 rows follow with nothing left to prefill. A 576-token budget with piecewise graphs keeps 92%
of the steps mixed, yet the run takes as long: each mixed step's GPU time grows with its tokens.

    python bench/plot_closedloop_steps.py   ->  bench/plots/h200_closedloop_steps.png

Reads bench/results/results_closedloop_traces_2026-11-29_s5.json (engine_perf.py's closed-loop traces:
kind, rows, tokens, wall ms, device ms per step).
"""
from __future__ import annotations

import json
from itertools import accumulate
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RESULTS_DIR = HERE / "results"   # the stored device results
TRACES = RESULTS_DIR / "results_closedloop_traces_2026-11-29_s5.json"
RUNS = ["call 6: budget 1536 eager mixed", "call 6: budget 576 piecewise graphs"]
COLORS = {"mixed": "tab:orange", "decode": "tab:blue"}


def main() -> None:
    runs = json.loads(TRACES.read_text())["runs"]
    fig, axes = plt.subplots(len(RUNS), 1, figsize=(11, 6.5), sharex=True)
    for ax, name in zip(axes, RUNS):
        steps = runs[name]
        clock = [0.0, *accumulate(s[3] / 1e3 for s in steps)][:-1]      # s, from the wall times
        total = sum(s[3] for s in steps) / 1e3
        for kind, color in COLORS.items():
            pts = [(t, s[4]) for t, s in zip(clock, steps) if s[0] == kind]
            share = sum(s[3] for s in steps if s[0] == kind) / 1e3 / total
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=3, color=color,
                       label=f"{kind}: {len(pts)} steps, {100 * share:.0f}% of the steps' time")
        ax.set_title(f"{name.split(': ')[1]}: {total:.1f} s of steps", fontsize=10)
        ax.set_ylabel("GPU ms per step")
        ax.set_xlim(0, 6)
        ax.legend(loc="upper right", fontsize=8, markerscale=3)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("run time, s (the first 6 s)")
    fig.suptitle("H200, Llama-3.1-8B shape, engine closed loop c=64 (1,024 in / 128 out): steps over time",
                 fontsize=11)
    fig.tight_layout()
    out = HERE / "plots" / "h200_closedloop_steps.png"
    out.parent.mkdir(exist_ok=True)
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
