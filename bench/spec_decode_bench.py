"""Speculative decoding against plain decoding: greedy decode tok/s over a ladder of batch sizes,
with the acceptance actually reached, for each method in the regimes that bound it (random
weights make honest drafts rare):

    ngram/repeating          prompts ending in the model's own greedy output, which for random
                             weights falls into cycles: drafts are often right (upper bound)
    ngram/random             random-id prompts, prompt_lookup_min 1: drafts proposed, almost never
                             right (overhead)
    draft_model/self-draft   the target as its own draft: every draft right (upper bound)
    draft_model/independent-draft   --draft-dir, e.g. a 1-layer model of the same family and
                             tokenizer: drafts almost never right (overhead)
    mtp/random-layer         the model's own MTP layer (--model-dir made with --mtp-layers 1),
                             random: drafts almost never right (overhead)
    mtp/oracle               --mtp-oracle-dir: a copy of --model-dir written by
                             gpu_worker/mtp_oracle.py (a bigram target at full cost, the MTP layer
                             its bigram): every draft right (upper bound), against plain decoding
                             of that copy

    python bench/spec_decode_bench.py --model-dir /tmp/kvmesh-llama-1b --draft-dir /tmp/llama-1layer   # H200
    python bench/spec_decode_bench.py --methods mtp --model-dir /tmp/llama-8b-mtp \
        --mtp-oracle-dir /tmp/llama-8b-mtp-oracle                 # H200; make-model --mtp-layers 1
    python bench/spec_decode_bench.py --smoke                     # CPU, tiny target (with an MTP layer) and draft

Each line: method, regime, batch, plain tok/s, speculative tok/s, their ratio, acceptance rate,
mean accepted length, tokens equal to plain decoding. After the ladder, each case is swept
between the last batch that paid and the first that did not (bisection, to within 1/8 of the
batch; those lines carry "refined": true). The last line gives, per method and regime, the
largest batch up to which speculation paid at every batch measured (a lone win past a loss is
noise), and the recommended `disable_by_batch_size` (speculation off above it): the n-gram
upper-bound regime's crossover, the default method at its best; above it no n-gram draft can
pay. Speculation here never switches itself off. Both engines run with async scheduling as served
(--plain-async, --spec-async, default on; the speculative engine's steps that verify drafts run
synchronously, its steps without drafts one step ahead). Prefix caching is off in both engines,
so every run prefills its prompts cold. Verification steps without a prefill chunk run as decode
rows replaying the decode CUDA graphs (--verify-decode-rows, default on; off: every verification
on the extend path, eager); --spec-eager captures no graphs for the speculative engine (with
--no-verify-decode-rows, how mtp ran before its graphs kept the pre-norm states). Each line also
counts the verification steps that ran as decode rows and on the extend path, and the back-offs
of sequences whose drafts kept failing with the sequence-steps they took drafts off for
(speculative_config backoff_max_steps, default on; --no-backoff: 0, every eligible step drafts).
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
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.config import EngineConfig  # noqa: E402
from gpu_worker.engine import Engine  # noqa: E402
from services.protocol.sampling import SamplingParams  # noqa: E402

MAX_STEPS = 100_000


def engine(args, spec: str | None, async_scheduling: bool, model_dir: str = "") -> Engine:
    # no prefix caching: the plain engine ran the seeds and their continuations (the repeating
    # prompts) first, and cached prompts would make every later run of either engine cheaper
    common = dict(model=model_dir or args.model_dir, max_num_seqs=max(args.batches), speculative_config=spec,
                  async_scheduling=async_scheduling, enable_prefix_caching=False,
                  enforce_eager=spec is not None and args.spec_eager)
    if args.smoke:
        eng = Engine(EngineConfig(**common, device="cpu", dtype="float32", num_gpu_blocks=2048))
    else:   # two engines share the device at a time (the plain baseline and the speculative one)
        eng = Engine(EngineConfig(**common, dtype="bfloat16", gpu_memory_utilization=0.42))
    eng.verify_as_decode_rows = args.verify_decode_rows
    return eng


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


def cases(args, prompts_by_regime: dict) -> list[tuple[str, str, list[list[int]], str, str]]:
    """(method, regime, prompts, speculative_config, model directory) for every measured
    configuration; mtp/oracle, on a model of its own, comes last (main closes the plain engine
    of --model-dir before it)."""
    out = []
    off = {"num_speculative_tokens": args.k, "disable_by_batch_size": max(args.batches),   # never auto-off
           **({} if args.backoff else {"backoff_max_steps": 0})}
    if "ngram" in args.methods:
        lookups = {"repeating": dict(prompt_lookup_min=2, prompt_lookup_max=5),
                   "random": dict(prompt_lookup_min=1, prompt_lookup_max=3)}
        for regime, lookup in lookups.items():
            out.append(("ngram", regime, prompts_by_regime[regime],
                        json.dumps({"method": "ngram", **off, **lookup}), args.model_dir))
    if "draft_model" in args.methods:
        drafts = {"self-draft": args.model_dir}            # the target as its own draft: the upper bound
        if args.draft_dir:
            drafts["independent-draft"] = args.draft_dir   # random weights: acceptance ~0, the overhead
        for regime, draft in drafts.items():
            out.append(("draft_model", regime, prompts_by_regime["random"],
                        json.dumps({"method": "draft_model", "model": draft, **off}), args.model_dir))
    if "mtp" in args.methods:
        mtp = json.dumps({"method": "mtp", **off})
        out.append(("mtp", "random-layer", prompts_by_regime["random"], mtp, args.model_dir))
        if args.mtp_oracle_dir:
            from gpu_worker.mtp_oracle import write_mtp_oracle
            if not (Path(args.mtp_oracle_dir) / "config.json").exists():
                write_mtp_oracle(args.model_dir, args.mtp_oracle_dir)
            out.append(("mtp", "oracle", prompts_by_regime["random"], mtp, args.mtp_oracle_dir))
    return out


UPPER_BOUND_CASES = ("ngram/repeating", "draft_model/self-draft")   # the recommendation's source, in order


def last_paying(speedups: dict[int, float]) -> int | None:
    """The largest batch b such that speculation paid (speedup > 1) at every measured batch up to
    b; None when it lost at the smallest. disable_by_batch_size switches speculation off above a
    batch, so this is the value to set."""
    best = None
    for batch in sorted(speedups):
        if speedups[batch] <= 1.0:
            break
        best = batch
    return best


def refine(speedups: dict[int, float], measure: Callable[[int], float]) -> None:
    """Bisect between the last paying batch and the first losing one, measure(batch) -> speedup
    at each batch tried (added to speedups), until they are within 1/8 of the batch."""
    while (lo := last_paying(speedups)) is not None:
        above = [b for b in sorted(speedups) if b > lo]
        if not above or above[0] - lo <= max(1, lo // 8):
            return
        mid = (lo + above[0]) // 2
        speedups[mid] = measure(mid)


def crossover(rows: list[dict]) -> dict:
    """Per method and regime, last_paying over its rows; and the recommended default."""
    speedups: dict[str, dict[int, float]] = {}
    for r in rows:
        speedups.setdefault(f"{r['method']}/{r['regime']}", {})[r["batch"]] = r["speedup"]
    per_case = {case: last_paying(s) for case, s in speedups.items()}
    source = next((c for c in UPPER_BOUND_CASES if c in per_case), None)
    return {"largest_batch_that_pays": per_case, "recommended_from": source,
            # None: speculation paid at no batch, even at its best: recommend the smallest one
            "recommended_disable_by_batch_size": None if source is None else per_case[source] or 1}


def measure(plain: Engine, eng: Engine, case: tuple[str, str], prompts: list[list[int]], batch: int,
            out_len: int) -> dict:
    """One batch: plain decoding, then speculative decoding of the same prompts."""
    base, want = run(plain, prompts[:batch], out_len)
    before = dict(eng.stats().extra["spec_decode"])
    fast, got = run(eng, prompts[:batch], out_len)
    st = eng.stats().extra["spec_decode"]
    proposed, accepted = st["proposed"] - before["proposed"], st["accepted"] - before["accepted"]
    steps = st["verify_steps"] - before["verify_steps"]
    counts = {key: st[key] - before[key] for key in ("decode_row_steps", "extend_steps", "backoffs",
                                                     "backoff_steps")}
    return {"method": case[0], "regime": case[1], "batch": batch, "plain_tok_s": round(base, 1),
            "spec_tok_s": round(fast, 1), "speedup": round(fast / base, 3),
            "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
            "mean_accepted_length": round(1 + accepted / steps, 3) if steps else 0.0,
            **counts, "same_tokens": got == want}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--draft-dir", default="", help="draft_model: an independent draft (same tokenizer), measured "
                                                    "beside the target as its own draft")
    ap.add_argument("--methods", default="ngram,draft_model", help="comma-separated: ngram, draft_model, mtp")
    ap.add_argument("--mtp-oracle-dir", default="", help="mtp: where the oracle copy of --model-dir is (written "
                                                         "there when missing): the upper-bound regime")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--plain-async", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--spec-async", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--verify-decode-rows", action=argparse.BooleanOptionalAction, default=True,
                    help="verification steps without a prefill chunk as decode rows (decode CUDA graphs); "
                         "off: the extend path")
    ap.add_argument("--backoff", action=argparse.BooleanOptionalAction, default=True,
                    help="sequences whose drafts keep failing back off (the engine's default); off: "
                         "backoff_max_steps 0")
    ap.add_argument("--spec-eager", action="store_true", help="the speculative engine captures no CUDA graphs")
    ap.add_argument("--refine", action=argparse.BooleanOptionalAction, default=True,
                    help="bisect between the last batch that paid and the first that did not")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random target and draft, short outputs, "
                                                         "no bisection")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.methods = args.methods.split(",")
    if args.smoke:
        args.batches, args.out_len = [1, 4], 16
        args.refine = False          # CPU numbers say nothing about the crossover; tests check refine()
        tmp = Path(tempfile.mkdtemp())
        if not args.model_dir:
            args.model_dir = str(tmp / "tiny")
            subprocess.run([sys.executable, "-m", "services.cli", "make-model", "--arch", "llama", "--size", "tiny",
                            "--mtp-layers", "1", args.model_dir], check=True, capture_output=True)
        if "mtp" in args.methods and not args.mtp_oracle_dir:
            args.mtp_oracle_dir = str(tmp / "oracle")
        if not args.draft_dir:
            from gpu_worker.make_model import make_model
            args.draft_dir = str(make_model(tmp / "draft", arch="llama", size="tiny", seed=1, layers=1, progress=False))
    rng = random.Random(0)
    plain = engine(args, None, args.plain_async)
    vocab = plain.vocab_size
    seeds = [[rng.randrange(300, vocab) for _ in range(64)] for _ in range(max(args.batches))]
    _, cont = run(plain, seeds, args.out_len)              # the model's own greedy continuations
    regimes = {"repeating": [s + c for s, c in zip(seeds, cont)],
               "random": [[rng.randrange(300, vocab) for _ in range(128)] for _ in seeds]}
    rows = []

    def measured(row: dict) -> float:
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row["speedup"]

    for method, regime, prompts, spec, model_dir in cases(args, regimes):
        if model_dir != args.model_dir and plain is not None:   # another model (mtp/oracle, the last
            plain.close()                                        # case): its own plain baseline
            plain = None
        base_eng = plain or engine(args, None, args.plain_async, model_dir)
        eng = engine(args, spec, args.spec_async, model_dir)
        speedups = {batch: measured(measure(base_eng, eng, (method, regime), prompts, batch, args.out_len))
                    for batch in args.batches}
        if args.refine:
            refine(speedups, lambda batch: measured({
                **measure(base_eng, eng, (method, regime), prompts, batch, args.out_len), "refined": True}))
        eng.close()
        if base_eng is not plain:
            base_eng.close()
    if plain is not None:
        plain.close()
    print(json.dumps(crossover(rows)), flush=True)


if __name__ == "__main__":
    main()
