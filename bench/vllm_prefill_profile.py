"""Where vLLM's prefill step spends its GPU time, kernel family by family, on the H200 (issue #4):
the counterpart of engine_perf.py's `profile` part, so the two engines' prefill steps can be
compared kernel by kernel on one machine.

vLLM 0.26.0 (../shared/peer-vllm/, installed into its own site folder) on random ("dummy") weights
of the model directory's shape, in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs
in this process, so torch.profiler's CUPTI records see its kernels), the LLM class's defaults
otherwise (16,384-token steps). Per prompt length of vLLM's peer workload (512 x 32, 2048 x 8,
8192 x 2 = 16,384 tokens, one step each, max_tokens 1): the wall tok/s of 3 runs after a warm-up,
then one profiled run, its kernels summed by family and the heaviest kernels by name.

    PYTHONPATH=/tmp/vsite:bench VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
        python3 bench/vllm_prefill_profile.py --model-dir /tmp/kvmesh-llama-8b

Writes $OUT/vllm_prefill_profile.json; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
from pathlib import Path

from kernel_profile import family, kernel_sums   # bench/ (on PYTHONPATH): torch and re only

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")     # the engine core in this process
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

# vLLM's kernel names (FA3's templates name cutlass, so attention is matched first); inductor's
# fused Triton kernels are named after the ops they fuse.
VLLM_FAMILIES = [
    ("attention", re.compile(r"flash|FlashAttn|fmha|attention", re.I)),
    ("gemm", re.compile(r"nvjet|xmma|cutlass|gemm|gemv|sm90_|cublas", re.I)),
    ("rmsnorm (+ residual)", re.compile(r"rms|rsqrt", re.I)),
    ("silu x mul", re.compile(r"silu|act_and_mul", re.I)),
    ("rope", re.compile(r"rotary|rope", re.I)),
    ("kv write", re.compile(r"reshape_and_cache|cache", re.I)),
    ("copy / fill", re.compile(r"memcpy|memset|copy|fill|cat", re.I)),
]
WORKLOAD = ((512, 32), (2048, 8), (8192, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/kvmesh-llama-8b"))
    ap.add_argument("--runs", type=int, default=3, help="timed runs per length")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.time()
    llm = LLM(model=str(args.model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=16384, gpu_memory_utilization=0.90, seed=0)
    res: dict = {"vllm": __import__("vllm").__version__, "startup_s": round(time.time() - t, 1), "lengths": {}}
    print(f"vLLM {res['vllm']} ready in {res['startup_s']} s", flush=True)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)

    def prompts(length: int, n: int) -> list:
        return [TokensPrompt(prompt_token_ids=[rng.randrange(128000) for _ in range(length)]) for _ in range(n)]

    llm.generate(prompts(64, 1), params, use_tqdm=False)
    for length, n in WORKLOAD:
        llm.generate(prompts(length, n), params, use_tqdm=False)              # warm-up of this shape
        walls = []
        for _ in range(args.runs):
            ps = prompts(length, n)
            torch.cuda.synchronize()
            t = time.time()
            llm.generate(ps, params, use_tqdm=False)
            walls.append(time.time() - t)
        ps = prompts(length, n)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(ps, params, use_tqdm=False)
            torch.cuda.synchronize()
        fams = kernel_sums(prof, lambda name: family(name, VLLM_FAMILIES))
        kernels = kernel_sums(prof, lambda name: name[:90])
        total = sum(v[0] for v in fams.values())
        entry = {"tokens": length * n, "wall_s": walls, "tok_s_best": length * n / min(walls),
                 "tok_s_median": length * n / sorted(walls)[len(walls) // 2], "gpu_ms": total,
                 "families": {k: {"ms": round(v[0], 3), "kernels": v[1]} for k, v in
                              sorted(fams.items(), key=lambda kv: -kv[1][0])},
                 "top": [[k, round(v[0], 3), v[1]] for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:14]]}
        res["lengths"][str(length)] = entry
        print(f"{n} x {length}: best {entry['tok_s_best']:.0f} tok/s (runs {[round(w * 1e3, 1) for w in walls]} ms), "
              f"GPU {total:.1f} ms: " + "; ".join(f"{k} {v['ms']:.2f} ms x{v['kernels']}"
                                                  for k, v in entry["families"].items()), flush=True)
        for name, ms, k in entry["top"]:
            print(f"    {ms:8.2f} ms x{k:<4} {name}", flush=True)
        (out_dir / "vllm_prefill_profile.json").write_text(json.dumps(res, indent=1))

    print("\nvLLM prefill, one 16,384-token step per length")
    print(f"{'prompt':>8} {'best tok/s':>11} {'GPU ms':>8}  families")
    for length, e in res["lengths"].items():
        print(f"{length:>8} {e['tok_s_best']:>11.0f} {e['gpu_ms']:>8.1f}  " +
              "; ".join(f"{k} {v['ms']:.1f}" for k, v in e["families"].items()))


if __name__ == "__main__":
    main()
