"""N-gram speculative decoding against plain decoding: greedy decode tok/s at several batch sizes,
with the acceptance actually reached, in two regimes (random weights make honest drafts rare):

    repeating   prompts that end in the model's own greedy output, which for random weights falls
                into cycles: drafts from the context are often right (the upper-bound regime)
    random      random-id prompts, prompt_lookup_min 1: drafts are proposed (a drawn id occurred
                before) and almost never right (the overhead regime)

    python bench/spec_decode_bench.py --model-dir /tmp/kvmesh-llama-1b          # H200
    python bench/spec_decode_bench.py --smoke                                    # CPU, tiny model

Each line: regime, batch, plain tok/s, speculative tok/s, their ratio, acceptance rate, mean
accepted length. Speculation runs with async scheduling off; the plain engine runs both ways
(--plain-async, default on: the served configuration it has to beat).
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.config import EngineConfig  # noqa: E402
from gpu_worker.engine import Engine  # noqa: E402
from services.protocol.sampling import SamplingParams  # noqa: E402

MAX_STEPS = 100_000


def engine(args, spec: str | None, async_scheduling: bool) -> Engine:
    common = dict(model=args.model_dir, max_num_seqs=max(args.batches), speculative_config=spec,
                  async_scheduling=async_scheduling and spec is None)
    if args.smoke:
        return Engine(EngineConfig(**common, device="cpu", dtype="float32", num_gpu_blocks=2048))
    return Engine(EngineConfig(**common, dtype="bfloat16", gpu_memory_utilization=0.85))


def run(eng: Engine, prompts: list[list[int]], out_len: int) -> tuple[float, list[list[int]]]:
    """Greedy decode of every prompt at once: (output tok/s, outputs)."""
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    t = time.perf_counter()
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            break
        for d in eng.step():
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)
    dt = time.perf_counter() - t
    return sum(map(len, outs.values())) / dt, [outs[f"r{i}"] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--plain-async", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny random model, short outputs")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        args.batches, args.out_len = [1, 4], 32
        if not args.model_dir:
            args.model_dir = str(Path(tempfile.mkdtemp()) / "tiny")
            subprocess.run([sys.executable, "-m", "services.cli", "make-model", "--arch", "llama", "--size", "tiny",
                            args.model_dir], check=True, capture_output=True)
    rng = random.Random(0)
    plain = engine(args, None, args.plain_async)
    vocab = plain.vocab_size
    seeds = [[rng.randrange(300, vocab) for _ in range(64)] for _ in range(max(args.batches))]
    _, cont = run(plain, seeds, args.out_len)              # the model's own greedy continuations
    regimes = {"repeating": [s + c for s, c in zip(seeds, cont)],
               "random": [[rng.randrange(300, vocab) for _ in range(128)] for _ in seeds]}
    specs = {"repeating": dict(prompt_lookup_min=2, prompt_lookup_max=5),
             "random": dict(prompt_lookup_min=1, prompt_lookup_max=3)}
    for regime, prompts in regimes.items():
        for batch in args.batches:
            spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                               "disable_by_batch_size": max(args.batches), **specs[regime]})
            base, want = run(plain, prompts[:batch], args.out_len)
            eng = engine(args, spec, False)
            fast, got = run(eng, prompts[:batch], args.out_len)
            st = eng.stats().extra["spec_decode"]
            eng.close()
            print(json.dumps({"regime": regime, "batch": batch, "plain_tok_s": round(base, 1),
                              "spec_tok_s": round(fast, 1), "speedup": round(fast / base, 3),
                              "acceptance_rate": round(st["acceptance_rate"], 3),
                              "mean_accepted_length": round(st["mean_accepted_length"], 3),
                              "same_tokens": got == want}), flush=True)
    plain.close()


if __name__ == "__main__":
    main()
