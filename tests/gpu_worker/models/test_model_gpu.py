"""The same parity checks on a CUDA GPU, for the torch and triton attention backends, plus
bf16 and KV-cache profiling. Run on the device machine; skipped without CUDA."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from test_model_parity import assert_close, build_batch, hf_logits, long_chunk_run, three_step_run, Seq

from gpu_worker.model_config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.tuning import KernelTuning

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
# fp32 against Hugging Face's fp32, of the logits' std, both backends: the Triton attention dots
# take fp32 at tf32x3 (kernels/_paged_kv.F32_DOTS; plain TF32 drifted to 1.5e-2).
FP32_TOL = 1e-4


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_fp32_cuda_matches_hf(tiny_models, arch, backend):
    model_dir = tiny_models[arch]
    seqs, _ = three_step_run(model_dir, 1024, device="cuda", backend=backend)
    assert_close(seqs, hf_logits(model_dir, [s.tokens for s in seqs], device="cuda"), FP32_TOL)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunks_behind_a_prefix_cuda_match_hf(tiny_models, monkeypatch, arch):
    """fp32: Hugging Face's logits. bf16: the same engine with those chunks on paged_prefill_attention
    (only the attention kernel differs; bf16 against Hugging Face's bf16 drifts to 0.075 of the
    logits' std over these 74 positions with the torch backend alone, on the CPU)."""
    import gpu_worker.attention.triton_backend as tb
    prefixes = []
    real = tb.fresh_prefill_attention
    monkeypatch.setattr(tb, "fresh_prefill_attention",
                        lambda *a, **kw: prefixes.append(kw["prefix"] is not None) or real(*a, **kw))
    model_dir = tiny_models[arch]
    seqs = long_chunk_run(model_dir, 1024, "cuda", torch.float32)
    assert prefixes and all(prefixes), prefixes           # both prefill steps, every layer, behind a prefix
    assert_close(seqs, hf_logits(model_dir, [s.tokens for s in seqs], device="cuda"), FP32_TOL)
    seqs = long_chunk_run(model_dir, 1024, "cuda", torch.bfloat16)
    calls = len(prefixes)
    v2 = long_chunk_run(model_dir, 1024, "cuda", torch.bfloat16, KernelTuning(fresh_prefix=False))
    assert len(prefixes) == calls                         # v2 took every prefill step
    assert_close(seqs, [torch.stack(s.logits) for s in v2], rel_tol=0.05)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_cuda_close_to_hf_bf16(tiny_models, backend):
    model_dir = tiny_models["llama"]
    seqs, _ = three_step_run(model_dir, 1024, device="cuda", dtype=torch.bfloat16, backend=backend)
    assert_close(seqs, hf_logits(model_dir, [s.tokens for s in seqs], device="cuda", dtype=torch.bfloat16),
                 rel_tol=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_adds_inside_the_gemms_cuda(tiny_models, dtype):
    """Every step with the residual added by cuBLAS's C input (normally prefill-sized steps only),
    the Triton kernels' plain RMSNorm after it: held to Hugging Face like the default path."""
    model_dir = tiny_models["llama"]
    seqs, _ = three_step_run(model_dir, 1024, device="cuda", dtype=dtype, backend="triton",
                             tuning=KernelTuning(residual_gemm_min_rows=1))
    ref = hf_logits(model_dir, [s.tokens for s in seqs], device="cuda", dtype=dtype)
    assert_close(seqs, ref, FP32_TOL if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_sliding_window_cuda(make_tiny, backend):
    model_dir = make_tiny("mistral", sliding_window=5)
    seqs, _ = three_step_run(model_dir, 1024, device="cuda", backend=backend)
    assert_close(seqs, hf_logits(model_dir, [s.tokens for s in seqs], device="cuda"), FP32_TOL)


def test_profile_num_blocks_cuda(tiny_models):
    runner = ModelRunner(ModelConfig.from_dir(tiny_models["qwen3"]), tiny_models["qwen3"], device="cuda",
                         dtype=torch.bfloat16, attention_backend="auto")
    n = runner.profile_num_blocks(16, 0.05)
    free, total = torch.cuda.mem_get_info()
    assert 1 <= n and n * runner.block_size_bytes(16) <= 0.05 * total
    runner.allocate_kv_cache(64, 16)
    seq = Seq(list(range(20, 60)), [7, 3, 50])
    assert runner.forward(build_batch_16([(seq, 40)])).shape == (40, 1024)


def test_profile_num_blocks_leaves_room_for_the_largest_draw(tiny_models):
    """With max_num_seqs the budget leaves room for that many rows of logits and their sampling:
    at least their float32 logits fewer bytes of KV cache than the forward alone leaves."""
    runner = ModelRunner(ModelConfig.from_dir(tiny_models["qwen3"]), tiny_models["qwen3"], device="cuda",
                         dtype=torch.bfloat16, attention_backend="auto")
    per_block = runner.block_size_bytes(16)
    forward_only = runner.profile_num_blocks(16, 0.05, 512)
    with_draw = runner.profile_num_blocks(16, 0.05, 512, max_num_seqs=8192)
    logits_bytes = 8192 * runner.config.vocab_size * 4
    assert forward_only - with_draw >= logits_bytes // per_block


def build_batch_16(steps):
    import test_model_parity as p

    old, p.BLOCK = p.BLOCK, 16
    try:
        return build_batch(steps)
    finally:
        p.BLOCK = old


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs triton")
@pytest.mark.parametrize("arch", ["qwen3", "llama"])      # llama: RoPE + KV write fused into split attention
@pytest.mark.parametrize("short_splits,merge,hpp", [(1, "two_pass", None), (8, "two_pass", None), (8, "last", None),
                                                    (1, "two_pass", 1)])
def test_cuda_graph_decode_matches_eager(tiny_models, arch, short_splits, merge, hpp):
    """Decode graphs (PDL where on) against eager steps and Hugging Face; with the short-context
    split on (these contexts are short: choose_short_split), merged in the launch or by a second
    kernel, or a program per query head. Eager steps keep the default kernels, so only the
    default graphs equal them to 1e-4; the others sum in other orders and are held to Hugging
    Face's logits and greedy tokens instead."""
    from gpu_worker.tuning import DecodeAttentionTuning
    tuning = KernelTuning(decode_attention=DecodeAttentionTuning(short_max_splits=short_splits, merge=merge,
                                                                 short_heads_per_program=hpp))
    model_dir = tiny_models[arch]
    seqs, runner = three_step_run(model_dir, 1024, device="cuda", backend="triton", tuning=tuning)
    for s in seqs:
        s.tokens.append(77)
    decode = build_batch([(s, 1) for s in seqs])
    eager = runner.forward(decode)
    runner.capture_cuda_graphs(max_batch_size=8, max_context_len=128)
    assert runner.decode_graphs.can_run(decode)
    graph = runner.forward(decode)
    if (short_splits, hpp) == (1, None):
        assert torch.allclose(graph, eager, atol=1e-4)
    refs = hf_logits(model_dir, [s.tokens for s in seqs], device="cuda")
    for row, ref in zip(graph.cpu(), refs):             # the appended token's logits: HF's last row
        assert (row - ref[-1]).abs().max() < FP32_TOL * ref[-1].std()
        assert row.argmax() == ref[-1].argmax()


def test_cuda_graphs_refuse_torch_backend(tiny_models):
    _, runner = three_step_run(tiny_models["llama"], 1024, device="cuda", backend="torch")
    with pytest.raises(ValueError, match="triton"):
        runner.capture_cuda_graphs(max_batch_size=4, max_context_len=64)
