"""The decoder's fused-kernel path (residual-fused RMSNorm, in-place RoPE, SwiGLU, and for decode
steps of a few tokens the GEMV layer: every linear a split-K GEMV, the norms, SwiGLU and residual
adds either separate or fused into the GEMVs; by default one token, unfused, widened here) computes
what its torch path computes. On the CPU the 'kernels' are the kernels' own torch
references, so this checks the decoder's wiring (where the residual adds moved, which tensors
RoPE rotates in place, the residual stream the GEMV layers hand on); bench/engine_perf.py and the
kernels' tests cover the Triton launches on the GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpu_worker.batch_builder import build_forward_batch
from gpu_worker.model_config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.scheduler import ScheduledSeq
from gpu_worker.tuning import KernelTuning


def reference_kernels(calls: list | None = None) -> SimpleNamespace:
    """The fused launchers' torch references; `calls` collects one entry per GEMV launch: the
    keywords it was given a value for."""
    from gpu_worker.kernels.fp8_gemv import MAX_M, w8_gemv_ref
    from gpu_worker.kernels.rmsnorm import rmsnorm_ref
    from gpu_worker.kernels.rope import rope_ref
    from gpu_worker.kernels.swiglu import swiglu_ref

    def rope_(positions, q, k, cos_sin):
        q2, k2 = rope_ref(positions, q, k, cos_sin)
        q.copy_(q2)
        k.copy_(k2)

    def gemv(*args, **kw):
        if calls is not None:
            calls.append(sorted(k for k, v in kw.items() if v is not None and v is not False))
        return w8_gemv_ref(*args, **kw)

    return SimpleNamespace(rmsnorm=rmsnorm_ref, rope_=rope_, swiglu=swiglu_ref, gemv=gemv, gemv_max_rows=MAX_M)


@torch.inference_mode()       # as ModelRunner.forward runs (in-place RoPE on views of the qkv output)
def prefill_mixed_decode(runner: ModelRunner) -> list[torch.Tensor]:
    """A prefill of two sequences, a mixed step (chunk + decode), then a decode step of both
    (two tokens: the fused-GEMV layers when kernels are set); every row's final hidden state of
    each step (the later ones read the KV cache the earlier ones wrote)."""
    g = torch.Generator().manual_seed(0)
    seqs = [SimpleNamespace(token_ids=torch.randint(10, 200, (n,), generator=g).tolist(),
                            num_computed_tokens=0, block_table=list(range(i * 8, i * 8 + 8)))
            for i, n in enumerate((21, 9))]
    runner.allocate_kv_cache(32, 4)
    out = [runner.run_model(build_forward_batch([ScheduledSeq(seqs[0], 12), ScheduledSeq(seqs[1], 8)], 4, "cpu"))]
    seqs[0].num_computed_tokens, seqs[1].num_computed_tokens = 12, 8
    out.append(runner.run_model(build_forward_batch([ScheduledSeq(seqs[0], 9), ScheduledSeq(seqs[1], 1)], 4, "cpu")))
    for seq in seqs:
        seq.token_ids.append(7)
        seq.num_computed_tokens = len(seq.token_ids) - 1
    out.append(runner.run_model(build_forward_batch([ScheduledSeq(seqs[0], 1), ScheduledSeq(seqs[1], 1)], 4, "cpu")))
    return out


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_fused_path_matches_torch_path(arch, fuse, request):
    tuning = KernelTuning(decode_gemv_max_m=2,           # the decode step has two rows
                          decode_gemv_weights="all",     # these weights are fp32
                          decode_gemv_fuse=fuse)
    model_dir = request.getfixturevalue(arch)
    runner = ModelRunner(ModelConfig.from_dir(model_dir), model_dir, device="cpu", dtype=torch.float32,
                         tuning=tuning)
    plain = prefill_mixed_decode(runner)
    calls = []
    runner.model.use_fused_kernels(reference_kernels(calls))
    assert runner.model.model.layers[0].mlp.kernels is not None
    fused = prefill_mixed_decode(runner)
    layers = len(runner.model.model.layers)            # the decode step only: 4 GEMVs a layer
    if fuse:      # the norms and SwiGLU in the epilogues; the last layer writes the final norm
        assert calls == [[], ["norm_out", "residual"], ["swiglu_out"], ["norm_out", "residual"]] * layers
    else:
        assert calls == [[]] * 4 * layers
    for a, b in zip(plain, fused):
        assert a.shape == b.shape
        assert float((a - b).norm() / a.norm()) < 1e-5


def test_warmup_batch_writes_nothing(tiny_llama):
    runner = ModelRunner(ModelConfig.from_dir(tiny_llama), tiny_llama, device="cpu", dtype=torch.float32)
    runner.allocate_kv_cache(16, 4)
    hidden = runner.run_model(runner._warmup_batch([17, 1, 1]))
    assert hidden.shape[0] == 19 and torch.isfinite(hidden).all()
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)


def test_decode_gemv_env_is_checked():
    """A bad KVMESH_DECODE_GEMV_* value stops the engine config with the variable's name, not later."""
    from gpu_worker.config import tuning_from_env
    env = {"KVMESH_DECODE_GEMV_MAX_M": "2", "KVMESH_DECODE_GEMV_WEIGHTS": "all", "KVMESH_DECODE_GEMV_FUSE": "0"}
    t = tuning_from_env(env)
    assert (t.decode_gemv_max_m, t.decode_gemv_weights, t.decode_gemv_fuse) == (2, "all", False)
    with pytest.raises(ValueError, match="KVMESH_DECODE_GEMV_FUSE"):
        tuning_from_env({**env, "KVMESH_DECODE_GEMV_FUSE": "yes"})
    with pytest.raises(ValueError, match="KVMESH_DECODE_GEMV_WEIGHTS"):
        tuning_from_env({**env, "KVMESH_DECODE_GEMV_FUSE": "1", "KVMESH_DECODE_GEMV_WEIGHTS": "bf16"})
    with pytest.raises(ValueError, match="KVMESH_DECODE_GEMV_MAX_M"):
        tuning_from_env({**env, "KVMESH_DECODE_GEMV_MAX_M": "-1"})


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])   # qwen3's tiny model ties its head
def test_head_runs_as_gemv_where_the_layers_do(arch, request):
    """compute_logits sends the 16-bit head through the GEMV for the rows the decoder layers run
    as GEMVs (decode_gemv_max_m), with the head's weight (the embeddings when tied), and gives what
    the matmul gives; more rows, head_gemv off, or decode_gemv_weights "fp8" keep the matmul."""
    model_dir = request.getfixturevalue(arch)

    def model_with(**tuning):
        runner = ModelRunner(ModelConfig.from_dir(model_dir), model_dir, device="cpu", dtype=torch.float32,
                             tuning=KernelTuning(decode_gemv_max_m=1, **tuning))
        runner.model.use_fused_kernels(reference_kernels(calls))
        return runner.model

    calls = []
    model = ModelRunner(ModelConfig.from_dir(model_dir), model_dir, device="cpu", dtype=torch.float32,
                        tuning=KernelTuning(decode_gemv_max_m=1)).model
    hidden = torch.randn(2, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    plain = model.compute_logits(hidden)
    calls = []
    model.use_fused_kernels(reference_kernels(calls))
    assert model.kernels is not None
    one = model.compute_logits(hidden[:1])
    assert calls == [[]] and one.dtype == torch.float32
    assert float((one - plain[:1]).norm() / plain[:1].norm()) < 1e-6
    head = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    assert (model.lm_head is None) == model.cfg.tie_word_embeddings and one.shape[1] == head.shape[0]
    assert torch.equal(model.compute_logits(hidden), plain) and len(calls) == 1     # 2 rows > gemv_max_m
    model_with(head_gemv=False).compute_logits(hidden[:1])
    model_with(decode_gemv_weights="fp8").compute_logits(hidden[:1])
    assert len(calls) == 1


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])     # qwen3: per-head q/k norms too
def test_model_is_built_with_its_launchers(arch, request):
    """The launchers are a constructor argument: every norm, MLP, attention and layer holds them
    from construction (nothing injected afterwards); use_fused_kernels(None) switches all of them
    back to torch ops, and a model built without launchers has none anywhere."""
    from gpu_worker.attention.torch_backend import TorchAttentionBackend
    from gpu_worker.models.decoder import Attention, CausalLM, DecoderLayer
    from gpu_worker.models.layers import GatedMLP, RMSNorm
    cfg = ModelConfig.from_dir(request.getfixturevalue(arch))
    kernels = reference_kernels()
    with torch.device("meta"):
        model = CausalLM(cfg, TorchAttentionBackend(), torch.float32, kernels=kernels)
        plain = CausalLM(cfg, TorchAttentionBackend(), torch.float32)
    kinds = (CausalLM, DecoderLayer, Attention, RMSNorm, GatedMLP)
    holders = [m for m in model.modules() if isinstance(m, kinds)]
    assert len(holders) >= 1 + 5 * cfg.num_layers + 1 and all(m.kernels is kernels for m in holders)
    assert all(m.kernels is None for m in plain.modules() if isinstance(m, kinds))
    model.use_fused_kernels(None)
    assert all(m.kernels is None for m in holders)
