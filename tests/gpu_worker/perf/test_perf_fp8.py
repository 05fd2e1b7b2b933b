"""quantization="fp8": Fp8Linear against the layer it replaces, and a whole quantized decoder
against its unquantized twin ("fp8_lm_head": the head too) (CPU: the fp8 kernel module's torch
reference maths)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu_worker.config import EngineConfig
from gpu_worker.model_config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.layers.fp8 import Fp8Linear, quantize_linears_fp8

# e4m3 keeps 3 mantissa bits: one weight or activation is off by up to 2^-4 relative, and a
# dot product of K such errors averages out to ~2-3% of the output's norm.
LAYER_TOL = 0.05
# Through the tiny random decoders (2 layers, hidden 64) the errors add up and attention
# amplifies them: measured logits rel. error vs fp32 0.10 (llama) / 0.15 (qwen3), where bf16
# weights give 0.016 / 0.019 (e4m3's unit roundoff is 16x bf16's). A broken scale or layout
# gives ~1.
LOGITS_TOL = 0.25


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_fp8_linear_matches_the_linear_it_replaces():
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=True).requires_grad_(False)
    q = Fp8Linear.from_linear(lin)
    assert q.weight.dtype == torch.float8_e4m3fn and q.weight.shape == (40, 96)
    assert q.weight_scale.shape == (40,) and q.weight_scale.dtype == torch.float32
    x = torch.randn(7, 96)
    y = q(x)
    assert y.dtype == x.dtype and y.shape == (7, 40) and torch.isfinite(y).all()
    assert rel_err(y, lin(x)) < LAYER_TOL
    # every output channel uses the format's whole range (per-channel scales)
    assert torch.allclose(q.weight.float().abs().amax(1), torch.full((40,), 448.0))


def test_quantize_replaces_only_decoder_linears(tiny_llama):
    cfg = ModelConfig.from_dir(tiny_llama)
    runner = ModelRunner(cfg, tiny_llama, quantization="fp8")
    layers = runner.model.model.layers
    assert all(isinstance(m, Fp8Linear) for layer in layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_up_proj, layer.mlp.down_proj))
    head = runner.model.lm_head
    assert head is None or type(head) is nn.Linear                # the head stays in the dtype
    assert quantize_linears_fp8(runner.model) == 0                # nothing left to replace


def _prefill_and_decode_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    from gpu_worker.batch_builder import build_forward_batch
    from gpu_worker.scheduler import ScheduledSeq
    from types import SimpleNamespace
    runner.allocate_kv_cache(16, 16)
    seq = SimpleNamespace(token_ids=list(prompt), num_computed_tokens=0, block_table=[0, 1, 2, 3])
    batch = build_forward_batch([ScheduledSeq(seq, len(prompt))], 16, runner.device)
    return runner.forward(batch)                                  # (1, V)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_quantized_decoder_logits_close_to_fp32(model, request):
    path = request.getfixturevalue(model)
    cfg = ModelConfig.from_dir(path)
    ref = ModelRunner(cfg, path)                                  # fp32 weights
    fp8 = ModelRunner(cfg, path, quantization="fp8")
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(40)]
    a, b = _prefill_and_decode_logits(fp8, prompt), _prefill_and_decode_logits(ref, prompt)
    assert torch.isfinite(a).all()
    assert rel_err(a, b) < LOGITS_TOL
    cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
    assert float(cos) > 0.97


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])           # its own head / tied embeddings
def test_fp8_lm_head(model, request):
    """quantization="fp8_lm_head": the decoder as with "fp8", plus an e4m3 head; the logits stay
    close to the bf16 head's (per-channel scales: the head's own rounding, a few percent), the
    embeddings are untouched, an own bf16 head is freed."""
    path = request.getfixturevalue(model)
    cfg = ModelConfig.from_dir(path)
    fp8 = ModelRunner(cfg, path, quantization="fp8")
    both = ModelRunner(cfg, path, quantization="fp8_lm_head")
    head = both.model.head_fp8
    assert isinstance(head, Fp8Linear) and head.weight.shape == (cfg.vocab_size, cfg.hidden_size)
    assert fp8.model.head_fp8 is None
    assert torch.equal(both.model.model.embed_tokens.weight, fp8.model.model.embed_tokens.weight)
    if both.model.lm_head is not None:
        assert both.model.lm_head.weight.numel() == 0             # the bf16 head's memory is back
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(40)]
    a, b = _prefill_and_decode_logits(both, prompt), _prefill_and_decode_logits(fp8, prompt)
    assert torch.isfinite(a).all() and a.shape == b.shape and not torch.equal(a, b)
    assert rel_err(a, b) < LAYER_TOL


def test_engine_config_quantization_values(tiny_llama):
    assert EngineConfig(model=tiny_llama, quantization="fp8").quantization == "fp8"
    assert EngineConfig(model=tiny_llama, quantization="fp8_lm_head").quantization == "fp8_lm_head"
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=tiny_llama, quantization="int4")


@pytest.mark.parametrize("quantization", ["fp8", "fp8_lm_head"])
def test_engine_generates_with_fp8(tiny_llama, quantization):
    from gpu_worker.engine import Engine
    from services.protocol.sampling import SamplingParams
    eng = Engine(EngineConfig(model=tiny_llama, quantization=quantization, device="cpu"))
    eng.add_request("a", [5, 9, 11, 30], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    tokens = []
    while eng.has_unfinished_requests():
        for d in eng.step():
            tokens += d.new_token_ids
    assert len(tokens) == 6 and all(0 <= t < eng.vocab_size for t in tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_lm_head_on_the_gpu(tiny_llama):
    """On CUDA the e4m3 head runs the split-K GEMV for 1-4 rows and _scaled_mm above: both close
    to the bf16 head's logits."""
    cfg = ModelConfig.from_dir(tiny_llama)
    bf16 = ModelRunner(cfg, tiny_llama, device="cuda", dtype=torch.bfloat16, attention_backend="triton")
    both = ModelRunner(cfg, tiny_llama, device="cuda", dtype=torch.bfloat16, attention_backend="triton",
                       quantization="fp8_lm_head")
    for rows in (1, 3, 8, 64):
        hidden = torch.randn(rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        a, b = both.model.compute_logits(hidden), bf16.model.compute_logits(hidden)
        assert a.dtype == torch.float32 and a.shape == (rows, cfg.vocab_size)
        assert rel_err(a, b) < LAYER_TOL, rows
