"""Piecewise graphs (gpu_worker/piecewise_graphs.py): steps that no whole-step graph serves (several
prompts, a prefill chunk beside decodes) replay the model between attentions on static buffers
padded to the next 64-token size, and give the eager step's logits and KV cache. On the CPU the
pieces run eagerly (same buffers and padding); the CUDA test replays real graphs."""
from __future__ import annotations

import os

import pytest
import torch

from test_model_parity import NUM_BLOCKS, Seq, build_batch
from test_prefill_graphs import CUDA_VARIANTS, fresh_runner, run_cuda_variant

from gpu_worker.piecewise_graphs import piecewise_sizes


def mixed_steps(vocab: int) -> list[list[tuple[Seq, int]]]:
    """Three steps over four sequences: two prompts together (50 tokens -> size 64); a decode
    beside a 70-token chunk of a third prompt (71 -> 128); then three decodes beside a fourth
    prompt of 5 tokens (8 -> 64)."""
    g = torch.Generator().manual_seed(3)
    toks = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()   # noqa: E731
    a = Seq(toks(33), [7, 30, 2, 11, 19, 4, 25, 33, 1])
    b = Seq(toks(22), [21, 5, 39, 12, 26, 0])
    c = Seq(toks(73), [6, 9, 13, 15, 17, 18, 20, 23, 24, 27, 28, 29, 31, 32, 34, 35, 36, 37, 38])
    d = Seq(toks(5), [10, 3])
    return [[(a, 30), (b, 20)], [(a, 1), (c, 70)], [(a, 1), (b, 1), (c, 1), (d, 5)]]


def check_piecewise_matches_eager(model_dir: str, device: str, backend: str, tol: float = 1e-4, **kw) -> None:
    eager = fresh_runner(model_dir, device, backend, **kw)
    graphs = fresh_runner(model_dir, device, backend, **kw)
    graphs.capture_piecewise_graphs(128)
    pg = graphs.piecewise_graphs
    assert pg is not None and pg.sizes == [64, 128]
    for step in mixed_steps(eager.vocab_size):
        batch = build_batch(step)
        assert pg.can_run(graphs.prepare_inputs(batch))
        want = eager.forward(batch)
        got = graphs.forward(batch)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        for seq, n in step:
            seq.computed += n
    kv_dtype = eager.kv_caches[0][0].dtype
    for eager_cache, graph_cache in zip(eager.kv_caches, graphs.kv_caches):
        for e, g in zip(eager_cache, graph_cache):
            # the same slots are written (the padding rows wrote nothing) ...
            e, g = e.float(), g.float()
            assert torch.equal(e.abs().sum((-2, -1)) != 0, g.abs().sum((-2, -1)) != 0)
            # ... with the same values up to rounding: a GEMM over the padded rows may block differently
            if kv_dtype == torch.float32:
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
            else:
                torch.testing.assert_close(g, e, rtol=0.1, atol=0.1 * float(e.abs().max()))


def test_piecewise_sizes_ladder():
    assert piecewise_sizes(200) == [64, 128, 192]
    assert piecewise_sizes(2048)[-1] == 2048 and len(piecewise_sizes(2048)) == 32
    assert piecewise_sizes(63) == []


@pytest.mark.parametrize("arch", ["llama", "qwen3"])          # qwen3: q/k RMSNorm inside a piece
def test_piecewise_matches_eager_cpu_torch(tiny_models, arch):
    check_piecewise_matches_eager(tiny_models[arch], "cpu", "torch")


def test_piecewise_matches_eager_cpu_triton(tiny_models):
    """The triton backend's kernels under TRITON_INTERPRET=1: decode and prefill rows in one
    step, attention over the real rows only."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton on the CPU needs TRITON_INTERPRET=1")
    check_piecewise_matches_eager(tiny_models["llama"], "cpu", "triton")


def test_piecewise_off_below_one_ladder_step_and_steps_past_the_largest(tiny_models):
    runner = fresh_runner(tiny_models["llama"], "cpu", "torch")
    runner.capture_piecewise_graphs(32)
    assert runner.piecewise_graphs is None
    runner.capture_piecewise_graphs(64)
    tiny = [(Seq([11, 12, 13], [2]), 3), (Seq([14, 15], [3]), 1)]
    assert not runner.piecewise_graphs.can_run(build_batch(tiny))          # 4 tokens: eager
    a = Seq(list(range(10, 110)), list(range(NUM_BLOCKS))[:25])
    assert not runner.piecewise_graphs.can_run(build_batch([(a, 100)]))   # 100 tokens > 64: eager
    want = fresh_runner(tiny_models["llama"], "cpu", "torch").forward(build_batch([(a, 100)]))
    torch.testing.assert_close(runner.forward(build_batch([(a, 100)])), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", list(CUDA_VARIANTS))
def test_piecewise_matches_eager_cuda(tiny_models, variant):
    """Real graphs around eager attention: the fused RoPE + KV write inside the pieces, the FP8
    paths (activation quantization and scaled_mm captured; the fp8 KV write)."""
    run_cuda_variant(check_piecewise_matches_eager, tiny_models["llama"], variant)
