"""GPU check of the FP8 KV cache option: engine with kv_cache_dtype="fp8" against "auto" on the
same random model (greedy tokens, KV blocks, batch-1 decode speed at short and long context).

    python3 bench/fp8_kv_check.py [--size 8b] [--model-dir DIR] [--long-context 32768]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

from gpu_worker.config import EngineConfig, tuning_from_env
from gpu_worker.engine import Engine
from gpu_worker.make_model import make_model
from gpu_worker.tuning import FP8_UPCASTS, KernelTuning
from services.protocol.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/
from engine_perf import graph_gpu_ms  # noqa: E402  (the batch-1 graph's GPU time, NaN without one)


def decode_tok_s(eng: Engine, prompt: list[int], steps: int) -> float:
    """Batch-1 decode tokens/s after `prompt` (its prefill, chunked or not, untimed: the clock
    starts once the first token is out)."""
    eng.add_request("speed", prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    while not any(d.new_token_ids for d in eng.step()):
        pass
    t = time.time()
    n = 0
    while eng.has_unfinished_requests():
        n += sum(len(d.new_token_ids) for d in eng.step())
    return n / (time.time() - t)


def run(model: str, kv: str, long_ctx: int, tuning: KernelTuning) -> dict:
    eng = Engine(EngineConfig(model=model, dtype="bfloat16", kv_cache_dtype=kv, max_num_seqs=8,
                              gpu_memory_utilization=0.45, max_model_len=max(long_ctx, 1024) + 512, tuning=tuning))
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
    out["tok_s"] = decode_tok_s(eng, prompts[1][:128], 256)
    out["graph_ms"] = graph_gpu_ms(eng.runner, 1, short=eng.runner.short_decode_graphs is not None)
    out["tok_s_long"] = decode_tok_s(eng, [rng.randrange(10, eng.vocab_size) for _ in range(long_ctx)], 128)
    out["graph_ms_long"] = graph_gpu_ms(eng.runner, 1)
    eng.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="8b")
    ap.add_argument("--model-dir", default="", help="default /tmp/kvmesh-llama-SIZE (made once)")
    ap.add_argument("--long-context", type=int, default=32768)
    ap.add_argument("--fp8-upcast", default="", help="decode attention's fp8 read (gpu_worker.tuning."
                    "FP8_UPCASTS); default: DecodeAttentionTuning's fp8_upcast")
    args = ap.parse_args()
    tuning = tuning_from_env()                  # the KVMESH_* overrides, as an engine would take them
    if args.fp8_upcast:
        if args.fp8_upcast not in FP8_UPCASTS:
            ap.error(f"--fp8-upcast must be one of {', '.join(FP8_UPCASTS)}")
        tuning = replace(tuning, decode_attention=replace(tuning.decode_attention, fp8_upcast=args.fp8_upcast))
        print(f"fp8 decode attention reads with fp8_upcast={args.fp8_upcast}")
    model_dir = Path(args.model_dir or f"/tmp/kvmesh-llama-{args.size}")
    model = str(model_dir if (model_dir / "config.json").exists()
                else make_model(model_dir, "llama", args.size, seed=0))
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()   # make_model's cached blocks would count as used by the KV profile
    ref, fp8 = run(model, "auto", args.long_context, tuning), run(model, "fp8", args.long_context, tuning)
    for rid in sorted(ref["tokens"]):
        a, b = ref["tokens"][rid], fp8["tokens"][rid]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"prompt {rid}: greedy tokens identical for {same}/{len(a)} steps")
    print(f"KV blocks: auto {ref['blocks']}, fp8 {fp8['blocks']} ({fp8['blocks'] / ref['blocks']:.2f}x)")
    for key, gkey, what in (("tok_s", "graph_ms", "128"), ("tok_s_long", "graph_ms_long", str(args.long_context))):
        print(f"batch-1 decode tok/s at {what} context: auto {ref[key]:.1f}, fp8 {fp8[key]:.1f} "
              f"({fp8[key] / ref[key] - 1:+.1%}); graph replay GPU ms: auto {ref[gkey]:.3f}, fp8 {fp8[gkey]:.3f} "
              f"(time {fp8[gkey] / ref[gkey] - 1:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
