"""The decoder's fused-kernel path (residual-fused RMSNorm, in-place RoPE, SwiGLU) computes what
its torch path computes. On the CPU the 'kernels' are the kernels' own torch references, so this
checks the decoder's wiring (where the residual adds moved, which tensors RoPE rotates in place);
bench/engine_perf.py and the kernels' tests cover the Triton launches on the GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpu_worker.batch_builder import build_forward_batch
from gpu_worker.model_config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.scheduler import ScheduledSeq


def reference_kernels() -> SimpleNamespace:
    from gpu_worker.kernels.rmsnorm import rmsnorm_ref
    from gpu_worker.kernels.rope import rope_ref
    from gpu_worker.kernels.swiglu import swiglu_ref

    def rope_(positions, q, k, cos_sin):
        q2, k2 = rope_ref(positions, q, k, cos_sin)
        q.copy_(q2)
        k.copy_(k2)

    return SimpleNamespace(rmsnorm=rmsnorm_ref, rope_=rope_, swiglu=swiglu_ref)


@torch.inference_mode()       # as ModelRunner.forward runs (in-place RoPE on views of the qkv output)
def two_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """A prefill of two sequences, then a mixed step (chunk + decode); every row's final hidden
    state of both steps (the second reads the KV cache the first wrote)."""
    g = torch.Generator().manual_seed(0)
    seqs = [SimpleNamespace(token_ids=torch.randint(10, 200, (n,), generator=g).tolist(),
                            num_computed_tokens=0, block_table=list(range(i * 8, i * 8 + 8)))
            for i, n in enumerate((21, 9))]
    runner.allocate_kv_cache(32, 4)
    out = [runner.run_model(build_forward_batch([ScheduledSeq(seqs[0], 12), ScheduledSeq(seqs[1], 8)], 4, "cpu"))]
    seqs[0].num_computed_tokens, seqs[1].num_computed_tokens = 12, 8
    out.append(runner.run_model(build_forward_batch([ScheduledSeq(seqs[0], 9), ScheduledSeq(seqs[1], 1)], 4, "cpu")))
    return out


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_fused_path_matches_torch_path(arch, request):
    model_dir = request.getfixturevalue(arch)
    runner = ModelRunner(ModelConfig.from_dir(model_dir), model_dir, device="cpu", dtype=torch.float32)
    plain = two_steps(runner)
    runner.model.use_fused_kernels(reference_kernels())
    assert runner.model.model.layers[0].mlp.kernels is not None
    fused = two_steps(runner)
    for a, b in zip(plain, fused):
        assert a.shape == b.shape
        assert float((a - b).norm() / a.norm()) < 1e-5


def test_warmup_batch_writes_nothing(tiny_llama):
    runner = ModelRunner(ModelConfig.from_dir(tiny_llama), tiny_llama, device="cpu", dtype=torch.float32)
    runner.allocate_kv_cache(16, 4)
    hidden = runner.run_model(runner._warmup_batch([17, 1, 1]))
    assert hidden.shape[0] == 19 and torch.isfinite(hidden).all()
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)
