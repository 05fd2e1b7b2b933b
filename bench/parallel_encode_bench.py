#!/usr/bin/env python3
"""Tokenizing one fresh prompt, whole and cut into pieces on several cores (services/text/
parallel_encode.py), with the tokenizer of `kvmesh make-model --arch llama --size 8b`.

The prompts are what `kvmesh bench serve --dataset-name random` sends: random vocabulary ids
decoded to text, whose words the BPE cache never holds. Every prompt is encoded once (a second
encode of the same text would find its words cached), so each variant gets its own prompts;
ids are checked against the whole-text encode of the same prompt afterwards.

    PYTHONPATH=. python3 bench/parallel_encode_bench.py                # ~20 s
    PYTHONPATH=. python3 bench/parallel_encode_bench.py --prompts 5 --lengths 64   # smoke
Writes $OUT/parallel_encode_bench.json (OUT defaults to ./out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from gpu_worker.make_model import tokenizer_files  # noqa: E402
from services.bench.tokens import TokenCounter  # noqa: E402
from services.text.parallel_encode import ParallelEncoder, cut_safe  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,2048", help="prompt lengths in tokens")
    ap.add_argument("--pieces", default="1,2,4,8", help="piece counts to time (1: the whole text)")
    ap.add_argument("--prompts", type=int, default=40, help="fresh prompts per variant and length")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tok_json, _ = tokenizer_files("llama", 128256)
        (Path(d) / "tokenizer.json").write_text(json.dumps(tok_json))
        tok = Tokenizer.from_file(str(Path(d) / "tokenizer.json"))
        counter = TokenCounter(d)
    assert cut_safe(tok) is None, cut_safe(tok)
    rng = np.random.default_rng(0)
    cores = len(os.sched_getaffinity(0))
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        for pieces in [int(x) for x in args.pieces.split(",")]:
            enc = ParallelEncoder(tok, max_pieces=pieces)
            texts = [counter.random_text(n, rng) for _ in range(args.prompts)]
            times, got = [], []
            for text in texts:
                t = time.perf_counter()
                got.append(enc.encode(text, True))
                times.append(time.perf_counter() - t)
            for text, ids in zip(texts, got):
                assert ids == tok.encode(text).ids, "pieces changed the ids"
            used = enc.pieces_for(texts[0])
            rows.append({"tokens": n, "max_pieces": pieces, "pieces": max(1, used),
                         "chars": int(statistics.mean(map(len, texts))),
                         "median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * sorted(times)[int(0.9 * len(times))]})
            print(f"{n} tokens, {pieces} piece(s) max ({max(1, used)} used): median {rows[-1]['median_ms']:.2f} ms", flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "parallel_encode_bench.json").write_text(json.dumps({"cores": cores, "rows": rows}, indent=1))
    print(f"\n{cores} cores | tokens | pieces | chars | median ms | p90 ms")
    for r in rows:
        print(f"        | {r['tokens']:6d} | {r['pieces']:6d} | {r['chars']:5d} | {r['median_ms']:9.2f} | {r['p90_ms']:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
