"""kvmesh's offline `LLM(...)` and vLLM's, timed by one harness on the same workload.

    python3 bench/offline_bench.py --engine kvmesh --model-dir /tmp/kvmesh-llama-8b
    python3 bench/offline_bench.py --engine vllm --model-dir /tmp/kvmesh-llama-8b       # vLLM installed
    python3 bench/offline_bench.py --engine kvmesh --engine-arg max_num_batched_tokens=8192 --engine-arg max_num_seqs=512

Both engines are measured the same way: one `generate` call per line with the prefills included,
token-id prompts, forced output lengths (`ignore_eos`), greedy, the tokenizer skipped, and each
engine's own `LLM(...)` defaults unless `--engine-arg` says otherwise. vLLM loads the same model
directory's config with random (`dummy`) weights. The lines (the workload of vLLM's peer run,
drawn from one `random.Random(0)` in the same order, so that the 1,000 ShareGPT-like lengths are
exactly `vllm_peer_sharegpt_lengths()` below, which gpu_bench.py and engine_perf.py reuse):

  bs1_decode_tok_s_ctx{128,8192}  batch-1 decode: 256 tokens after a 1-token run of the same
                                  prompt, by subtraction of the two calls' times
  prefill_tok_s_{512,2048,8192}   16,384 // L prompts of L tokens, one token out each
  decode_bs{64,256}_out_tok_s     B prompts of 128 tokens, 128 out each: out tokens over the call
  sharegpt_like_total_tok_s       1,000 requests of lognormal lengths (mean 211 in / 182 out)

Writes $OUT/offline_bench_<engine>.json (the keys above, as vllm_peer.json has them).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

V = 128000     # the token-id range of the prompts (or the model's vocabulary, when smaller)
PREFILL_TOKENS = 16384     # prefill lines: B = PREFILL_TOKENS // L prompts of L tokens, one step
PREFILL_LENS = (512, 2048, 8192)
DECODE_CONTEXTS = (128, 8192)
DECODE_BATCHES = (64, 256)
NUM_SHAREGPT = 1000


def sharegpt_lengths(rng: random.Random, n: int) -> list[tuple[int, int]]:
    ins = [max(4, min(1024, int(rng.lognormvariate(4.9, 1.0)))) for _ in range(n)]
    outs = [max(4, min(1024, int(rng.lognormvariate(4.8, 0.9)))) for _ in range(n)]
    return list(zip(ins, outs))


def vllm_peer_sharegpt_lengths(n: int = NUM_SHAREGPT) -> list[tuple[int, int]]:
    """[(prompt tokens, output tokens)] of the ShareGPT-like line, in its order, without drawing
    the prompts' tokens: the draws before it are skipped in the order the harness makes them."""
    rng = random.Random(0)
    draws = 64 + sum(DECODE_CONTEXTS)                                     # warm-up, batch-1 prompts
    draws += sum(max(1, PREFILL_TOKENS // L) * L for L in PREFILL_LENS)   # prefill prompts
    draws += sum(DECODE_BATCHES) * 128                                    # batched-decode prompts
    for _ in range(draws):
        rng.randrange(V)
    return sharegpt_lengths(rng, n)


def load_llm(engine: str, model_dir: str, engine_args: dict):
    """(llm, make_params, token_prompt) for either engine."""
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                  **{"max_model_len": 16384, "gpu_memory_utilization": 0.90, **engine_args})

        def params(n):
            return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        return llm, params, lambda ids: TokensPrompt(prompt_token_ids=ids)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gpu_worker import LLM, SamplingParams
    llm = LLM(model=model_dir, skip_tokenizer_init=True, **{"max_model_len": 16384, **engine_args})

    def params(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return llm, params, lambda ids: {"prompt_token_ids": ids}


def parse_engine_args(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg wants KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)             # numbers, true / false
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("kvmesh", "vllm"), required=True)
    ap.add_argument("--model-dir", default="/tmp/kvmesh-llama-8b", help="made by kvmesh make-model")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an LLM(...) argument for the engine, e.g. max_num_batched_tokens=8192 (repeatable)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiplies every length and count (0.02 with a tiny model checks the harness on a CPU)")
    args = ap.parse_args(argv)
    engine_args = parse_engine_args(args.engine_arg)

    def scaled(x: int) -> int:
        return max(1, int(x * args.scale))
    res: dict = {"engine": args.engine, "engine_args": engine_args, "scale": args.scale}
    t = time.time()
    llm, params, prompt = load_llm(args.engine, args.model_dir, engine_args)
    res["startup_s"] = time.time() - t
    if args.engine == "vllm":
        res["vllm_version"] = __import__("vllm").__version__
    rng = random.Random(0)
    vocab = min(V, json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"])

    def draw(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def run(prompts, sampling) -> tuple[float, int]:
        t = time.time()
        outs = llm.generate([prompt(p) for p in prompts], sampling, use_tqdm=False)
        return time.time() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    run([draw(64)], params(16))                                     # warm-up
    for ctx in DECODE_CONTEXTS:
        p = [draw(scaled(ctx))]
        t_prefill, _ = run(p, params(1))
        t_all, _ = run(p, params(scaled(256) + 1))
        res[f"bs1_decode_tok_s_ctx{ctx}"] = scaled(256) / max(t_all - t_prefill, 1e-9)
    for L in PREFILL_LENS:
        n = max(1, PREFILL_TOKENS // L)
        dt, _ = run([draw(scaled(L)) for _ in range(n)], params(1))
        res[f"prefill_tok_s_{L}"] = n * scaled(L) / dt
    for B in DECODE_BATCHES:
        dt, n_out = run([draw(scaled(128)) for _ in range(scaled(B))], params(scaled(128)))
        res[f"decode_bs{B}_out_tok_s"] = n_out / dt
    reqs = sharegpt_lengths(rng, scaled(NUM_SHAREGPT))
    reqs = [(scaled(i), scaled(o)) for i, o in reqs]
    prompts = [draw(i) for i, _ in reqs]
    t = time.time()
    llm.generate([prompt(p) for p in prompts], [params(o) for _, o in reqs], use_tqdm=False)
    dt = time.time() - t
    n_in, n_out = sum(i for i, _ in reqs), sum(o for _, o in reqs)
    res["sharegpt_like_total_tok_s"] = (n_in + n_out) / dt
    res["sharegpt_like_out_tok_s"] = n_out / dt
    res["sharegpt_like_mean_in_out"] = [n_in / len(reqs), n_out / len(reqs)]
    out = Path(os.environ.get("OUT", "/tmp")) / f"offline_bench_{args.engine}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    for key, value in res.items():
        print(key, value)
    if hasattr(llm, "close"):
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
