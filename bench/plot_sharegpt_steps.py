"""Plots where vLLM's 1,000 ShareGPT-like requests spend the H200's time (BENCHMARKS.md, fourth
session): per decode-step size, the GPU's work and its idle wait for the host, with the start-up
heap left to Python's garbage collector and frozen (Engine.freeze_gc); beside it, the GPU's SM
clock and power over a run (the power cap lowers the clock during the big steps).

    python bench/plot_sharegpt_steps.py   ->  bench/plots/h200_sharegpt_steps.png

Reads bench/results/results_engine_perf_sharegpt_gc_2026-11-29_s4.json (the "sharegpt rows" rows of
engine_perf.py) and bench/results/h200_clocks_during_sharegpt_2026-11-29_s4.csv (nvidia-smi, 4 Hz).
"""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RESULTS_DIR = HERE / "results"   # the stored device results
RESULTS = RESULTS_DIR / "results_engine_perf_sharegpt_gc_2026-11-29_s4.json"
CLOCKS = RESULTS_DIR / "h200_clocks_during_sharegpt_2026-11-29_s4.csv"
ROW = "sharegpt rows async max_num_seqs=1024"
# "decode <=1024: 109 x 28.4 wall, dev 27.6 (fwd 27.4) idle 0.04, host ..."
BUCKET = re.compile(r"decode (<=\d+|>\d+): (\d+) x ([\d.]+) wall, dev ([\d.]+) \(fwd [\d.]+\) idle ([\d.]+)")


def buckets(text: str) -> list[tuple[str, int, float, float]]:
    """[(rows bucket, steps, device s, idle s)] of the decode steps."""
    return [(m[1], int(m[2]), int(m[2]) * float(m[4]) / 1e3, int(m[2]) * float(m[5]) / 1e3)
            for m in BUCKET.finditer(text)]


def main() -> None:
    res = json.loads(RESULTS.read_text())
    runs = {"GC heap unfrozen": buckets(res[ROW + " gc unfrozen"]["value"]),
            "frozen (Engine.freeze_gc)": buckets(res[ROW]["value"])}
    totals = {name: res["sharegpt 1000 reqs async max_num_seqs=1024" + suffix]["value"]
              for name, suffix in zip(runs, (" gc unfrozen", ""))}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [b[0] for b in next(iter(runs.values()))]
    width = 0.38
    for i, (name, rows) in enumerate(runs.items()):
        xs = [k + (i - 0.5) * width for k in range(len(rows))]
        dev = [r[2] for r in rows]
        idle = [r[3] for r in rows]
        ax.bar(xs, dev, width, label=f"{name}: GPU working ({totals[name]})", color=("C0", "C2")[i])
        ax.bar(xs, idle, width, bottom=dev, label=f"{name}: GPU waiting for the host", color=("C3", "C1")[i])
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("rows in the decode step")
    ax.set_ylabel("seconds of the run")
    ax.set_title("Decode steps by batch size: GPU time and idle")
    ax.legend(fontsize=8)

    with CLOCKS.open() as f:
        rows = [r for r in csv.reader(f)][1:]
    clk = [float(r[1].split()[0]) for r in rows if len(r) > 4 and "MHz" in r[1]]
    power = [float(r[3].split()[0]) for r in rows if len(r) > 4 and "W" in r[3]]
    t = [i / 4 for i in range(len(clk))]          # nvidia-smi -lms 250
    clock_line, = ax2.plot(t, clk, color="C0", label="SM clock (MHz)")
    ax2.set_xlabel("seconds: two engine_perf runs (each: load, then one ShareGPT run)")
    ax2.set_ylabel("MHz")
    ax3 = ax2.twinx()
    power_line, = ax3.plot(t[:len(power)], power, color="C3", alpha=0.6, label="power (W)")
    ax3.set_ylabel("W")
    ax2.set_title("H200 under the run: the 700 W cap lowers the clock")
    ax2.legend(handles=[clock_line, power_line], loc="lower left", fontsize=8)
    fig.tight_layout()
    out = HERE / "plots" / "h200_sharegpt_steps.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
