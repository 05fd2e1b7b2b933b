"""Single-prompt prefill graphs (gpu_worker/prefill_graphs.py): a replay padded to the next
captured size gives the eager step's logits and writes exactly the eager step's KV, with or
without a cached prefix, and only steps that prefill one sampled prompt take that path. On the CPU the graphs run eagerly
(same buffers and padding); the CUDA test replays real graphs with the triton backend."""
from __future__ import annotations

import os

import pytest
import torch

from test_model_parity import BLOCK, NUM_BLOCKS, Seq, build_batch

from gpu_worker.model_config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.prefill_graphs import prefill_sizes


def prompt_batch(tokens: list[int], blocks: list[int], computed: int = 0):
    """A ForwardBatch prefilling tokens[computed:] of one sequence; only its last row samples."""
    seq = Seq(tokens, blocks, computed=computed)
    batch = build_batch([(seq, len(tokens) - computed)])
    batch.logits_indices = batch.logits_indices[-1:]
    batch.num_decode_seqs = 0
    return batch


def fresh_runner(model_dir: str, device: str, backend: str, **kw) -> ModelRunner:
    runner = ModelRunner(ModelConfig.from_dir(model_dir), model_dir, device=device,
                         attention_backend=backend, **{"dtype": torch.float32, **kw})
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK)
    return runner


def check_replays_match_eager(model_dir: str, device: str, backend: str, tol: float = 1e-4, **kw) -> None:
    """Three steps, each through a graph on one runner and eagerly on the other: a 45-token
    prompt (padded to 48), a 17-token one (padded to 32: the tiles are renumbered), then the
    second turn of the first: 23 new tokens behind its 45 cached ones (read through the block
    table). The logits agree, and so do the KV caches: the padding rows wrote nothing."""
    g = torch.Generator().manual_seed(1)
    first = torch.randint(10, 1000, (68,), generator=g).tolist()
    blocks = [7, 30, 2, 11, 19, 4, 25, 33, 1, 14, 36, 8, 22, 3, 16, 28, 35]     # 17 blocks of 4
    second, blocks2 = torch.randint(10, 1000, (17,), generator=g).tolist(), [21, 5, 39, 12, 26]
    steps = [prompt_batch(first[:45], blocks), prompt_batch(second, blocks2),
             prompt_batch(first, blocks, computed=45)]
    eager = fresh_runner(model_dir, device, backend, **kw)
    graphs = fresh_runner(model_dir, device, backend, **kw)
    graphs.capture_prefill_graphs(64, max_context_len=NUM_BLOCKS * BLOCK)
    assert graphs.prefill_graphs.sizes == [16, 32, 48, 64]
    for batch in steps:
        assert graphs.prefill_graphs.can_run(graphs.prepare_inputs(batch))
        want = eager.forward(batch).float()       # eager: the model's dtype; the graph holds the head
        got = graphs.forward(batch)
        assert got.shape == (1, eager.vocab_size) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for eager_cache, graph_cache in zip(eager.kv_caches, graphs.kv_caches):
        for e, g in zip(eager_cache, graph_cache):
            if e.dtype == torch.float32:
                assert torch.equal(e, g)
                continue
            # bf16 / fp8: the padded GEMMs may round differently; the same slots are written
            e, g = e.float(), g.float()
            assert torch.equal(e.abs().sum((-2, -1)) != 0, g.abs().sum((-2, -1)) != 0)
            torch.testing.assert_close(g, e, rtol=0.1, atol=0.1 * float(e.abs().max()))


def test_prefill_sizes_ladder():
    assert prefill_sizes(100) == [16, 32, 48, 64, 80, 96]
    assert prefill_sizes(1024)[-1] == 1024 and len(prefill_sizes(1024)) == 64
    assert prefill_sizes(15) == []


def test_prefill_graph_padding_never_reaches_real_rows(tiny_models, monkeypatch):
    """Memory nothing wrote holds NaN here (torch.empty_like poisoned): a padded graph's rows
    past the prompt must still not reach its real rows. The prefill kernels' last key tile reads
    the padding's V with p = 0, and 0 x NaN is NaN, so the backend zeroes the padding's attention
    output (ForwardBatch.padded_rows) and everything after it in those rows stays finite."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton on the CPU needs TRITON_INTERPRET=1")
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda x, **kw: real(x, **kw).fill_(float("nan")))
    check_replays_match_eager(tiny_models["llama"], "cpu", "triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_graph_replay_matches_eager_cpu(tiny_models, backend):
    """triton: the kernels under TRITON_INTERPRET=1 (scripts/test.sh sets it), the padded rows
    outside every prefill tile, the decode kernel not launched."""
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton on the CPU needs TRITON_INTERPRET=1")
    check_replays_match_eager(tiny_models["llama"], "cpu", backend)


def test_only_single_whole_prompts_replay(tiny_models):
    runner = fresh_runner(tiny_models["qwen2"], "cpu", "torch")
    runner.capture_prefill_graphs(64, max_context_len=100)
    pg = runner.prefill_graphs
    tokens = list(range(10, 50))
    assert pg.can_run(prompt_batch(tokens, list(range(10))))
    assert pg.can_run(prompt_batch(tokens, list(range(10)), computed=8))       # behind a cached prefix
    assert not pg.can_run(prompt_batch(list(range(10, 80)), list(range(18))))  # 70 new tokens > 64
    long_context = list(range(10, 114))                                         # 104 > max_context_len
    assert not pg.can_run(prompt_batch(long_context, list(range(26)), computed=80))
    not_sampled = prompt_batch(tokens, list(range(10)))
    not_sampled.logits_indices = not_sampled.logits_indices[:0]               # a non-final chunk
    assert not pg.can_run(not_sampled)
    a, b = Seq(tokens, list(range(10))), Seq(tokens[:9], [20, 21, 22])
    two = build_batch([(a, 40), (b, 9)])
    two.logits_indices = torch.tensor([39, 48])
    assert not pg.can_run(two)                                                  # two sequences


def test_prefill_graphs_off_below_one_ladder_step(tiny_models):
    runner = fresh_runner(tiny_models["llama"], "cpu", "torch")
    runner.capture_prefill_graphs(15, max_context_len=64)
    assert runner.prefill_graphs is None


# The GPU variants of graph-vs-eager checks: fp32 with TF32 off (tolerance 1e-4), and the FP8
# paths (per-token activation quantization and scaled_mm captured; the fp8 KV write; 3e-2).
CUDA_VARIANTS = {"fp32": {}, "bf16 fp8-weights": dict(dtype=torch.bfloat16, quantization="fp8"),
                 "bf16 fp8-kv": dict(dtype=torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn)}


def run_cuda_variant(check, model_dir: str, variant: str) -> None:
    """check(model_dir, "cuda", "triton", tol=..., **variant kwargs) with TF32 off."""
    pytest.importorskip("triton")
    kw = CUDA_VARIANTS[variant]
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        check(model_dir, "cuda", "triton", tol=1e-4 if not kw else 3e-2, **kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", list(CUDA_VARIANTS))
def test_prefill_graph_replay_matches_eager_cuda(tiny_models, variant):
    """Real graphs: the same kernels as eager on the same rows."""
    run_cuda_variant(check_replays_match_eager, tiny_models["llama"], variant)
