"""The engine at the smallest and the largest block size it takes (services/engine_args.py's
BLOCK_SIZES) decodes the same greedy tokens as at the default, 16: every kernel finds a token's
row through the block table, whatever the block's size."""
from __future__ import annotations

import random

import pytest

from gpu_worker import LLM, SamplingParams
from services.engine_args import BLOCK_SIZES
from tests.gpu_worker.devices import CPU_AND_CUDA

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
KV_TOKENS = 2048            # the same cache in tokens at every block size


def _prompts() -> list[dict]:
    rng = random.Random(0)
    long = [rng.randrange(3, 250) for _ in range(140)]     # past one block of 128: a block boundary at every size
    return [{"prompt_token_ids": long},
            {"prompt_token_ids": long[:131] + [7, 8, 9]},  # shares the long prompt's first block(s): a cache hit
            {"prompt_token_ids": [rng.randrange(3, 250) for _ in range(5)]}]


def _greedy(model: str, device: str, block_size: int) -> list[list[int]]:
    llm = LLM(model=model, device=device, dtype="float32", block_size=block_size, max_num_seqs=4,
              num_gpu_blocks=KV_TOKENS // block_size)
    first = llm.generate(_prompts()[:1], GREEDY, use_tqdm=False)     # the long prompt alone, then all at once
    rest = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    llm.llm_engine.block_manager.check_integrity()
    assert rest[1].num_cached_tokens == 128        # its first 131 tokens are the long prompt's: 128 in full blocks
    return [o.outputs[0].token_ids for o in first + rest]


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_smallest_and_largest_block_sizes_decode_as_the_default(tiny_models, device):
    model = tiny_models["llama"]
    want = _greedy(model, device, 16)
    assert want[0] == want[1]                                # alone and batched alike
    for block_size in (min(BLOCK_SIZES), max(BLOCK_SIZES)):
        assert _greedy(model, device, block_size) == want, f"block_size={block_size}"
