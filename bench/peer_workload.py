"""The ShareGPT-like request lengths of vLLM's peer run (`../shared/peer-vllm/run_peer.py`),
reproduced exactly, so that kvmesh's offline run serves the very same 1,000 requests.

run_peer.py draws every prompt token and then the lengths from one `random.Random(0)`; replaying
its calls in the same order gives the same lengths (it measured means of 211.4 in / 182.1 out).
"""
from __future__ import annotations

import random

V = 128000     # run_peer.py's token-id range
PREFILL_TOKENS = 16384     # its prefill runs: B = PREFILL_TOKENS // L prompts of L tokens, one step
PREFILL_LENS = (512, 2048, 8192)


def vllm_peer_sharegpt_lengths(n: int = 1000) -> list[tuple[int, int]]:
    """[(prompt tokens, output tokens)] of run_peer.py's ShareGPT-like part, in its order."""
    rng = random.Random(0)
    draws = 64 + 128 + 8192                       # warm-up prompt, batch-1 prompts at 128 / 8k
    draws += sum(max(1, PREFILL_TOKENS // L) * L for L in PREFILL_LENS)   # prefill prompts
    draws += (64 + 256) * 128                     # batched-decode prompts
    for _ in range(draws):
        rng.randrange(V)
    ins = [max(4, min(1024, int(rng.lognormvariate(4.9, 1.0)))) for _ in range(n)]
    outs = [max(4, min(1024, int(rng.lognormvariate(4.8, 0.9)))) for _ in range(n)]
    return list(zip(ins, outs))
