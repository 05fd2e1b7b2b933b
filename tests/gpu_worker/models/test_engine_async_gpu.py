"""The engine on a CUDA GPU as it serves (Triton kernels, decode and prefill CUDA graphs, chunked
prefill), one step ahead and not: the same tokens, and greedy tokens that Hugging Face's logits
pick. One step ahead, the inputs travel on side streams (the batch upload, the tokens' read-back)
and the sampled tokens feed the next step on the device; this holds those paths to the plain step
loop. The longest request ends alone, on the batch-1 graph whose layers and lm_head are GEMVs.
Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from test_model_parity import hf_logits

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (prompt length, max_tokens, params): lengths that chunk at 48 tokens a step, requests that end
# at different steps (the decode rows' order changes), and a seeded draw of two samples.
REQUESTS = [(5, 14, {}), (70, 9, {}), (33, 20, {}), (17, 3, {}),
            (40, 12, dict(temperature=0.8, top_p=0.9, seed=7, n=2))]


def generate(model_dir: str, async_scheduling: bool) -> tuple[dict[tuple[str, int], list[int]], dict[str, list[int]]]:
    """-> (tokens per (request, sample index), prompts)"""
    eng = Engine(EngineConfig(model=model_dir, device="cuda", dtype="float32", attention_backend="triton",
                              max_model_len=256, num_gpu_blocks=128, max_num_seqs=8, max_num_batched_tokens=48,
                              cuda_graph_max_bs=8, async_scheduling=async_scheduling))
    g = torch.Generator().manual_seed(3)
    prompts = {}
    for i, (length, max_tokens, extra) in enumerate(REQUESTS):
        prompts[f"r{i}"] = torch.randint(10, eng.vocab_size, (length,), generator=g).tolist()
        params = dict(temperature=0.0, ignore_eos=True, max_tokens=max_tokens) | extra
        eng.add_request(f"r{i}", prompts[f"r{i}"], SamplingParams(**params))
    out: dict[tuple[str, int], list[int]] = {}
    while eng.has_unfinished_requests():
        for d in eng.step():
            out.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
    assert eng.runner.decode_graphs is not None and eng.block_manager.num_used_blocks == 0   # nothing leaked
    eng.block_manager.check_integrity()
    eng.close()
    return out, prompts


def test_async_engine_matches_sync_and_hf(tiny_models):
    model_dir = tiny_models["llama"]
    sync, prompts = generate(model_dir, False)
    asyn, _ = generate(model_dir, True)
    assert asyn == sync
    for i, (_, max_tokens, extra) in enumerate(REQUESTS):
        assert all(len(sync[(f"r{i}", k)]) == max_tokens for k in range(extra.get("n", 1)))
    greedy = [i for i, (_, _, extra) in enumerate(REQUESTS) if not extra]
    refs = hf_logits(model_dir, [prompts[f"r{i}"] + sync[(f"r{i}", 0)] for i in greedy], device="cuda")
    for i, ref in zip(greedy, refs):
        tokens, n = sync[(f"r{i}", 0)], len(prompts[f"r{i}"])
        for j, tok in enumerate(tokens):      # HF's choice after the same prefix, or a near-tie
            row = ref[n - 1 + j]
            assert tok == row.argmax() or row.max() - row[tok] < 1e-3 * row.std(), (i, j)
