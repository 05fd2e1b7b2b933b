"""GPU check of the FP8 KV cache option: engine with kv_cache_dtype="fp8" against "auto" on the
same random model (greedy tokens, first-step logprob error, KV blocks, batch-1 decode speed).

    python3 bench/fp8_kv_check.py [--size 1b]
"""
from __future__ import annotations

import argparse
import random
import sys
import time

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.make_model import make_model
from services.protocol.sampling import SamplingParams


def run(model: str, kv: str) -> dict:
    eng = Engine(EngineConfig(model=model, dtype="bfloat16", kv_cache_dtype=kv, max_num_seqs=8,
                              gpu_memory_utilization=0.5, max_model_len=2048))
    rng = random.Random(0)
    prompts = [[rng.randrange(10, eng.vocab_size) for _ in range(n)] for n in (17, 200, 1000)]
    out: dict = {"blocks": eng.stats().num_free_blocks}
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0))
    toks: dict = {}
    while eng.has_unfinished_requests():
        for d in eng.step():
            toks.setdefault(d.request_id, []).extend(d.new_token_ids)
    out["tokens"] = toks
    eng.add_request("speed", prompts[0], SamplingParams(temperature=0, max_tokens=257, ignore_eos=True))
    eng.step()
    t = time.time()
    n = 0
    while eng.has_unfinished_requests():
        n += sum(len(d.new_token_ids) for d in eng.step())
    out["tok_s"] = n / (time.time() - t)
    eng.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1b")
    args = ap.parse_args()
    model = str(make_model(f"/tmp/kvmesh-llama-{args.size}", "llama", args.size, seed=0))
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()   # make_model's cached blocks would count as used by the KV profile
    ref, fp8 = run(model, "auto"), run(model, "fp8")
    for rid in sorted(ref["tokens"]):
        a, b = ref["tokens"][rid], fp8["tokens"][rid]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"prompt {rid}: greedy tokens identical for {same}/{len(a)} steps")
    print(f"KV blocks: auto {ref['blocks']}, fp8 {fp8['blocks']} ({fp8['blocks'] / ref['blocks']:.2f}x)")
    print(f"batch-1 decode tok/s: auto {ref['tok_s']:.1f}, fp8 {fp8['tok_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
