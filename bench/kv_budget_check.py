#!/usr/bin/env python3
"""How many KV blocks ModelRunner.profile_num_blocks gives on this GPU, for the forward alone and
with the largest draw of each --max-num-seqs (the room a step's logits and sampling take out of
the KV budget), with the profile's torch peak. One runner, weights loaded once.

    python3 bench/kv_budget_check.py --model-dir /tmp/kvmesh-llama-8b      # the H200, ~30 s
    python3 bench/kv_budget_check.py --model-dir /tmp/kvmesh-llama-8b --max-num-seqs 256,1024
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gpu_worker.model_config import ModelConfig  # noqa: E402
from gpu_worker.model_runner import ModelRunner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-num-seqs", default="256,1024", help="comma list of draw sizes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (on the CPU the KV cache is not profiled)")
    try:
        sizes = [int(n) for n in args.max_num_seqs.split(",") if n]
    except ValueError:
        ap.error(f"--max-num-seqs takes a comma list of integers, got {args.max_num_seqs!r}")
    t = time.time()
    runner = ModelRunner(ModelConfig.from_dir(args.model_dir), args.model_dir, device="cuda",
                         dtype=torch.bfloat16, attention_backend="triton")
    print(f"loaded in {time.time() - t:.1f} s; {runner.block_size_bytes(16) / 2**20:.2f} MiB per 16-token block",
          flush=True)
    per_block = runner.block_size_bytes(16)
    base = None
    for n in [0] + sizes:
        blocks = runner.profile_num_blocks(16, args.gpu_memory_utilization, args.max_num_batched_tokens, n)
        peak = torch.cuda.max_memory_allocated() / 2**30
        base = blocks if base is None else base
        print(f"max_num_seqs {n:5d}: {blocks:7d} blocks ({blocks * per_block / 2**30:6.2f} GiB), profile peak "
              f"{peak:6.2f} GiB, {base - blocks:5d} blocks ({(base - blocks) * per_block / 2**30:.2f} GiB) "
              "for the draw", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
